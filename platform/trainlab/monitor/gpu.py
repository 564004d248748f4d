"""GPU utilisation and memory per device through NVML (`nvidia-ml-py`, the optional
`gpu` extra; the same package MLflow's GPU system metrics read).

Rank 0's monitor logs them with the loop's metrics: `gpu<i>/util_pct` and
`gpu<i>/mem_gb` for each device NVML sees on its node. Without the package or a
driver there is nothing to report, and nothing fails.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)


class GpuMetrics:
    """NVML, initialised once; `read()` is {} when NVML is unavailable."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
        except ImportError:
            pass  # no `gpu` extra: CPU runs, or GPU metrics from elsewhere
        except Exception as e:  # noqa: BLE001 - pynvml.NVMLError: no driver, no device
            log.debug("NVML unavailable: %s", e)

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def read(self) -> dict[str, float]:
        if not self.available:
            return {}
        out: dict[str, float] = {}
        for i, handle in enumerate(self._handles):
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as e:  # noqa: BLE001 - one failed read must not end training
                log.debug("NVML read of device %d failed: %s", i, e)
                continue
            out[f"gpu{i}/util_pct"] = float(util.gpu)
            out[f"gpu{i}/mem_gb"] = mem.used / 2**30
        return out

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):  # shutting down is best effort
                self._nvml.nvmlShutdown()
            self._nvml = None
