"""The parts of the training loop that decide for themselves (torchtitan's shape).

`Trainer.fit` gets a batch, takes a step, and hands the step to its components
in order; each knows its own cadence and state:

    P0Guard        every step's agreed health signals (one step late) and the P0
                   action: stop, or roll back to a valid checkpoint and skip the
                   steps since; the skip windows (train.skip_steps + rollbacks)
    Chaos          train.chaos: a NaN or spike factor on a step's loss, a hard
                   kill of one rank's process at a step (rehearsals)
    MetricsLog     every train.log_interval: the window's metrics to rank 0's
                   callbacks and the log (an MoE's router health too); rank 0's
                   stop request, agreed by all
    Evaluator      every train.eval_interval: held-out loss per source
    Checkpointing  every train.checkpoint.every_steps (and when a stop asks for
                   one): save, then deliver finished (validated) checkpoints

Components run on EVERY rank, with the same calls at the same steps, so they
may use collectives; their decisions must agree across ranks (decide from
agreed values: the all-reduced signals, the step). Side effects of rank 0 only
(tracking, alerts) stay in callbacks (trainlab.train.loop.callbacks).

More components come from import paths (`train.components`, each
"package.module:factory" with `factory(cfg) -> list[Component]`), after the
built-in ones and before Checkpointing, so a stop they ask for still saves.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Any

from trainlab.models.moe.metrics import router_metrics
from trainlab.run import checkpoints as ckpts
from trainlab.runstatus import RunStatus
from trainlab.train.loop.callbacks import load_factory
from trainlab.train.loop.metrics import (
    HOLD,
    NO_STOP,
    STOP_AND_SAVE,
    PendingSignals,
    progress_line,
)
from trainlab.train.loop.protocol import Loop

log = logging.getLogger("trainlab.train")

# What a P0 action did to the loop (besides None: nothing).
ROLLED_BACK = "rolled_back"


class Component:
    """Base class: every hook is optional; each runs on every rank."""

    def on_start(self, loop: Loop) -> None:
        """Before the first step of this start (after the checkpoint restore)."""

    def loss_factor(self, loop: Loop, step: int) -> float:
        """A factor on step `step`'s loss (1-based; 1.0: none)."""
        return 1.0

    def after_step(self, loop: Loop, step: int) -> None:
        """Right after optimizer step `step`, before its signals are read."""

    def due(self, loop: Loop, step: int, last: bool) -> bool:
        """Whether `at_step_end` acts at this step (the loop then reads the step's
        own signals first, so nothing acts on a state it has not judged)."""
        return False

    def at_step_end(self, loop: Loop, step: int, last: bool) -> None:
        """After step `step` was judged healthy; may call `loop.request_stop`."""

    def on_end(self, loop: Loop, status: str) -> None:
        """The loop ended with `status` (before the summary is written)."""


# A hook of a user's component that raises one of these has a bug: the same code
# fails the same way at the same step after a restart, so the run ends instead
# (ComponentError; the agent never restarts it, trainlab.train.supervision.agent).
# Other errors (an OSError, a RuntimeError from a collective whose peer died) are
# restarted as any training process failure.
PROGRAMMING_ERRORS = (
    TypeError,
    AttributeError,
    NameError,
    ImportError,
    AssertionError,
    LookupError,
    ValueError,
    ArithmeticError,
    NotImplementedError,
    RecursionError,
)
HOOKS = ("on_start", "loss_factor", "after_step", "due", "at_step_end", "on_end")


class ComponentError(Exception):
    """A user's component (train.components) raised a programming error in a hook:
    the run ends as failed with it, without a restart."""

    def __init__(self, path: str, component: object, hook: str, step: int, error: Exception):
        self.path = path
        first = (str(error).strip().splitlines() or [""])[0]
        super().__init__(
            f"train.components {path!r}: {type(component).__name__}.{hook} at step {step} "
            f"raised {type(error).__name__}: {first}"[:480]
        )


