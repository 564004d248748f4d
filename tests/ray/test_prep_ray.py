"""`trainlab prep` on Ray Data (the session's shared local cluster): the same
dataset, byte for byte, as the in-process path; the CLI's output and re-run."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import ray

from trainlab.cli import main
from trainlab.data.prep import run_prep
from trainlab.data.prep.executors import RayDataExecutor, plan_ray_resources

pytestmark = pytest.mark.ray

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Real text in all three formats: stdlib source, a JSONL file, a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = tmp_path_factory.mktemp("prep_ray")
    docs = [p.read_text() for p in sorted((STDLIB / "email").glob("*.py"))]
    (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:10]))
    pq.write_table(pa.table({"text": docs[5:15]}), tmp / "docs.parquet")  # 5 cross-format copies
    path = tmp / "s.yaml"
    path.write_text(f"""
train_tokenizer: {{vocab_size: 700}}
shard_target_mb: 0.05
sources:
  - {{name: code, paths: ["{STDLIB}/json/**/*.py", "{STDLIB}/email/*.py"], format: text}}
  - {{name: lines, paths: ["{tmp}/docs.jsonl"], format: jsonl, text_field: text}}
  - {{name: table, paths: ["{tmp}/docs.parquet"], format: parquet, text_field: text}}
""")
    return path


def test_ray_pipeline_matches_the_local_path_byte_for_byte(ray_cluster, sources, tmp_path):
    ex = RayDataExecutor()
    assert ex.plan.stage_actors <= max(1, int(ray_cluster["CPU"]) - 1)
    ray_result = run_prep(sources, tmp_path / "ray", executor=ex, unit_bytes=64 << 10)
    local = run_prep(sources, tmp_path / "local", executor="local")
    assert ray_result.manifest == local.manifest
    assert ray_result.units_total > 3 and ray_result.units_reused == 0
    m = ray_result.manifest
    assert m["sources"]["table"]["rejected"]["duplicate"]["count"] == 10
    assert m["sources"]["lines"]["rejected"]["duplicate"]["count"] == 10
    assert len(m["sources"]["code"]["shards"]) > 1


def test_cli_prints_the_manifest_and_then_is_up_to_date(ray_cluster, sources, tmp_path, capsys):
    # A given tokenizer (trained in-process here), so the CLI runs one Ray Data pass.
    local = run_prep(sources, tmp_path / "local", vocab_size=600, executor="local")
    tokenizer = str(tmp_path / "local" / "tokenizer.json")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as code:
        main(["prep", str(sources), "--out", str(out), "--tokenizer", tokenizer, "--json"])
    assert code.value.code == 0
    stdout = capsys.readouterr().out
    report = json.loads(stdout.strip().splitlines()[-1])
    manifest = json.loads((out / "manifest.json").read_text())
    assert {k: report[k] for k in manifest} == manifest
    # The driver received counts and file lists only: no document data.
    assert report["units_total"] >= 1 and report["units_reused"] == 0
    assert report["driver_document_bytes"] == 0 and report["driver_peak_rss_bytes"] > 10 << 20
    assert manifest["fingerprint"] == local.manifest["fingerprint"]
    for s in manifest["sources"].values():
        assert s["docs_in"] == s["docs_out"] + sum(r["count"] for r in s["rejected"].values())

    with pytest.raises(SystemExit) as code:
        main(["prep", str(sources), "--out", str(out), "--tokenizer", tokenizer])
    assert code.value.code == 0
    text = capsys.readouterr().out
    assert "up to date" in text and "code" in text and "docs in" in text


def test_near_dedup_on_ray_matches_the_local_path(ray_cluster, sources, tmp_path):
    """The dedup shuffle on Ray Data workers (several partitions, units and actors)
    decides exactly what the in-process path decides."""
    copies = [p.read_text() + "\n# a line appended\n" for p in sorted(STDLIB.glob("json/*.py"))]
    (tmp_path / "near.jsonl").write_text("".join(json.dumps({"text": c}) + "\n" for c in copies))
    near = tmp_path / "near.yaml"
    near.write_text(
        sources.read_text()
        + f"  - {{name: near, paths: [{tmp_path}/near.jsonl], format: jsonl, text_field: text}}\n"
        + "dedup: {near: {enabled: true}}\n"
    )
    local = run_prep(near, tmp_path / "local", executor="local")
    tokenizer = str(tmp_path / "local" / "tokenizer.json")
    ray_result = run_prep(
        near, tmp_path / "ray", tokenizer=tokenizer, executor=RayDataExecutor(), unit_bytes=64 << 10
    )
    assert ray_result.manifest["sources"] == local.manifest["sources"]
    assert ray_result.driver_document_bytes == 0
    assert ray_result.unit_nodes == len([n for n in ray.nodes() if n["Alive"]])
    rejected = local.manifest["sources"]["near"]["rejected"]["near_duplicate"]
    assert rejected["count"] == len(copies)


def test_resource_plan_leaves_room_on_small_clusters():
    assert plan_ray_resources(8, 2).stage_actors == 2  # embedded cluster on 2 cores
    assert plan_ray_resources(2, 2).stage_actors == 1  # a num_cpus=2 cluster: no starvation
    assert plan_ray_resources(64, 64).stage_actors == 63


def test_pulled_items_of_a_killed_worker_are_run_again(ray_cluster, tmp_path):
    """A pulled stage (one task per worker claiming items) whose worker process dies
    in the middle of an item: every item is still answered, and the claims are
    swept."""
    marker = tmp_path / "killed"

    def stage(batch, marker):  # defined here: Ray ships it by value
        import json
        import os
        import time

        import pyarrow as pa

        items = [i for s in batch.column("item").to_pylist() for i in json.loads(s)]
        if items[0]["index"] == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the worker process dies, claim held, nothing reported
        time.sleep(0.05)
        return pa.table({"index": [i["index"] for i in items]})

    items = [{"index": i, "weight": 10 - i} for i in range(10)]
    answered = [
        i
        for table in RayDataExecutor().map_items(
            items, stage, {"marker": str(marker)}, blocks="pull", scratch=str(tmp_path)
        )
        for i in table.column("index").to_pylist()
    ]
    assert marker.exists()
    assert sorted(set(answered)) == list(range(10))
    assert not list(tmp_path.glob("claims-*"))
