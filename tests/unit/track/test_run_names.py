"""Runs of one config are told apart: each MLflow run is named after its run
directory (`tiny`, `tiny-2`, ...) and carries it as the `run_dir` tag, while
`compare`/`runs` still select every run of a config by the config's name."""

from __future__ import annotations

import json

import pytest

from tests.unit.track.conftest import FakeRank0, tiny_config
from trainlab.cli import main


def trainlab(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return out


def test_runs_of_one_config_are_named_after_their_run_directories(runs_root, client, capsys):
    first = FakeRank0(tiny_config(runs_root), runs_root)
    second = FakeRank0(tiny_config(runs_root), runs_root)
    second.run_dir = first.run_dir.with_name("tiny-2")  # as rundir.new_run_dir names it
    second.run_dir.mkdir()
    first.full_run()
    second.full_run()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert {r.info.run_name: r.data.tags["run_dir"] for r in runs} == {
        "tiny": str(first.run_dir),
        "tiny-2": str(second.run_dir),
    }
    root = ("--runs-root", str(runs_root))
    rows = json.loads(trainlab(capsys, "compare", "tiny", "--json", *root))["runs"]
    assert [r["name"] for r in rows] == ["tiny-2", "tiny"]  # the config's name: both
    rows = json.loads(trainlab(capsys, "compare", "tiny-2", "--json", *root))["runs"]
    assert [r["name"] for r in rows] == ["tiny-2"]  # a run's own name: that one
    rows = json.loads(trainlab(capsys, "runs", "--json", *root))
    assert [r["name"] for r in rows] == ["tiny-2", "tiny"]
