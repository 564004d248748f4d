"""Ray's own output kept off the terminal (trainlab.raycluster): a job's log
stream split into trainlab's lines and Ray's, and Ray's Python log records in a
driver routed to a file (errors still shown)."""

from __future__ import annotations

import logging

import pytest

from trainlab.raycluster import LineRouter, command_log, route_ray_records

# A job's log as `trainlab submit --follow` streams it (lines seen in this repo's runs).
JOB_LOG = """\
2026-12-04 16:01:02,345\tWARNING authentication_token_setup.py:77 -- token authentication is on
tiny: checks passed; training on Ray Train (1 worker)
[2026-12-04 16:01:05,678 E 4242 4311] core_worker.cc:2140: Actor constructor arguments \
could not be resolved
(RayTrainWorker pid=4321) [trainlab] step 10/60 | loss 7.1234 | lr 1.00e-03
(RayTrainWorker pid=4321) 2026/12/04 16:01:09 INFO mlflow.system_metrics: Started monitoring
(TrainController pid=4300) Traceback (most recent call last):
    File "controller.py", line 12, in poll
2026/12/04 16:01:10 INFO mlflow.tracking: run started
tiny: completed at step 60 (loss 6.8770)
"""


def test_a_job_log_keeps_trainlabs_lines_and_files_rays(tmp_path):
    shown: list[str] = []
    router = LineRouter(shown.append, tmp_path / "submit.log")
    for i in range(0, len(JOB_LOG), 37):  # chunks cut mid-line, as a stream arrives
        router.write(JOB_LOG[i : i + 37])
    router.close()
    assert "".join(shown).splitlines() == [
        "tiny: checks passed; training on Ray Train (1 worker)",
        "(RayTrainWorker pid=4321) [trainlab] step 10/60 | loss 7.1234 | lr 1.00e-03",
        "tiny: completed at step 60 (loss 6.8770)",
    ]
    filed = (tmp_path / "submit.log").read_text().splitlines()
    assert len(filed) == 6 and (router.shown, router.routed) == (3, 6)
    assert filed[1].startswith("[2026-12-04") and "core_worker.cc" in filed[1]
    assert filed[4].startswith('    File "controller.py"')  # a traceback stays together


def test_rays_log_records_go_to_the_file_and_errors_also_to_the_terminal(
    tmp_path, capsys, monkeypatch
):
    from ray._private.log import PlainRayHandler

    monkeypatch.setattr(PlainRayHandler, "emit", PlainRayHandler.emit)  # restored after
    log_file = tmp_path / "prep.log"
    assert route_ray_records(log_file)
    logger = logging.getLogger("ray.data.test_raycluster")
    logger.propagate = False
    handler = PlainRayHandler()
    logger.addHandler(handler)
    try:
        logger.warning("Ray Data noise")
        logger.error("a real problem")
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "a real problem" in err and "Ray Data noise" not in err
    text = log_file.read_text()
    assert "WARNING ray.data.test_raycluster" in text and "a real problem" in text


def test_command_logs_go_under_trainlab_log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINLAB_LOG_DIR", str(tmp_path))
    path = command_log("prep")
    assert path.parent == tmp_path and path.name.startswith("prep-") and path.suffix == ".log"


@pytest.fixture(autouse=True)
def _no_routing_left(monkeypatch):
    import trainlab.raycluster as rc

    monkeypatch.setattr(rc, "_routed_to", None)
