"""An extended run (`trainlab train --extend`) in the records and in `trainlab
compare`: its real length, the steps and tokens it trained, and the extension
listed among the differences (issue 41 item 1)."""

from __future__ import annotations

import json

from tests.unit.track.test_compare import trainlab


def test_an_extended_run_shows_its_real_length_and_the_extension(rank0, runs_root, client, capsys):
    """`--extend` from 60 to 80 steps, recorded as the launcher does (the real
    check_same_experiment's extension in logs/extensions.jsonl): the MLflow run says
    80 (a tag: params cannot change), and compare shows the steps and tokens trained
    and lists the extension among the differences (it said "same config")."""
    from trainlab.config import to_yaml
    from trainlab.run.dir import check_same_experiment
    from trainlab.run.records import RunRecords

    rank0("name=tiny").full_run()  # the 60-step run it is compared with
    first = rank0("name=tiny")
    first.run_dir = runs_root / "2026-01-03" / "tiny"
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "config.yaml").write_text(to_yaml(first.cfg))
    first.full_run()
    RunRecords(first.run_dir).write_summary({"status": "completed", "final_step": 60})
    longer = rank0("name=tiny", "train.total_steps=80")
    identity = check_same_experiment(first.run_dir, longer.cfg, extend=True)
    RunRecords(first.run_dir).add_extension(identity.extension)
    longer.run_dir = first.run_dir
    longer.start(start_step=60)
    longer.steps(61, 80)
    longer.end()

    every = client.search_runs([e.experiment_id for e in client.search_experiments()])
    extended = next(r for r in every if r.data.tags.get("extended"))
    assert extended.data.tags["total_steps"] == "80"
    assert extended.data.tags["extended"] == "train.total_steps 60 -> 80 at step 60"
    root = ("--runs-root", str(runs_root))
    code, out, _ = trainlab(capsys, "compare", "--json", *root)
    assert code == 0
    new, old = json.loads(out)["runs"]
    per_step = new["params"]["plan.tokens_per_step"]
    assert (new["final_step"], new["total_steps"], new["tokens_trained"]) == (80, 80, 80 * per_step)
    assert (old["final_step"], old["total_steps"], old["tokens_trained"]) == (60, 60, 60 * per_step)
    assert new["differing"] == {
        "train.total_steps": 80,
        "extended (--extend)": "train.total_steps 60 -> 80 at step 60",
    }
    assert old["differing"] == {"train.total_steps": 60, "extended (--extend)": None}
    _, table, _ = trainlab(capsys, "compare", *root)
    assert "80/80 (extended)" in table and "60/60" in table
    assert "same config" not in table
    differing = table[table.index("differing config keys") :]
    assert "extended (--extend)" in differing and "60 -> 80 at step 60" in differing
