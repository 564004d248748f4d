"""Done-when check of issue 4 on the real demo corpus: `trainlab data inspect` over
100 steps of the tiny recipe's global batch delivers each source's token share
within 1 percentage point of its weight (Ray Data on the shared cluster)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from trainlab.cli import main

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def demo_prepared(ray_cluster: Any) -> Path:
    """data/demo/prepared, built (corpus + prep) if this checkout has none yet;
    prep says "up to date" and does nothing when it is current."""
    from devtools.demo_corpus import build_demo_corpus
    from trainlab.data.prep import run_prep

    build_demo_corpus(REPO / "data/demo/raw")
    out = REPO / "data/demo/prepared"
    run_prep(REPO / "data_prep/sources/demo.yaml", out)
    return out


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["data", "inspect", *args])
    out, err = capsys.readouterr()
    return int(e.value.code or 0), out, err


def test_demo_shares_within_one_point_over_100_tiny_steps(
    demo_prepared: Path, repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _inspect(
        capsys,
        str(repo / "trainers/recipes/tiny.yaml"),
        "--steps",
        "100",
        "--json",
        "--set",
        f"data.path={demo_prepared}",
    )
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["steps"] == 100 and report["backend"] == "ray_data"
    assert report["tokens"] == 100 * report["global_batch_size"] * report["seq_len"]
    assert set(report["sources"]) == {"code", "docs", "pkgdocs"}
    for name, s in report["sources"].items():
        assert set(s) >= {"weight", "token_share", "docs", "epochs"}
        assert abs(s["token_share"] - s["weight"]) < 0.01, name
        assert s["docs"] > 0 and 0 < s["epochs"] < 1
    assert report["padding_fraction"] == 0.0  # training rows are always full
    assert report["tokens_per_second"] > 0


def test_a_mix_over_the_repetition_cap_exits_2_naming_the_source(
    demo_prepared: Path, repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _inspect(
        capsys,
        str(repo / "trainers/recipes/tiny.yaml"),
        "--set",
        f"data.path={demo_prepared}",
        "--set",
        "train.total_steps=100000",
        "--set",
        "data.max_epochs_per_source=2",
    )
    assert code == 2 and out == ""
    assert err.startswith("error: data.mix.") and "epochs" in err and "Traceback" not in err
