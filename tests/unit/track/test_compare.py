"""`trainlab compare` and `trainlab runs` over a real store holding runs recorded
by the real callbacks: JSON/CSV/table output, selection, and user errors."""

from __future__ import annotations

import csv
import io
import json
import shutil
import statistics

import pytest

from tests.unit.track.conftest import FakeRank0, tiny_config
from trainlab.cli import main


def trainlab(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture(scope="module")
def runs_root(_template_db, tmp_path_factory):
    """One store for the module holding `base` and then `hot` (higher lr, more code
    in the mix), both completed; recording runs is the slow part."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        root = tmp_path_factory.mktemp("compare") / "runs"
        root.mkdir()
        shutil.copy(_template_db, root / "mlflow.db")
        FakeRank0(tiny_config(root, "name=base"), root).full_run()
        FakeRank0(
            tiny_config(
                root, "name=hot", "train.lr=0.005", "data.mix.code=0.7", "purpose=try a hotter lr"
            ),
            root,
        ).full_run()
        yield root


@pytest.fixture(scope="module")
def client(runs_root):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{runs_root / 'mlflow.db'}")


def test_compare_json_has_the_documented_fields(runs_root, client, capsys):
    code, out, _ = trainlab(capsys, "compare", "--json", "--runs-root", str(runs_root))
    assert code == 0
    rows = json.loads(out.strip().splitlines()[-1])["runs"]
    assert [r["name"] for r in rows] == ["hot", "base"]  # newest first
    for row in rows:
        for key in (
            "name",
            "run_id",
            "status",
            "final_loss",
            "val_loss",
            "best_val_loss",
            "tokens_per_second",
            "params",
            "peak_memory_gb",
            "wall_time_s",
            "mix",
        ):
            assert key in row, key
        assert row["status"] == "completed"
        run_id = row["run_id"]
        losses = client.get_metric_history(run_id, "loss")
        assert row["final_loss"] == max(losses, key=lambda m: m.step).value
        evals = client.get_metric_history(run_id, "val_loss/all")
        assert row["val_loss"] == max(evals, key=lambda m: m.step).value  # the latest
        assert row["best_val_loss"] == min(m.value for m in evals)
        assert row["tokens_per_second"] == statistics.median(
            m.value for m in client.get_metric_history(run_id, "tokens_per_s")
        )
        assert row["peak_memory_gb"] == pytest.approx(1.1 + 60 / 1000)
    hot = rows[0]
    assert hot["params"]["train.lr"] == 0.005  # flattened, typed
    assert hot["params"]["data.mix.code"] == 0.7
    assert hot["mix"] == {"code": 0.7, "docs": 0.3, "pkgdocs": 0.2}
    # `purpose` and `name` differ too, but they describe the record, not the experiment.
    assert set(hot["differing"]) == {"train.lr", "data.mix.code"}


def test_compare_selects_by_name_experiment_and_since(runs_root, capsys):
    root = ("--runs-root", str(runs_root))
    _, out, _ = trainlab(capsys, "compare", "base", "--json", *root)
    (row,) = json.loads(out)["runs"]
    assert row["name"] == "base" and row["differing"] == {}
    _, out, _ = trainlab(capsys, "compare", row["run_id"], "--json", *root)
    assert [r["name"] for r in json.loads(out)["runs"]] == ["base"]
    _, out, _ = trainlab(capsys, "compare", "--experiment", "tiny", "--json", *root)
    assert len(json.loads(out)["runs"]) == 2
    _, out, _ = trainlab(capsys, "compare", "--since", "2999-01-01", "--json", *root)
    assert json.loads(out)["runs"] == []
    _, out, _ = trainlab(capsys, "compare", "--since", "2000-01-01", "--json", *root)
    assert len(json.loads(out)["runs"]) == 2


def test_compare_table_highlights_differing_keys(runs_root, capsys):
    code, out, _ = trainlab(capsys, "compare", "--runs-root", str(runs_root))
    assert code == 0
    assert "base" in out and "hot" in out and "completed" in out
    # The differing keys are said once, in their table with each run's value (they
    # used to be listed a second time, "(highlighted)", even when piped).
    table = out[out.index("differing config keys") :]
    assert "data.mix.code" in table and "train.lr" in table and "0.005" in table
    assert out.count("train.lr") == 1 and "(highlighted)" not in out


def test_compare_csv(runs_root, capsys):
    _, out, _ = trainlab(capsys, "compare", "--csv", "--runs-root", str(runs_root))
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["name"] for r in rows] == ["hot", "base"]
    assert rows[0]["param.train.lr"] == "0.005" and rows[1]["mix.code"] == "0.5"
    assert float(rows[0]["final_loss"]) > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "nope"], "no run named 'nope'"),
        (["compare", "--experiment", "nope"], "--experiment 'nope': no such experiment"),
        (["compare", "--since", "last tuesday"], "--since 'last tuesday': expected a date"),
        (["compare", "--json", "--csv"], "--json and --csv: choose one"),
        (["runs", "--since", "13/01/2026"], "--since '13/01/2026'"),
    ],
)
def test_bad_input_exits_2_with_one_line(runs_root, capsys, argv, message):
    code, out, err = trainlab(capsys, *argv, "--runs-root", str(runs_root))
    assert code == 2
    assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1
    assert out == ""


def test_runs_lists_recent_runs(runs_root, capsys):
    _, out, _ = trainlab(capsys, "runs", "--json", "--runs-root", str(runs_root))
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["hot", "base"]
    assert set(rows[0]) >= {"name", "status", "started", "duration_s", "run_id"}
    _, out, _ = trainlab(capsys, "runs", "-n", "1", "--json", "--runs-root", str(runs_root))
    assert [r["name"] for r in json.loads(out)] == ["hot"]
    _, out, _ = trainlab(capsys, "runs", "--runs-root", str(runs_root))
    assert "hot" in out and "base" in out and "completed" in out


def test_an_empty_runs_root_is_not_an_error_and_stays_empty(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "runs"
    code, out, _ = trainlab(capsys, "compare", "--json", "--runs-root", str(root))
    assert (code, json.loads(out)) == (0, {"runs": [], "groups": [], "comparisons": []})
    code, out, _ = trainlab(capsys, "runs", "--runs-root", str(root))
    assert code == 0 and "no runs recorded" in out
    assert not root.exists()  # reading never creates a store
