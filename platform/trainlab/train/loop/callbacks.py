"""Side effects of a training run live in callbacks, never inside the step.

The training loop calls these hooks on rank 0 only (tracking, alerts,
checkpoint bookkeeping). A callback that wants the run to stop sets
`stop_requested`; the loop broadcasts that decision to every rank, saves a
checkpoint and ends the run cleanly. P0 alert actions (`tracking.alerts.on_p0`)
are not taken here but by the loop on every rank (trainlab.train.loop.metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunContext:
    """What a callback may know about the run (rank 0's view)."""

    cfg: Any  # trainlab.config.ExperimentConfig, layout resolved
    plan: dict[str, Any]  # Plan.to_json()
    run_dir: str  # absolute
    config_hash: str
    dataset_fingerprint: str
    manifest_path: str  # absolute path of the prepared dataset's manifest.json
    start_step: int  # 0 for a fresh run, the restored step after a restart
    restarts: int  # worker-group restarts so far
    ray_job_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Callback:
    """Base class: every hook is optional. Hooks run on rank 0 only."""

    stop_requested: bool = False
    stop_reason: str = ""

    def on_run_start(self, ctx: RunContext) -> None:
        """Before the first step (also after each restart, with ctx.start_step > 0)."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """After optimizer step `step` (1-based: the number of steps done).

        Metric keys (all floats): loss, lr, grad_norm, tokens_per_s, step_time_s,
        data_wait_frac, mem_gb, mem_peak_gb, mfu (when the device peak is known),
        share/<source> (delivered token share so far), ckpt_age_s, eta_s.
        Called every `train.log_interval` steps and at the last step.
        """

    def on_step_signals(self, step: int, signals: dict[str, float]) -> None:
        """After every optimizer step, one step late (trainlab.train.loop.metrics): loss,
        grad_norm (before clipping), non_finite (ranks that saw NaN/inf),
        step_time_s, data_wait_s. The values are agreed across ranks (all-reduced)."""

    def on_rollback(self, record: dict[str, Any]) -> None:
        """A P0 action rolled the run back: {from_step, to_step, skipped, rule}."""

    def on_resize(self, record: dict[str, Any]) -> None:
        """An elastic run continued at another size (trainlab.run.records.RunRecords.
        resizes): {step, from_world_size, to_world_size, from_dp, to_dp, reason,
        steps_redone, seconds}, at the first step after it."""

    def on_eval(self, step: int, val_losses: dict[str, float]) -> None:
        """Validation loss per source (keys are source names) and "all"."""

    def on_checkpoint(self, step: int, path: str, valid: bool, val_loss: float | None) -> None:
        """A checkpoint was written (and validated when train.checkpoint.validate)."""

    def on_run_end(self, summary: dict[str, Any]) -> None:
        """The run ended (completed, failed or stopped); `summary` is run_summary.json."""

    def on_run_abandoned(self, run_dir: str, summary: dict[str, Any]) -> None:
        """Called by the driver, on a fresh instance that saw no other hook, when the
        run ended without its workers reaching `on_run_end` (Ray Train gave up):
        close whatever an earlier instance opened for `run_dir`."""


# Every hook, declared once: the `on_*` methods of `Callback` above. Fan-out
# (CallbackList), the pipe to the agent (trainlab.train.supervision.protocol) and the agent's
# dispatch are derived from this tuple, so a new hook is one method on Callback
# (and the loop's call of it).
HOOKS: tuple[str, ...] = tuple(name for name in vars(Callback) if name.startswith("on_"))
# Hooks the driver calls itself; a training process never forwards them.
DRIVER_HOOKS = frozenset({"on_run_abandoned"})
FORWARDED_HOOKS = tuple(h for h in HOOKS if h not in DRIVER_HOOKS)


def derive_calls(cls: type, names: tuple[str, ...], call: str, docs: type | None = None) -> type:
    """Give `cls` a method per name in `names` that returns `self.<call>(name, *args)`,
    documented as the same method of `docs` (default: Callback, whose hooks these
    usually are). The one place methods are derived from a declaration: callback
    fan-out and forwarding, and the pipe's loader calls."""
    source = docs or Callback

    def make(name: str) -> Any:
        def method(self: Any, *args: Any) -> Any:
            return getattr(self, call)(name, *args)

        method.__name__ = method.__qualname__ = name
        method.__doc__ = getattr(source, name).__doc__
        return method

    for name in names:
        setattr(cls, name, make(name))
    return cls


class CallbackList(Callback):
    """Fan a hook out to several callbacks; one failing callback never kills a run."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def _each(self, hook: str, *args: Any) -> None:
        import logging

        for cb in self.callbacks:
            try:
                getattr(cb, hook)(*args)
            except Exception:  # noqa: BLE001 - a tracking outage must not end training
                logging.getLogger(__name__).exception(
                    "callback %s.%s failed", type(cb).__name__, hook
                )

    @property
    def stop_requested(self) -> bool:  # type: ignore[override]
        return any(cb.stop_requested for cb in self.callbacks)

    @property
    def stop_reason(self) -> str:  # type: ignore[override]
        return "; ".join(cb.stop_reason for cb in self.callbacks if cb.stop_requested)


derive_calls(CallbackList, HOOKS, "_each")


def build_callbacks(factories: tuple[str, ...] | list[str], cfg: Any) -> CallbackList:
    """The callbacks of a run from import paths of factories ("package.module:function",
    each `function(cfg) -> list[Callback]`), in order. The training layer knows no
    callback by name: whoever launches the run says which (trainlab.train.run)."""
    out: list[Callback] = []
    for path in factories:
        out.extend(load_factory(path)(cfg))
    return CallbackList(out)


def load_factory(path: str) -> Any:
    """The function at an import path "package.module:function"."""
    import importlib

    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"factory {path!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module), name)
