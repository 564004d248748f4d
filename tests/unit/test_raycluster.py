"""Ray's own output kept off the terminal (trainlab.raycluster): a job's log
stream split into trainlab's lines and Ray's, and Ray's Python log records in a
driver routed to a file (errors still shown)."""

from __future__ import annotations

import logging
import os
import sys

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


def test_piped_output_gets_rays_worker_lines_without_colour_codes(monkeypatch, capsys):
    """Not a terminal (pytest captures both streams): RAY_COLOR_PREFIX=0, and Ray's
    own printer of forwarded worker lines then writes no escape codes; a value the
    user set is kept."""
    from ray._private.worker import print_worker_logs

    from trainlab.raycluster import plain_output_when_piped

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    line = {"pid": "4321", "actor_name": "RayTrainWorker", "lines": ["[trainlab] step 1/6"]}
    print_worker_logs(line, sys.stderr)
    assert "\x1b[" in capsys.readouterr().err  # Ray's default: colour, terminal or not
    plain_output_when_piped()
    print_worker_logs(line, sys.stderr)
    assert capsys.readouterr().err == "(RayTrainWorker pid=4321) [trainlab] step 1/6\n"
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    plain_output_when_piped()
    assert os.environ["RAY_COLOR_PREFIX"] == "1"


def test_rays_notice_that_it_enabled_token_auth_is_dropped_the_opposite_kept(caplog):
    """Ray warns at every local start that it turned token auth on (the secure mode
    the embedded cluster means to use): dropped; its warning that auth is off stays."""
    from ray._private.authentication import authentication_token_setup as ray_auth

    from trainlab.raycluster import quiet_token_auth_notice

    caplog.set_level(logging.WARNING, logger=ray_auth.logger.name)
    ray_auth.logger.propagate, before = True, ray_auth.logger.propagate
    filters = list(ray_auth.logger.filters)  # an earlier start in this session added one
    for f in filters:
        ray_auth.logger.removeFilter(f)
    try:
        ray_auth._warn_token_auth_enabled()
        assert "Token authentication is enabled" in caplog.text
        caplog.clear()
        quiet_token_auth_notice()
        quiet_token_auth_notice()  # once is enough
        ray_auth._warn_token_auth_enabled()
        assert "Token authentication is enabled" not in caplog.text
        ray_auth._warn_token_auth_disabled()
        assert "Token authentication is disabled" in caplog.text
    finally:
        ray_auth.logger.propagate = before
        for f in list(ray_auth.logger.filters):
            ray_auth.logger.removeFilter(f)
        for f in filters:
            ray_auth.logger.addFilter(f)