def _guarded(path: str, component: Component, hook: str) -> Any:
    method = getattr(component, hook)

    def call(loop: Loop, *args: Any) -> Any:
        try:
            return method(loop, *args)
        except PROGRAMMING_ERRORS as e:
            raise ComponentError(path, component, hook, loop.step, e) from e

    return call


def build_components(paths: tuple[str, ...] | list[str], cfg: Any) -> list[Component]:
    """The components of `train.components`, from their factories' import paths;
    each hook guarded, so a programming error in it ends the run (ComponentError)."""
    out: list[Component] = []
    for path in paths:
        made = load_factory(path)(cfg)
        for c in made:
            if not isinstance(c, Component):
                raise TypeError(f"train.components {path!r}: {c!r} is not a Component")
            for hook in HOOKS:  # on the instance: isinstance and its own state unchanged
                setattr(c, hook, _guarded(path, c, hook))
        out.extend(made)
    return out


# --------------------------------------------------------------------------- health


class P0Guard(Component):
    """Reads every step's agreed signals one step late (a step's own at the steps
    whose components act) and takes the P0 action (tracking.alerts.on_p0) at the
    same step on every rank (trainlab.train.loop.metrics.P0Rules)."""

    def __init__(self) -> None:
        self.pending: PendingSignals | None = None
        # A router rule that fired at a logged step (check_router), acted on at the
        # next observation: (rule, step, what it saw).
        self.router_fired: tuple[str, int, str] | None = None

    def check_router(self, loop: Loop, step: int, metrics: dict[str, float]) -> None:
        """An MoE's router metrics of logged step `step` (the same on every rank)
        to the P0 router rules; one that fires is acted on at the next observation,
        one step later, like every step's own signals."""
        rule = loop.p0_rules.check_router(step, metrics)
        if rule is not None and loop.cfg.tracking.alerts.on_p0 != "notify":
            seen = ", ".join(
                f"{k} {metrics[k]:.3g}" for k in sorted(metrics) if k.startswith("moe/")
            )
            self.router_fired = (rule, step, seen)

    def launch(self, loop: Loop, current: PendingSignals) -> str | None:
        """Queue step s's signals; judge step s-1's (read now). After a rollback
        step s's signals are dropped: that step ran on the state rolled back from."""
        status = self.observe(loop)
        self.pending = None if status == ROLLED_BACK else current
        return status

    def observe(self, loop: Loop) -> str | None:
        """Read the queued step's signals, hand them to rank 0's callbacks and the
        P0 rules; returns None, ROLLED_BACK or "stopped_by_alert"."""
        if self.router_fired is not None:
            (rule, at, seen), self.router_fired = self.router_fired, None
            return self._act(loop, rule, at, f"P0 alert {rule} at step {at}: {seen}")
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        signals = loop.last_signals = pending.read()
        loop.stop_signal = max(loop.stop_signal, signals.stop)
        if loop.env.is_main:
            loop.callbacks.on_step_signals(signals.step, signals.metrics())
        rule = loop.p0_rules.check(signals)
        if rule is None or loop.cfg.tracking.alerts.on_p0 == "notify":
            return None
        reason = f"P0 alert {rule} at step {signals.step}: {signals.describe()}"
        return self._act(loop, rule, signals.step, reason)

    def _act(self, loop: Loop, rule: str, at: int, reason: str) -> str:
        """The P0 action for `rule` seen at step `at`: a rollback to the newest valid
        checkpoint before it (ROLLED_BACK), else a stop ("stopped_by_alert")."""
        alerts = loop.cfg.tracking.alerts
        if alerts.on_p0 == "rollback_and_skip":
            done = len(loop.checkpointer.rollbacks)
            if done < alerts.max_rollbacks:
                if self._rollback(loop, rule, at):
                    return ROLLED_BACK
                reason += " (no valid checkpoint before it to roll back to)"
            else:
                reason += f" (tracking.alerts.max_rollbacks = {done} used up)"
        log.error("stopping: %s", reason)
        loop.stop_reason = reason
        loop.stopped_at = at
        return RunStatus.STOPPED_BY_ALERT

    def _rollback(self, loop: Loop, rule: str, at: int) -> bool:
        """Reload the newest valid checkpoint before the alert's step and skip the
        batches since (every rank at the same step); False when there is none."""
        loop.checkpointer.wait()
        loop.saver.deliver(loop)
        choice = None
        if loop.env.is_main:
            committed = ckpts.catalog(loop.job.location).committed()
            before = [c for c in committed if c.valid and c.step < at]
            choice = max(before, key=lambda c: c.step) if before else None
        choice = loop.env.broadcast_object(choice)
        if choice is None:
            return False
        rollbacks = list(loop.checkpointer.rollbacks)
        loop.checkpointer.load_info(choice)
        to_step = loop.step
        record = {"from_step": at, "to_step": to_step, "skipped": [to_step + 1, at], "rule": rule}
        loop.checkpointer.rollbacks = [*rollbacks, record]
        loop.evaluator.at = to_step
        loop.meter.reset()
        log.warning(
            "P0 %s at step %d: rolled back to step %d, skipping steps %d-%d",
            rule, at, to_step, to_step + 1, at,
        )  # fmt: skip
        if loop.env.is_main:
            loop.callbacks.on_rollback(dict(record))
        return True

    def skip_target(self, loop: Loop, step: int) -> int:
        """The step to continue from when the next steps' batches are skipped
        (train.skip_steps and the rollbacks' windows); `step` when none is."""
        windows = [tuple(w) for w in loop.cfg.train.skip_steps]
        windows += [tuple(r["skipped"]) for r in loop.checkpointer.rollbacks]
        moved = True
        while moved:
            moved = False
            for first, last in windows:
                if first <= step + 1 <= last:
                    step, moved = last, True
        return step


