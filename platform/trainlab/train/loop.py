"""The per-worker training loop.

One `Trainer` per worker process: build the model, apply parallelism, restore
the newest valid checkpoint, then run steps from the data stream until
`train.total_steps`, with evaluation, checkpoints, metrics and callbacks at
their intervals. It runs the same in a Ray Train worker and in a plain process
(world size 1, no process group), which is how the unit tests drive it.

Steps are counted as optimizer steps done: "step 20" is the state after 20
updates, checkpoint step-00000020 holds it, and resuming from it asks the data
stream for global step 20 (the 21st batch).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import resource
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from trainlab.config.schema import ExperimentConfig, ModelConfig
from trainlab.models import build_model
from trainlab.train import checkpoint as ck
from trainlab.train.callbacks import Callback, CallbackList, RunContext
from trainlab.train.distributed import DistEnv
from trainlab.train.job import TrainJob
from trainlab.train.parallel import (
    apply_parallelism,
    build_optimizer,
    gradient_sync,
    unwrap,
    uses_zero1,
)
from trainlab.train.rng import capture_rng, restore_rng, seed_everything, set_deterministic
from trainlab.train.schedule import lr_at
from trainlab.train.summary import read_attempts, read_failures, write_summary

log = logging.getLogger("trainlab.train")

Batch = dict[str, np.ndarray]
IGNORE_INDEX = -100


class StreamLoader(Protocol):
    """The worker side of the training stream (docs/contracts.md, section 3)."""

    def iter_from(self, step: int) -> Iterator[tuple[int, list[Batch]]]: ...
    def validation_batches(self, source: str, n: int) -> list[Batch]: ...
    def delivered_shares(self, step: int) -> dict[str, float]: ...
    def state_dict(self, step: int | None = None) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------- helpers


def to_tensors(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in batch.items()}


def loss_sum_and_count(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the tokens whose label is not -100,
    and how many there were."""
    logits = model(
        batch["input_ids"],
        position_ids=batch.get("position_ids"),
        document_ids=batch.get("document_ids"),
    )
    labels = batch["labels"]
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast works on CPU too; fp16 is GPU-only (with a grad scaler)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """Hash of a state dict in canonical order: sorted keys, each with its dtype,
    shape and raw bytes. Equal weights give equal hashes, bit for bit."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def memory_gb(device: torch.device) -> tuple[float, float]:
    """(current, peak) memory of this worker in GB: device memory on GPU,
    resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 1e9, torch.cuda.max_memory_allocated(
            device
        ) / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        current = peak
    return current, peak


def fallback_batch(m: ModelConfig, seq_len: int, seed: int) -> Batch:
    """A fixed batch of token ids for checkpoint validation when the dataset has
    no held-out split (val_fraction 0)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, m.vocab_size, size=(2, seq_len), dtype=np.int64)
    return {
        "input_ids": ids,
        "labels": np.roll(ids, -1, axis=1),
        "position_ids": np.tile(np.arange(seq_len, dtype=np.int64), (2, 1)),
        "document_ids": np.zeros((2, seq_len), dtype=np.int32),
    }


def load_weights_on_cpu(path: Path, m: ModelConfig, fmt: str) -> torch.nn.Module:
    """A fresh CPU model holding the weights of checkpoint directory `path`.

    Built on the meta device and materialized empty, so building it draws nothing
    from the training process's random number generators."""
    with torch.device("meta"):
        model = build_model(m)
    model.to_empty(device="cpu")
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(path / "state"), no_dist=True)
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(ck.load_file(path / "model.pt"))
    return model.eval()


def validate_checkpoint(path: Path, m: ModelConfig, fmt: str, batch: Batch) -> ck.Validation:
    """Load into a fresh CPU model and run one forward on a fixed batch: valid when
    it loads and the loss is finite."""
    model = load_weights_on_cpu(path, m, fmt)
    with torch.no_grad():
        total, count = loss_sum_and_count(model, to_tensors(batch, torch.device("cpu")))
    loss = (total / count.clamp(min=1)).item()
    if not math.isfinite(loss):
        return ck.Validation(ok=False, loss=None, error=f"validation loss is {loss}")
    return ck.Validation(ok=True, loss=loss)


@dataclass
class Window:
    """Timing of the steps since the last log line."""

    steps: int = 0
    step_time: float = 0.0
    data_wait: float = 0.0
    started: float = 0.0

    def reset(self) -> None:
        self.steps, self.step_time, self.data_wait = 0, 0.0, 0.0
        self.started = time.perf_counter()


