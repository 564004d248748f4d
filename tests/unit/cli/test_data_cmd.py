"""`trainlab data inspect` refuses bad input before starting Ray: exit 2, one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from devtools.datasets import small_dataset
from tests.conftest import RECIPES
from trainlab.cli import main

TINY = RECIPES / "tiny.yaml"


Inspect = Callable[..., tuple[int, str, str]]


@pytest.fixture
def inspect(capsys: pytest.CaptureFixture[str]) -> Inspect:
    def run(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as e:
            main(["data", "inspect", *args])
        out, err = capsys.readouterr()
        return int(e.value.code or 0), out, err

    return run


def test_missing_prepared_dataset_exits_2_with_one_line(inspect: Inspect, tmp_path: Path) -> None:
    code, out, err = inspect(str(TINY), "--set", f"data.path={tmp_path}/none", "--json")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("error: data.path = ")
    assert line.endswith(f"run `trainlab prep SOURCES --out {tmp_path}/none` first")


def test_unknown_source_in_the_mix_exits_2_naming_it(
    inspect: Inspect, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = small_dataset(tmp_path_factory.getbasetemp() / "small-ds")
    code, _, err = inspect(
        str(TINY), "--set", f"data.path={root}", "--set", "data.mix={code: 0.5, cod: 0.5}"
    )
    assert code == 2
    assert err.strip().splitlines() == [
        "error: data.mix.cod: no source 'cod' in the prepared dataset (sources: code, docs, tiny)"
    ]


def test_steps_must_be_positive(inspect: Inspect) -> None:
    code, _, err = inspect(str(TINY), "--steps", "0")
    assert code == 2 and "--steps" in err