# --------------------------------------------------------------------------- rehearsals


class Chaos(Component):
    """train.chaos: NaN / spike factors on a step's loss and a hard kill of one
    rank's process at a step; each fires once per run directory (a marker file)."""

    def on_start(self, loop: Loop) -> None:
        chaos = loop.cfg.train.chaos
        steps = set(chaos.nan_at_steps) | set(chaos.spike_at_steps)
        self.fired = {s for s in steps if loop.records.loc.exists(self._marker(s))}

    def loss_factor(self, loop: Loop, step: int) -> float:
        chaos = loop.cfg.train.chaos
        if step in self.fired:
            return 1.0
        if step in chaos.nan_at_steps:
            factor = float("nan")
        elif step in chaos.spike_at_steps:
            factor = chaos.spike_factor
        else:
            return 1.0
        self.fired.add(step)
        if loop.env.is_main:
            record = json.dumps({"step": step, "loss_factor": str(factor)})
            loop.records.loc.write_text(self._marker(step), record)
        log.warning("chaos: step %d's loss multiplied by %s", step, factor)
        return factor

    def after_step(self, loop: Loop, step: int) -> None:
        """kill_at_steps: hard-kill this training process the first time step k is
        reached (right after optimizer step k, before its logs and checkpoint)."""
        chaos = loop.cfg.train.chaos
        if step not in chaos.kill_at_steps or loop.env.rank != chaos.kill_rank:
            return
        if loop.records.chaos_killed(step):
            return
        log.warning(loop.records.record_chaos_kill(step, loop.env.rank))
        for handler in logging.getLogger("trainlab").handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _marker(step: int) -> str:
        """Where the run records that the loss of `step` was changed (once per run)."""
        return f"logs/chaos-loss-step-{step:08d}.json"


# --------------------------------------------------------------------------- cadences


