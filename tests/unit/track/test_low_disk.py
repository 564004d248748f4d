"""low_disk: a P1 alert when the run directory's filesystem has less free space
than `tracking.alerts.low_disk.min_free_gb` during the run (trainlab.monitor.disk),
measured for real on the test's filesystem through the real MonitorCallback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import RECIPES
from tests.train_helpers import new_run_context
from trainlab.config import load_config
from trainlab.monitor import MonitorCallback, alert_log_path
from trainlab.monitor.disk import GIB, LowDisk


def _run(tmp_path: Path, min_free_gb: float, steps: int = 6) -> MonitorCallback:
    cfg = load_config(
        RECIPES / "tiny.yaml",
        [f"tracking.alerts.low_disk.min_free_gb={min_free_gb}", "train.log_interval=1"],
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    monitor = MonitorCallback(cfg)
    monitor.on_run_start(new_run_context(cfg, run_dir))
    for step in range(1, steps + 1):
        monitor.on_step_end(step, {"loss": 3.0, "tokens_per_s": 1000.0, "grad_norm": 1.0})
    monitor.on_run_end({"status": "completed"})
    return monitor


def test_fires_once_as_p1_when_free_space_is_under_the_threshold(tmp_path):
    free_gb = shutil.disk_usage(tmp_path).free / GIB
    monitor = _run(tmp_path, min_free_gb=round(free_gb + 1000))  # more than there is
    low = [a for a in monitor.alerts if a.rule == "low_disk"]
    assert len(low) == 1 and low[0].severity == "P1" and low[0].step == 1  # latched after
    assert str(tmp_path / "run") in low[0].message and "GiB free" in low[0].message
    assert abs(low[0].value - free_gb) < 1.0  # the real free space, in GiB
    logged = [json.loads(ln) for ln in alert_log_path(tmp_path / "run").read_text().splitlines()]
    assert [a["rule"] for a in logged] == ["low_disk"]


def test_quiet_above_the_threshold_with_the_default_documented(tmp_path):
    assert not [a for a in _run(tmp_path / "a", min_free_gb=0).alerts if a.rule == "low_disk"]
    cfg = load_config(RECIPES / "tiny.yaml")
    assert cfg.tracking.alerts.low_disk.min_free_gb == 5.0  # the documented default


def test_rearms_after_space_was_freed_and_fires_again():
    free = iter([1, 1, 9, 9, 1] + [1] * 5)  # GiB: low, freed, low again
    rule = LowDisk(
        name="low_disk",
        severity="P1",
        window=1,
        cooldown=0,
        path="/x",
        min_free_bytes=5 * GIB,
        measure=lambda _path: next(free) * GIB,
    )
    fired = [s for s in range(1, 8) if rule.observe(s, {}, 0.0)]
    assert fired == [1, 5]
    gone = LowDisk(name="low_disk", severity="P1", window=1, cooldown=0, path="/no/such/dir")
    assert gone.observe(1, {}, 0.0) is None  # a vanished directory is not an alert
