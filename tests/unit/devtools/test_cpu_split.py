"""devtools.bench.cpu_split: CPU seconds per part of this process's tree, for the
throughput benchmark's notes (real processes burning real CPU)."""

from __future__ import annotations

import subprocess
import sys
import time

from devtools.bench.cpu_split import CpuSplit

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"


def test_a_child_process_and_this_driver_are_counted_apart():
    with CpuSplit(interval_s=0.1) as split:
        child = subprocess.Popen([sys.executable, "-c", BURN + "time.sleep(0.3)"])
        t = time.process_time()
        while time.process_time() - t < 0.2:
            pass
        child.wait(timeout=60)
    seconds = split.seconds()
    driver = next(v for k, v in seconds.items() if k.startswith("driver"))
    other = sum(v for k, v in seconds.items() if k.startswith("other:"))
    assert driver >= 0.15 and 0.3 <= other <= 1.2, seconds