class MetricsLog(Component):
    """Every train.log_interval (and the last step, and a step a stop was asked
    at): the window's metrics to rank 0's callbacks, the log and Ray Train's
    report; then rank 0's stop request, broadcast so every rank agrees."""

    def due(self, loop: Loop, step: int, last: bool) -> bool:
        return step % loop.cfg.train.log_interval == 0 or last or loop.stop_signal != NO_STOP

    def at_step_end(self, loop: Loop, step: int, last: bool) -> None:
        if not self.due(loop, step, last):
            return
        signals = loop.last_signals
        loop.last_loss = signals.loss
        metrics = loop.meter.window(
            step, signals.loss, signals.grad_norm, time.time() - loop.saver.last_valid_at
        )
        for source, share in loop.loader.delivered_shares(step).items():
            metrics[f"share/{source}"] = float(share)
        stats, moe = loop.state.model.moe_stats, loop.cfg.model.moe
        if stats is not None:  # an MoE: the logged step's router health (the same on every rank)
            router = router_metrics(stats, moe.num_experts, moe.top_k)
            metrics.update(router)
            loop.guard.check_router(loop, step, router)
        if loop.env.is_main:
            loop.callbacks.on_step_end(step, metrics)
            log.info(progress_line(step, loop.cfg.train.total_steps, metrics))
        if loop.report is not None:
            loop.report({"step": step, **metrics})
        loop.meter.reset()
        loop.stop = max(loop.stop, int(loop.env.broadcast_object(loop.stop_request())))


class Evaluator(Component):
    """Every train.eval_interval (and the last step): held-out loss per source."""

    def __init__(self) -> None:
        self.at = 0  # the step of the latest evaluation
        self.best: float | None = None  # the lowest evaluation of this start

    def on_start(self, loop: Loop) -> None:
        self.at = loop.step

    def due(self, loop: Loop, step: int, last: bool) -> bool:
        return step % loop.cfg.train.eval_interval == 0 or last

    def at_step_end(self, loop: Loop, step: int, last: bool) -> None:
        if not self.due(loop, step, last):
            return
        loop.state.progress.val_losses = loop.evaluate()
        self.at = step
        now = loop.state.progress.val_losses.get("all")
        if now is not None and (self.best is None or now < self.best):
            self.best = now
        if loop.env.is_main and loop.state.progress.val_losses:
            loop.callbacks.on_eval(step, dict(loop.state.progress.val_losses))


class Checkpointing(Component):
    """Every train.checkpoint.every_steps, the last step, a stop that asks for one,
    and a hold for an elastic run's growth: a checkpoint of the step; then finished
    checkpoints are delivered (kept in the loop's list, logged, rank 0's callbacks
    told)."""

    def __init__(self) -> None:
        self.saved_at = time.time()  # when the newest state on disk was (or the start)
        self.last_valid_at = time.time()

    def due(self, loop: Loop, step: int, last: bool) -> bool:
        return step % loop.cfg.train.checkpoint.every_steps == 0 or last

    def at_step_end(self, loop: Loop, step: int, last: bool) -> None:
        if self.due(loop, step, last) or loop.stop in (STOP_AND_SAVE, HOLD):
            self.save(loop)
        self.deliver(loop)

    def save(self, loop: Loop) -> None:
        """keep_best ranks a checkpoint by the held-out evaluation of this very step
        (val_loss, as reported); one saved between evaluations is not ranked."""
        t0 = time.perf_counter()
        self.saved_at = time.time()
        loop.checkpointer.save(evaluated=loop.evaluator.at == loop.step)
        loop.meter.record_checkpoint(time.perf_counter() - t0)

    def deliver(self, loop: Loop) -> None:
        for info in loop.checkpointer.completed():
            loop.checkpoints = [c for c in loop.checkpoints if c.step != info.step] + [info]
            loop.last_checkpoint = info
            if info.valid:
                self.last_valid_at = time.time()
            log.info(
                "checkpoint %s: %s%s",
                info.where,
                "valid" if info.valid else "NOT valid",
                f" (val_loss {info.val_loss:.4f})" if info.val_loss is not None else "",
            )
            loop.callbacks.on_checkpoint(info.step, info.where, info.valid, info.val_loss)

    def on_end(self, loop: Loop, status: str) -> None:
        loop.checkpointer.wait()
        loop.checkpointer.close()
        self.deliver(loop)