# --------------------------------------------------------------------------- trainer


class Trainer:
    def __init__(
        self,
        job: TrainJob,
        loader: StreamLoader,
        env: DistEnv,
        callbacks: Callback | None = None,
        report: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.job = job
        self.cfg = ExperimentConfig.model_validate(job.cfg)
        self.loader, self.env = loader, env
        self.callbacks = callbacks if env.is_main and callbacks is not None else CallbackList([])
        self.report = report  # ray.train.report in a Ray worker (a barrier: every rank calls it)
        t, c = self.cfg.train, self.cfg.train.checkpoint
        self.fmt = "dcp" if self.cfg.parallel.strategy == "fsdp" and env.distributed else "torch"
        mirror = None
        if self.cfg.resource.storage and env.rank == 0:
            from trainlab.train.mirror import CheckpointMirror

            mirror = CheckpointMirror.for_run(self.cfg.resource.storage, job.run_path)
        self.writer = ck.CheckpointWriter(
            job.checkpoint_root,
            env.rank,
            env.world_size,
            c.keep_last,
            c.keep_best,
            c.async_save,
            mirror=mirror,
        )
        self.tokens_per_step = self.cfg.global_batch_size * self.cfg.data.seq_len
        self.flops_per_token = float(job.plan.get("flops_per_token") or 0.0)
        self.step = 0
        self.start_step = 0
        self.last_loss: float | None = None
        self.last_val: dict[str, float] = {}
        self.last_checkpoint: ck.CheckpointInfo | None = None
        self.last_valid_at = time.time()
        self.checkpoints: list[ck.CheckpointInfo] = []
        self.stop_reason = ""
        self.restarts = 0
        self._validation_batch: Batch | None = None
        self.window = Window()
        # Tokens and seconds of every log window but an attempt's first (which holds
        # the pipeline's warm-up): the run's steady-state throughput.
        self.steady_tokens, self.steady_seconds, self.windows_logged = 0, 0.0, 0
        self.window_rates: list[float] = []  # tokens/s of each log window after the first
        self._build(t.seed)

    # ----------------------------------------------------------------- setup

    def _build(self, seed: int) -> None:
        set_deterministic(self.cfg.train.deterministic)
        seed_everything(seed)  # the same initial weights on every rank
        model = build_model(self.cfg.model).to(self.env.device)
        self.model = apply_parallelism(model, self.cfg, self.env)
        self.optimizer = build_optimizer(self.model, self.cfg, self.env)
        self.scaler = torch.amp.GradScaler("cuda") if self.cfg.train.precision == "fp16" else None
        self._async_pg = None
        seed_everything(seed + 1 + self.env.rank)  # dropout differs per rank, reproducibly

    def _fixed_batch(self) -> Batch:
        for source in self.job.sources:
            batches = self.loader.validation_batches(source, 1)
            if batches:
                return {k: v[:2] for k, v in batches[0].items()}
        return fallback_batch(self.cfg.model, self.cfg.data.seq_len, self.cfg.train.seed)

    # ----------------------------------------------------------------- resume

    def resume(self) -> int:
        """Restore the newest valid checkpoint (rank 0 chooses, every rank loads)."""
        t0 = time.perf_counter()
        choice = None
        if self.env.is_main:
            ck.clean_staging(self.job.checkpoint_root)
            info = ck.find_resume(
                self.job.checkpoint_root, require_valid=self.cfg.train.checkpoint.validate
            )
            choice = str(info.path) if info else None
            self.checkpoints = ck.committed(self.job.checkpoint_root)
        choice = self.env.broadcast_object(choice)
        if choice is None:
            return 0
        self._load(Path(choice))
        if self.env.is_main:
            self.last_checkpoint = ck.read_info(Path(choice))
        log.info("resumed from %s (step %d) in %.2f s", choice, self.step, time.perf_counter() - t0)
        return self.step

    def _load(self, path: Path) -> None:
        state = ck.load_file(path / "trainer.pt")
        for key, mine in (
            ("config_hash", self.job.config_hash),
            ("dataset_fingerprint", self.job.dataset_fingerprint),
        ):
            if state.get(key) != mine and not (
                key == "dataset_fingerprint" and self.cfg.data.allow_fingerprint_change
            ):
                raise RuntimeError(
                    f"checkpoint {path}: {key} {state.get(key)} differs from this run's {mine}"
                )
        if state["format"] == "dcp":
            self._load_dcp(path)
        else:
            unwrap(self.model).load_state_dict(ck.load_file(path / "model.pt"))
            self.optimizer.load_state_dict(ck.load_file(path / "optimizer.pt"))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.loader.load_state_dict(state["data"])
        self.step = self.start_step = int(state["step"])
        self.last_val = dict(state.get("val_losses") or {})
        rng = path / f"rng-rank{self.env.rank}.pt"
        if rng.exists():
            restore_rng(ck.load_file(rng))
        else:  # the world size changed: no saved stream for this rank
            log.warning(
                "checkpoint %s has no RNG state for rank %d; reseeding", path, self.env.rank
            )
            seed_everything(self.cfg.train.seed + 1 + self.env.rank + 7919 * self.step)

    def _load_dcp(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }
        dcp.load(state, checkpoint_id=str(path / "state"))
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])

    # ----------------------------------------------------------------- one step

    def train_step(self, step: int, micro_batches: list[Batch]) -> tuple[float, float]:
        """One optimizer step over this rank's micro batches; returns (local mean
        loss over its labelled tokens, global gradient norm)."""
        lr = lr_at(step, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        tensors = [to_tensors(mb, self.env.device) for mb in micro_batches]
        labelled = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in tensors)
        total = torch.zeros((), device=self.env.device)
        for i, batch in enumerate(tensors):
            last = i == len(tensors) - 1
            with (
                gradient_sync(self.model, last),
                autocast_context(self.cfg.train.precision, self.env.device),
            ):
                loss_sum, _ = loss_sum_and_count(self.model, batch)
                loss = loss_sum / max(labelled, 1)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        grad_norm = self._clip_and_step()
        return total.item(), grad_norm

    def _clip_and_step(self) -> float:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.cfg.train.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ----------------------------------------------------------------- evaluation

    def evaluate(self) -> dict[str, float]:
        """Validation loss per source on its held-out split, and "all" (token-weighted)."""
        n = self.cfg.train.eval_batches
        sums = torch.zeros(2 * len(self.job.sources), dtype=torch.float64, device=self.env.device)
        self.model.eval()
        with torch.no_grad(), autocast_context(self.cfg.train.precision, self.env.device):
            for i, source in enumerate(self.job.sources):
                for batch in self.loader.validation_batches(source, n):
                    total, count = loss_sum_and_count(
                        self.model, to_tensors(batch, self.env.device)
                    )
                    sums[2 * i] += total.double()
                    sums[2 * i + 1] += count.double()
        self.model.train()
        sums = self.env.all_reduce_sum(sums)
        out = {
            s: (sums[2 * i] / sums[2 * i + 1]).item()
            for i, s in enumerate(self.job.sources)
            if sums[2 * i + 1] > 0
        }
        if sums[1::2].sum() > 0:
            out["all"] = (sums[0::2].sum() / sums[1::2].sum()).item()
        return out

    # ----------------------------------------------------------------- checkpoints

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "format": self.fmt,
            "data": self.loader.state_dict(self.step),
            "config_hash": self.job.config_hash,
            "dataset_fingerprint": self.job.dataset_fingerprint,
            "world_size": self.env.world_size,
            "strategy": self.cfg.parallel.strategy,
            "val_losses": dict(self.last_val),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def save_checkpoint(self) -> None:
        """Every rank writes its part of checkpoint `self.step`; rank 0 commits it
        (in the background with train.checkpoint.async_save)."""
        copy = self.cfg.train.checkpoint.async_save  # training will mutate the live tensors
        trainer_state = self._trainer_state()
        rng = capture_rng()
        rank = self.env.rank
        write_state = self._stage_dcp(copy) if self.fmt == "dcp" else self._stage_torch(copy)

        def write_files(staging: Path) -> None:
            write_state(staging)
            ck.save_file(rng, staging / f"rng-rank{rank}.pt")
            if rank == 0:
                ck.save_file(trainer_state, staging / "trainer.pt")

        validator = None
        if self.env.is_main and self.cfg.train.checkpoint.validate:
            validator = partial(
                validate_checkpoint, m=self.cfg.model, fmt=self.fmt, batch=self._validation_batch
            )
        meta = {
            "step": self.step,
            "config_hash": self.job.config_hash,
            "dataset_fingerprint": self.job.dataset_fingerprint,
            "format": self.fmt,
            "world_size": self.env.world_size,
            "strategy": self.cfg.parallel.strategy,
            "val_losses": dict(self.last_val),
            # Ranked by the fixed-batch loss of validation; without validation by the
            # latest evaluation.
            "val_loss": None if validator else self.last_val.get("all"),
        }
        self.writer.submit(self.step, write_files, meta, validator)

    def _stage_torch(self, copy: bool) -> Callable[[Path], None]:
        if uses_zero1(self.cfg, self.env):
            self.optimizer.consolidate_state_dict(to=0)  # a collective: on every rank
        if not self.env.is_main:
            return lambda staging: None
        model_state = unwrap(self.model).state_dict()
        optim_state = self.optimizer.state_dict()
        if copy:
            model_state, optim_state = _cloned(model_state), _cloned(optim_state)

        def write(staging: Path) -> None:
            ck.save_file(model_state, staging / "model.pt")
            ck.save_file(optim_state, staging / "optimizer.pt")

        return write

    def _stage_dcp(self, asynchronous: bool) -> Callable[[Path], None]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }
        target = str(self.writer.staging_dir(self.step) / "state")
        if not asynchronous:
            dcp.save(state, checkpoint_id=target)
            return lambda staging: None
        if self._async_pg is None:  # async collectives get their own group
            self._async_pg = dist.new_group(backend="gloo")
        future = dcp.async_save(state, checkpoint_id=target, process_group=self._async_pg)
        return lambda staging: future.result()

    def _deliver_checkpoints(self) -> None:
        for info in self.writer.completed():
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

    # ----------------------------------------------------------------- chaos

    def _maybe_chaos_kill(self) -> None:
        """train.chaos.kill_at_steps: hard-kill this worker the first time step k is
        reached (right after optimizer step k, before its logs and checkpoint)."""
        chaos = self.cfg.train.chaos
        if self.step not in chaos.kill_at_steps or self.env.rank != chaos.kill_rank:
            return
        marker = self.job.logs_dir / f"chaos-step-{self.step:08d}.json"
        if marker.exists():
            return
        record = {
            "step": self.step,
            "rank": self.env.rank,
            "time": time.time(),
            "error": f"chaos: train.chaos.kill_at_steps killed rank {self.env.rank} "
            f"at step {self.step}",
        }
        marker.write_text(json.dumps(record))
        log.warning(record["error"])
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    # ----------------------------------------------------------------- metrics

    def _log_step(self, loss: float, grad_norm: float) -> bool:
        """Metrics of the window since the last log, on rank 0; returns whether a
        callback asked to stop (collectives: every rank calls this at the same steps)."""
        agg = self.env.all_reduce_sum(
            torch.tensor([loss], dtype=torch.float64, device=self.env.device)
        )
        self.last_loss = agg[0].item() / self.env.world_size
        metrics = self._metrics(grad_norm)
        if self.windows_logged:
            self.steady_tokens += self.tokens_per_step * self.window.steps
            self.steady_seconds += time.perf_counter() - self.window.started
            self.window_rates.append(metrics["tokens_per_s"])
        self.windows_logged += 1
        if self.env.is_main:
            self.callbacks.on_step_end(self.step, metrics)
            self._progress_line(metrics)
        if self.report is not None:
            self.report({"step": self.step, **metrics})
        self.window.reset()
        stop = bool(self.env.broadcast_object(self.env.is_main and self.callbacks.stop_requested))
        if stop and self.env.is_main:
            self.stop_reason = self.callbacks.stop_reason or "a callback requested a stop"
        return stop

    def _metrics(self, grad_norm: float) -> dict[str, float]:
        w = self.window
        elapsed = max(time.perf_counter() - w.started, 1e-9)
        tokens_per_s = self.tokens_per_step * w.steps / elapsed
        step_time = w.step_time / max(w.steps, 1)
        mem, mem_peak = memory_gb(self.env.device)
        metrics = {
            "loss": float(self.last_loss),
            "lr": lr_at(self.step - 1, self.cfg.train),
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_time,
            "data_wait_frac": w.data_wait / elapsed,
            "mem_gb": mem,
            "mem_peak_gb": mem_peak,
            "ckpt_age_s": time.time() - self.last_valid_at,
            "eta_s": step_time * (self.cfg.train.total_steps - self.step),
        }
        peak = self.cfg.resource.peak_tflops
        if peak and self.flops_per_token:
            metrics["mfu"] = (
                self.flops_per_token * tokens_per_s / (peak * 1e12 * self.env.world_size)
            )
        for source, share in self.loader.delivered_shares(self.step).items():
            metrics[f"share/{source}"] = float(share)
        return metrics

    def _progress_line(self, m: dict[str, float]) -> None:
        total = self.cfg.train.total_steps
        log.info(
            "step %d/%d | loss %.4f | lr %.2e | %s tok/s | step %.3f s | data %.1f%% | eta %s",
            self.step,
            total,
            m["loss"],
            m["lr"],
            f"{m['tokens_per_s']:,.0f}",
            m["step_time_s"],
            100 * m["data_wait_frac"],
            _duration(m["eta_s"]),
        )

    # ----------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any] | None:
        """Train to the end (or until a callback stops the run); rank 0 returns the
        run summary and writes run_summary.json."""
        self._validation_batch = self._fixed_batch() if self.env.is_main else None
        start = self.resume()
        self._announce_start(start)
        t = self.cfg.train
        stream = self.loader.iter_from(start)
        self.window.reset()
        stopped = False
        while self.step < t.total_steps and not stopped:
            t0 = time.perf_counter()
            got_step, micro_batches = next(stream)
            if got_step != self.step:
                raise RuntimeError(f"data stream gave step {got_step}, expected {self.step}")
            t1 = time.perf_counter()
            loss, grad_norm = self.train_step(self.step, micro_batches)
            self.step += 1
            self.window.steps += 1
            self.window.data_wait += t1 - t0
            self.window.step_time += time.perf_counter() - t0
            if self.step == start + 1:
                self._record_first_step()
            self._maybe_chaos_kill()
            last = self.step == t.total_steps
            if self.step % t.log_interval == 0 or last:
                stopped = self._log_step(loss, grad_norm)
            if self.step % t.eval_interval == 0 or last:
                self.last_val = self.evaluate()
                if self.env.is_main and self.last_val:
                    self.callbacks.on_eval(self.step, dict(self.last_val))
            if self.step % t.checkpoint.every_steps == 0 or last or stopped:
                self.save_checkpoint()
            self._deliver_checkpoints()
        self.writer.wait()
        self._deliver_checkpoints()
        return self._finish("stopped" if stopped else "completed")

    def _record_first_step(self) -> None:
        """When this attempt completed its first step (recovery time = this minus the
        failure's time)."""
        if self.env.is_main:
            record = {"session": self.job.session, "first_step": self.step, "time": time.time()}
            with open(self.job.logs_dir / "attempts.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _announce_start(self, start: int) -> None:
        if not self.env.is_main:
            return
        record = {
            "session": self.job.session,
            "start_step": start,
            "world_size": self.env.world_size,
            "time": time.time(),
        }
        with open(self.job.logs_dir / "attempts.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self.restarts = max(0, len(read_attempts(self.job.run_path)) - 1)
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

    def weights_sha256(self) -> str | None:
        """Hash of the full model state dict (a collective under FSDP)."""
        if self.fmt == "dcp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:
            state = unwrap(self.model).state_dict() if self.env.is_main else {}
        return state_dict_sha256(state) if self.env.is_main else None

    def _finish(self, status: str) -> dict[str, Any] | None:
        digest = self.weights_sha256()
        if not self.env.is_main:
            return None
        best = ck.best(self.checkpoints)
        summary = {
            "name": self.cfg.name,
            "status": status,
            "final_step": self.step,
            "final_loss": self.last_loss,
            "val_loss": self.last_val.get("all"),
            "tokens_seen": self.step * self.tokens_per_step,
            "restarts": self.restarts,
            "weights_sha256": digest,
            "last_checkpoint": str(self.last_checkpoint.path) if self.last_checkpoint else None,
            "best_checkpoint": str(best.path) if best else None,
            "wall_seconds": round(time.time() - self.job.started_at, 3),
            "tokens_per_s": (
                self.steady_tokens / self.steady_seconds if self.steady_seconds else None
            ),
            # Robust to a few windows slowed by something else on the machine.
            "tokens_per_s_median": (
                statistics.median(self.window_rates) if self.window_rates else None
            ),
            "val_losses": dict(self.last_val),
            "run_dir": self.job.run_dir,
            "config_hash": self.job.config_hash,
            "dataset_fingerprint": self.job.dataset_fingerprint,
            "start_step": self.start_step,
            "stop_reason": self.stop_reason or None,
            "failures": read_failures(self.job.run_path, self.job.session),
        }
        write_summary(self.job.run_path, summary)
        self.callbacks.on_run_end(summary)
        return summary


def _cloned(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cloned(v) for v in obj)
    return obj


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
