"""The per-worker training loop: `fit`, one step, `evaluate`.

One `Trainer` per training process: it builds the `TrainState`, restores the
newest valid checkpoint through the `Checkpointer`, then runs steps from the
data stream until `train.total_steps`, with evaluation, checkpoints, metrics and
callbacks at their intervals. It runs the same in a Ray Train worker's training
process and in a plain process (world size 1, no process group), which is how
the unit tests drive it.

Steps are counted as optimizer steps done: "step 20" is the state after 20
updates, checkpoint step-00000020 holds it, and resuming from it asks the data
stream for global step 20 (the 21st batch).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from trainlab.train import checkpoint as ck
from trainlab.train.callbacks import Callback, CallbackList, RunContext
from trainlab.train.checkpointer import Checkpointer, layout_of
from trainlab.train.distributed import DistEnv
from trainlab.train.job import TrainJob
from trainlab.train.metrics import (
    NO_STOP,
    STOP,
    STOP_AND_SAVE,
    Meter,
    P0Rules,
    PendingSignals,
    StepSignals,
    launch,
    memory_gap,
    peak_memory_bytes,
    progress_line,
)
from trainlab.train.parallel import reshard
from trainlab.train.records import (
    INTERRUPT_REASON,
    RunRecords,
    planned_memory_bytes,
    run_summary,
)
from trainlab.train.state import (
    DataPosition,
    ModelState,
    Progress,
    TrainState,
)
from trainlab.train.step import (
    IGNORE_INDEX,
    Batch,
    autocast_context,
    concat,
    fallback_batch,
    local_value,
    loss_context,
    loss_sum_and_count,
    to_tensors,
    train_step_tensors,
)

log = logging.getLogger("trainlab.train")


class StreamLoader(Protocol):
    """The worker side of the training stream (docs/contracts.md, section 3)."""

    def iter_from(self, step: int) -> Iterator[tuple[int, list[Batch]]]: ...
    def validation_batches(self, source: str, n: int) -> list[Batch]: ...
    def delivered_shares(self, step: int) -> dict[str, float]: ...
    def state_dict(self, step: int | None = None) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Trainer:
    def __init__(
        self,
        job: TrainJob,
        loader: StreamLoader,
        env: DistEnv,
        callbacks: Callback | None = None,
        report: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.job, self.cfg, self.loader, self.env = job, job.cfg, loader, env
        self.callbacks = callbacks if env.is_main and callbacks is not None else CallbackList([])
        self.report = report  # ray.train.report in a Ray worker (a barrier: every rank calls it)
        self.records = RunRecords(job.run_dir)
        progress = Progress()
        self.state = TrainState(ModelState(self.cfg, env), progress, DataPosition(loader, progress))
        self.checkpointer = Checkpointer(job, env, self.state)
        self.meter = Meter(
            self.cfg, env.world_size, env.device, float(job.plan.get("flops_per_token") or 0.0)
        )
        self.start_step = 0
        self.restarts = 0
        self.last_loss: float | None = None
        self.last_checkpoint: ck.CheckpointInfo | None = None
        self.checkpoints: list[ck.CheckpointInfo] = []
        self.last_valid_at = time.time()
        self.stop_reason = ""
        self.stopped_at: int | None = None  # the step a P0 action stopped the run at
        self.stop_signal = NO_STOP  # the newest stop request every rank agreed on
        self._saved_at = time.time()  # when the newest state on disk was (or the start)
        self.last_signals = StepSignals(0, float("nan"), float("nan"), 0, 0.0, 0.0)
        self.p0_rules = P0Rules(self.cfg.tracking.alerts, job.p0_rules)
        self._eval_step = 0  # the step of the latest evaluation
        self._best_val_loss: float | None = None  # the lowest evaluation of this start
        self._chaos_fired: set[int] = set()

    @property
    def step(self) -> int:
        return self.state.progress.step

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model.model

    # ----------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any] | None:
        """Train to the end (or until a callback or a P0 action stops the run); rank 0
        returns the run summary and writes run_summary.json.

        Every step's health signals are read one step late (train.metrics): step
        s-1's after step s is queued, and a step's own at the steps that log,
        evaluate or checkpoint, so no checkpoint ever holds a state whose step was
        non-finite. A P0 action (tracking.alerts.on_p0) is decided on every rank
        from the same all-reduced values."""
        if self.env.is_main:
            self.checkpointer.validation_batch = self._validation_batch()
            self.checkpoints = ck.committed(self.job.checkpoint_root)
        self.last_checkpoint = self.checkpointer.restore()
        start = self.start_step = self._eval_step = self.step
        self._announce_start(start)
        t = self.cfg.train
        self._chaos_fired = self._chaos_markers()
        stream: Iterator[tuple[int, list[Batch]]] | None = None
        pending: PendingSignals | None = None
        self.meter.reset()
        status = None
        while self.step < t.total_steps and status is None:
            target = self._skip_target(self.step)
            if target != self.step:
                status, pending = self._observe(pending), None
                if status == "rolled_back":
                    status, stream = None, None
                    continue
                if status is not None:
                    break
                log.info("skipping the batches of steps %d-%d", self.step + 1, target)
                self.state.progress.step, stream = target, None
                continue
            if stream is None:
                stream = self.loader.iter_from(self.step)
            t0 = time.perf_counter()
            got_step, micro_batches = next(stream)
            if got_step != self.step:
                raise RuntimeError(f"data stream gave step {got_step}, expected {self.step}")
            t1 = time.perf_counter()
            loss, grad_norm = self.train_step(micro_batches)
            step_time = time.perf_counter() - t0
            self.meter.record(data_wait=t1 - t0, step_time=step_time)
            if self.step == start + 1 and self.env.is_main:
                self.records.first_step_done(self.job.session, self.step)
            self._maybe_chaos_kill()
            asked = self._stop_request()  # rank 0's, carried with this step's signals
            current = launch(self.env, self.step, loss, grad_norm, step_time, t1 - t0, asked)
            status, pending = self._observe(pending), current  # the previous step's
            last = self.step == t.total_steps
            # A stop rank 0 asked for (Ctrl-C, a callback) is read one step late, the
            # same on every rank: the run stops at this step, logging it.
            log_now = self.step % t.log_interval == 0 or last or self.stop_signal != NO_STOP
            eval_now = self.step % t.eval_interval == 0 or last
            save_now = self.step % t.checkpoint.every_steps == 0 or last
            if status is None and (log_now or eval_now or save_now):
                status, pending = self._observe(pending), None  # this step's, now
            if status == "rolled_back":
                status, stream, pending = None, None, None
                continue
            if status is not None:
                break
            log_now = log_now or self.stop_signal != NO_STOP  # this step's own may ask
            stop = max(self._log_step() if log_now else NO_STOP, self.stop_signal)
            if eval_now:
                self._evaluate_now()
            if save_now or stop == STOP_AND_SAVE:
                self._save()
            self._deliver_checkpoints()
            if stop != NO_STOP:
                status = "stopped"
                if self.env.is_main and not self.stop_reason:
                    self.stop_reason = self.callbacks.stop_reason or "a callback requested a stop"
        if status is None:
            status, pending = self._observe(pending), None
        self.checkpointer.wait()
        self._deliver_checkpoints()
        return self._finish("completed" if status in (None, "rolled_back") else status)

    def train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's micro batches; returns (local mean
        loss over its labelled tokens, global gradient norm before clipping) as
        device tensors (read back one step later)."""
        out = train_step_tensors(
            self.state.model,
            self.cfg,
            self.step,
            micro_batches,
            self.env.device,
            loss_factor=self._chaos_factor(self.step + 1),
        )
        self.state.progress.step += 1
        return out

    # ----------------------------------------------------------------- health and P0

    def _observe(self, pending: PendingSignals | None) -> str | None:
        """Read a step's signals, hand them to the callbacks (rank 0) and the P0
        rules (every rank, train.metrics.P0Rules); returns what the P0 action did:
        None (nothing), "rolled_back" or "stopped_by_alert"."""
        if pending is None:
            return None
        signals = self.last_signals = pending.read()
        self.stop_signal = max(self.stop_signal, signals.stop)
        if self.env.is_main:
            self.callbacks.on_step_signals(signals.step, signals.metrics())
        rule = self.p0_rules.check(signals)
        action = self.cfg.tracking.alerts.on_p0
        if rule is None or action == "notify":
            return None
        reason = f"P0 alert {rule} at step {signals.step}: {signals.describe()}"
        if action == "rollback_and_skip":
            done = len(self.checkpointer.rollbacks)
            if done < self.cfg.tracking.alerts.max_rollbacks:
                if self._rollback(rule, signals.step):
                    return "rolled_back"
                reason += " (no valid checkpoint before it to roll back to)"
            else:
                reason += f" (tracking.alerts.max_rollbacks = {done} used up)"
        log.error("stopping: %s", reason)
        self.stop_reason = reason
        self.stopped_at = signals.step
        return "stopped_by_alert"

    def _rollback(self, rule: str, at: int) -> bool:
        """Reload the newest valid checkpoint before the alert's step and skip the
        batches since (every rank at the same step); False when there is none."""
        self.checkpointer.wait()
        self._deliver_checkpoints()
        choice = None
        if self.env.is_main:
            before = [c for c in ck.committed(self.job.checkpoint_root) if c.valid and c.step < at]
            choice = str(max(before, key=lambda c: c.step).path) if before else None
        choice = self.env.broadcast_object(choice)
        if choice is None:
            return False
        rollbacks = list(self.checkpointer.rollbacks)
        self.checkpointer.load(Path(choice))
        to_step = self.step
        record = {
            "from_step": at,
            "to_step": to_step,
            "skipped": [to_step + 1, at],
            "rule": rule,
        }
        self.checkpointer.rollbacks = [*rollbacks, record]
        self._eval_step = to_step
        self.meter.reset()
        log.warning(
            "P0 %s at step %d: rolled back to step %d, skipping steps %d-%d",
            rule,
            at,
            to_step,
            to_step + 1,
            at,
        )
        if self.env.is_main:
            self.callbacks.on_rollback(dict(record))
        return True

    def _skip_target(self, step: int) -> int:
        """The step to continue from when the next steps' batches are skipped
        (train.skip_steps and the rollbacks' windows); `step` when none is."""
        windows = [tuple(w) for w in self.cfg.train.skip_steps]
        windows += [tuple(r["skipped"]) for r in self.checkpointer.rollbacks]
        moved = True
        while moved:
            moved = False
            for first, last in windows:
                if first <= step + 1 <= last:
                    step, moved = last, True
        return step

    def _chaos_factor(self, step: int) -> float:
        """train.chaos.nan_at_steps / spike_at_steps: the loss factor for step `step`
        (1-based), each firing once per run directory (a marker, like kill_at_steps)."""
        chaos = self.cfg.train.chaos
        if step in self._chaos_fired:
            return 1.0
        if step in chaos.nan_at_steps:
            factor = float("nan")
        elif step in chaos.spike_at_steps:
            factor = chaos.spike_factor
        else:
            return 1.0
        self._chaos_fired.add(step)
        if self.env.is_main:
            marker = self._chaos_marker(step)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"step": step, "loss_factor": str(factor)}))
        log.warning("chaos: step %d's loss multiplied by %s", step, factor)
        return factor

    def _chaos_marker(self, step: int) -> Path:
        return Path(self.job.run_dir) / "logs" / f"chaos-loss-step-{step:08d}.json"

    def _chaos_markers(self) -> set[int]:
        chaos = self.cfg.train.chaos
        steps = set(chaos.nan_at_steps) | set(chaos.spike_at_steps)
        return {s for s in steps if self._chaos_marker(s).exists()}

    def _evaluate_now(self) -> None:
        self.state.progress.val_losses = self.evaluate()
        self._eval_step = self.step
        now = self.state.progress.val_losses.get("all")
        if now is not None and (self._best_val_loss is None or now < self._best_val_loss):
            self._best_val_loss = now
        if self.env.is_main and self.state.progress.val_losses:
            self.callbacks.on_eval(self.step, dict(self.state.progress.val_losses))

    def _save(self) -> None:
        """A checkpoint of this step. keep_best ranks it by the held-out evaluation
        of this very step (val_loss, as reported); a checkpoint saved between
        evaluations has no val_loss and is not ranked (no extra evaluation)."""
        t0 = time.perf_counter()
        self._saved_at = time.time()
        self.checkpointer.save(evaluated=self._eval_step == self.step)
        self.meter.record_checkpoint(time.perf_counter() - t0)

    def evaluate(self) -> dict[str, float]:
        """Validation loss per source on its held-out split, and "all" (token-weighted)."""
        n, sources = self.cfg.train.eval_batches, self.job.sources
        sums = torch.zeros(2 * len(sources), dtype=torch.float64, device=self.env.device)
        m = self.state.model
        for part in m.parts:
            part.eval()
        with (
            torch.no_grad(),
            loss_context(m),
            autocast_context(self.cfg.train.precision, self.env.device),
        ):
            for i, source in enumerate(sources):
                batches = [
                    to_tensors(b, self.env.device)
                    for b in self.loader.validation_batches(source, n)
                ]
                for total, count in self._eval_losses(batches):
                    sums[2 * i] += total.double()
                    sums[2 * i + 1] += count.double()
        reshard(m.parts)
        for part in m.parts:
            part.train()
        sums = self.env.replica_sum(sums)
        out = {
            s: (sums[2 * i] / sums[2 * i + 1]).item()
            for i, s in enumerate(sources)
            if sums[2 * i + 1] > 0
        }
        if sums[1::2].sum() > 0:
            out["all"] = (sums[0::2].sum() / sums[1::2].sum()).item()
        return out

    def _eval_losses(
        self, batches: list[dict[str, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(summed loss, labelled tokens) of each validation pass: one per micro
        batch, or under pipeline parallelism one schedule pass per step's worth of
        rows (the loss is counted on the last stage's ranks only)."""
        m = self.state.model
        if m.pipeline is None:
            for batch in batches:
                total, count = loss_sum_and_count(m.model, batch)
                yield local_value(total), count
            return
        if not batches:
            return
        rows = concat(batches)
        step_rows = max(1, self.cfg.global_batch_size // self.env.dp_size)
        n_rows = rows["input_ids"].shape[0]
        for start in range(0, n_rows, step_rows):
            part = {k: v[start : start + step_rows] for k, v in rows.items()}
            short = m.pipeline.microbatches - part["input_ids"].shape[0]
            if short > 0:  # pad with rows that count for nothing
                pad = {k: v[:1].expand(short, *v.shape[1:]).clone() for k, v in part.items()}
                pad["labels"].fill_(IGNORE_INDEX)
                part = concat([part, pad])
            total = m.pipeline.run(part, 1.0, backward=False)
            count = (part["labels"] != IGNORE_INDEX).sum()
            yield (total if total is not None else torch.zeros((), device=count.device)), count

    # ----------------------------------------------------------------- around the loop

    def _validation_batch(self) -> Batch:
        """The fixed batch checkpoint validation runs a forward on."""
        for source in self.job.sources:
            batches = self.loader.validation_batches(source, 1)
            if batches:
                return {k: v[:2] for k, v in batches[0].items()}
        return fallback_batch(self.cfg.model, self.cfg.data.seq_len, self.cfg.train.seed)

    def _announce_start(self, start: int) -> None:
        if not self.env.is_main:
            return
        layout = layout_of(self.cfg)
        saved = (self.last_checkpoint.meta.get("layout") if self.last_checkpoint else None) or None
        self.records.attempt_started(
            self.job.session,
            start,
            self.env.world_size,
            layout,
            resharded_from=saved if saved and saved != layout else None,
        )
        self.restarts = self.records.restarts()
        log.info(
            "%s from step %d of %d (%d worker%s, %s, restarts so far: %d)",
            "resuming" if start else "starting",
            start,
            self.cfg.train.total_steps,
            self.env.world_size,
            "s" if self.env.world_size > 1 else "",
            self.cfg.parallel.strategy,
            self.restarts,
        )
        self.callbacks.on_run_start(
            RunContext(
                cfg=self.cfg,
                plan=self.job.plan,
                run_dir=self.job.run_dir,
                config_hash=self.job.config_hash,
                dataset_fingerprint=self.job.dataset_fingerprint,
                manifest_path=self.job.manifest_path,
                start_step=start,
                restarts=self.restarts,
                ray_job_id=self.job.ray_job_id,
            )
        )

    def _log_step(self) -> int:
        """Metrics of the window since the last log, on rank 0; returns rank 0's stop
        request (`_stop_request`: a callback may ask in `on_step_end`), the same on
        every rank (collectives: every rank calls this at the same steps). The
        step's loss and grad norm are its agreed signals (already read)."""
        signals = self.last_signals
        self.last_loss = signals.loss
        metrics = self.meter.window(
            self.step, signals.loss, signals.grad_norm, time.time() - self.last_valid_at
        )
        for source, share in self.loader.delivered_shares(self.step).items():
            metrics[f"share/{source}"] = float(share)
        if self.env.is_main:
            self.callbacks.on_step_end(self.step, metrics)
            log.info(progress_line(self.step, self.cfg.train.total_steps, metrics))
        if self.report is not None:
            self.report({"step": self.step, **metrics})
        self.meter.reset()
        return int(self.env.broadcast_object(self._stop_request()))

    def _stop_request(self) -> int:
        """Rank 0's stop request (NO_STOP on other ranks): a callback's stop saves a
        checkpoint; a Ctrl-C's (INTERRUPT_REASON) only when the newest state on disk
        is at least train.checkpoint.on_interrupt_min_age_s old, else the run
        resumes from its newest valid checkpoint."""
        if not (self.env.is_main and self.callbacks.stop_requested):
            return NO_STOP
        if self.callbacks.stop_reason != INTERRUPT_REASON:
            return STOP_AND_SAVE
        age = time.time() - self._saved_at
        return STOP_AND_SAVE if age >= self.cfg.train.checkpoint.on_interrupt_min_age_s else STOP

    def _deliver_checkpoints(self) -> None:
        for info in self.checkpointer.completed():
            self.checkpoints = [c for c in self.checkpoints if c.step != info.step] + [info]
            self.last_checkpoint = info
            if info.valid:
                self.last_valid_at = time.time()
            log.info(
                "checkpoint %s: %s%s",
                info.path,
                "valid" if info.valid else "NOT valid",
                f" (val_loss {info.val_loss:.4f})" if info.val_loss is not None else "",
            )
            self.callbacks.on_checkpoint(info.step, str(info.path), info.valid, info.val_loss)

    def _maybe_chaos_kill(self) -> None:
        """train.chaos.kill_at_steps: hard-kill this training process the first time
        step k is reached (right after optimizer step k, before its logs and checkpoint)."""
        chaos = self.cfg.train.chaos
        if self.step not in chaos.kill_at_steps or self.env.rank != chaos.kill_rank:
            return
        if self.records.chaos_marker(self.step).exists():
            return
        log.warning(self.records.record_chaos_kill(self.step, self.env.rank))
        for handler in logging.getLogger("trainlab").handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def weights_sha256(self) -> str | None:
        """Hash of the full model state dict on rank 0 (a collective under FSDP)."""
        return self.state.model.weights_digest()

    def peak_memory(self) -> int:
        """The largest peak memory of any rank (a collective)."""
        mine = torch.tensor([peak_memory_bytes(self.env.device)], dtype=torch.float64)
        return int(self.env.all_reduce_max(mine.to(self.env.device))[0].item())

    def _finish(self, status: str) -> dict[str, Any] | None:
        digest = self.weights_sha256()
        peak = self.peak_memory()
        if not self.env.is_main:
            return None
        planned = planned_memory_bytes(self.job.plan)
        gap = memory_gap(planned, peak)
        if gap and self.env.device.type == "cuda" and abs(peak / planned - 1) > 0.10:
            log.warning("peak device memory differs from the plan by more than 10%%: %s", gap)
        elif gap:
            log.info("peak memory per device: %s", gap)
        summary = run_summary(
            self.job,
            status,
            step=self.stopped_at if status == "stopped_by_alert" else self.step,
            restarts=self.restarts,
            last_checkpoint=self.last_checkpoint,
            best_checkpoint=ck.best(self.checkpoints),
            final_loss=self.last_loss,
            val_losses=self.state.progress.val_losses,
            weights_sha256=digest,
            start_step=self.start_step,
            throughput=self.meter.steady_throughput(),
            stop_reason=self.stop_reason or None,
            peak_memory_bytes=peak,
        )
        summary["rollbacks"] = list(self.checkpointer.rollbacks)
        # val_loss is the latest evaluation; best_val_loss the lowest of the run's:
        # this start's and those its kept checkpoints hold (keep_best keeps the lowest).
        lowest = [v for v in (self._best_val_loss, summary.get("best_val_loss")) if v is not None]
        summary["best_val_loss"] = min(lowest) if lowest else None
        saved = self.last_checkpoint is not None and self.last_checkpoint.step == self.step
        # The state in memory is past the anomaly, or a Ctrl-C stopped without saving.
        if status == "stopped_by_alert" or (status == "stopped" and not saved):
            resume = ck.find_resume(self.job.checkpoint_root, require_valid=True)
            summary["resume_step"] = resume.step if resume else 0
        self.records.write_summary(summary)
        self.callbacks.on_run_end(summary)
        return summary
