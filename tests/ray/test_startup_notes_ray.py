"""`--repeats K` trains its seeds in one process on one Ray cluster (ensure_ray
connects once per process; issue 41 item 9): the next seed's start note said
"starting a local Ray cluster" again. On the session's real cluster (no extra
start: the fixture is shared)."""

from __future__ import annotations

import pytest

from trainlab.train.driver.startup import StartupNotes

pytestmark = [pytest.mark.ray]


def test_a_run_after_ray_is_up_is_not_said_to_start_a_cluster(ray_cluster, capsys):
    StartupNotes(enabled=True).ray()
    err = capsys.readouterr().err
    assert "Ray already up in this process (one cluster for all its runs)" in err
    assert "starting a local Ray cluster" not in err
