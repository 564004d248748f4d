"""A run's records on disk, each with one writer and one reader here.

    {run_dir}/run_summary.json      the run's outcome (trainlab.train.summaries builds it)
    {run_dir}/logs/failures.jsonl   one line per failed rank and attempt
    {run_dir}/logs/attempts.jsonl   each start of the training processes, when
                                    each attempt completed its first step, and each
                                    resize of an elastic run
    {run_dir}/logs/progress.json    rank 0's newest logged step
    {run_dir}/logs/extensions.jsonl each `--extend` of the run past its total_steps
    {run_dir}/logs/lock.jsonl       stale run locks taken over (written by
                                    trainlab.run.lock, which owns the lock)
    {run_dir}/logs/.reserve         room held for the records while a run trains
                                    (`reserve_room`): freed when the disk fails a
                                    write, so the failure can still be recorded

Summary keys checked from outside (keep them): name, status, final_step,
final_loss, val_loss, tokens_seen, restarts, weights_sha256, last_checkpoint,
best_checkpoint, wall_seconds. `status` is "completed", "stopped" (a callback
asked), "interrupted" (Ctrl-C; `trainlab train RUN_DIR --resume` continues it) or "failed" (then `error`, `failures` and `failure_cause`: "code",
"infrastructure" or "storage").

JSON-lines files take small appends from several processes (O_APPEND writes of
one line do not interleave); a torn or foreign line is skipped when read.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from trainlab.location import StoreUnavailable, Unavailable, read_retrying
from trainlab.run.location import RunLocation

log = logging.getLogger(__name__)
# A per-step record that storage could not take is said at most this often, and
# after one the per-step records wait this long before asking storage again (a
# failing request costs the step its SDK's retries: about 1-2 s).
OUTAGE_WARN_EVERY_S = 60.0
OUTAGE_BACKOFF_S = 10.0

SUMMARY = "run_summary.json"
FAILURES = "failures.jsonl"
ATTEMPTS = "attempts.jsonl"
PROGRESS = "progress.json"
EXTENSIONS = "extensions.jsonl"
RESERVE = ".reserve"
# What the records of a run's end take on a full disk (run_summary.json and its
# temporary copy, a failures line, the MLflow journal's end entries), with room over.
RESERVE_BYTES = 256 * 1024
# The driver's first Ctrl-C creates it; rank 0's agent turns it into a stop at the
# next step boundary (trainlab.train.supervision.agent, trainer), which ends the run as "interrupted".
INTERRUPT_FLAG = ".interrupt"
INTERRUPT_REASON = "interrupted by the user (Ctrl-C)"
# An elastic run's request for a checkpoint to grow at (RunRecords.request_growth).
RESIZE_REQUEST = "resize.json"

# Kinds of failure: infrastructure (the process or worker was killed or lost; a
# retry can succeed), code (an exception that would happen again), peer (a side
# effect of another rank's failure), storage (a write of the run's disk failed:
# full, I/O error; the attempt ends, never restarted in place: trainlab.train.loop.trainer).
INFRASTRUCTURE_KINDS = frozenset({"killed", "chaos", "lost"})
STORAGE = "storage"
# A user's component (train.components) raised a programming error in a hook: the
# same code fails again at the same step, so the attempt ends, never restarted.
COMPONENT = "component"
FAILURE_KINDS = frozenset({*INFRASTRUCTURE_KINDS, "error", "peer", STORAGE, COMPONENT})


@dataclass(frozen=True)
class Failure:
    """One failed rank of one failed attempt (`event` groups the ranks of an attempt)."""

    session: str
    event: str
    rank: int
    step: int | None
    error: str
    kind: str
    time: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAILURE_KINDS:
            raise ValueError(f"failure kind {self.kind!r} not in {sorted(FAILURE_KINDS)}")


def failure_cause(failures: list[dict[str, Any]]) -> str:
    """ "storage" when the last failure was a write the disk failed (exit 74),
    "infrastructure" when it killed or lost a process (exit 75), else "code".
    Failures that only say a peer went away (kind "peer") are its consequence, not
    a cause: the last event with another kind decides (a lost worker's peers may
    report their broken connections after it, as a separate event)."""
    causes = [f for f in failures if f.get("kind") != "peer"]
    if not causes:
        return "code"
    last_event = causes[-1].get("event")
    kinds = {f.get("kind") for f in causes if f.get("event") == last_event}
    if STORAGE in kinds:
        return STORAGE
    return "infrastructure" if kinds & INFRASTRUCTURE_KINDS else "code"


class GrowthState(StrEnum):
    """The growth handshake's states, in the order they are reached."""

    REQUESTED = "requested"  # the controller asked for a checkpoint to grow at
    ACCEPTED = "accepted"  # rank 0 asked the ranks to hold at this step's checkpoint
    READY = "ready"  # that checkpoint is committed, the ranks hold (`step`)
    GO = "go"  # the controller restarts the group at the larger size

    def before(self, other: GrowthState) -> bool:
        order = list(GrowthState)
        return order.index(self) < order.index(other)


@dataclass(frozen=True)
class Growth:
    """An elastic run's request to grow (logs/resize.json)."""

    id: str
    to_world_size: int
    state: GrowthState
    step: int | None = None  # the checkpoint's step, from READY on

    @classmethod
    def parse(cls, text: str | None) -> Growth | None:
        """The record in `text`; None when it is absent or not a growth record."""
        try:
            raw = json.loads(text or "")
            return cls(
                id=str(raw["id"]),
                to_world_size=int(raw["to_world_size"]),
                state=GrowthState(raw["state"]),
                step=None if raw.get("step") is None else int(raw["step"]),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"to_world_size": self.to_world_size, "id": self.id}
        out["state"] = self.state.value
        return out if self.step is None else {**out, "step": self.step}


class RunRecords:
    """The records of one run, in its directory or its object-storage prefix
    (`run_dir`: a path, a store URI, or a `trainlab.run.location.RunLocation`). Every
    record is written where the run lives, so processes on different nodes see
    each other's records without a shared filesystem."""

    def __init__(self, run_dir: str | Path | RunLocation):
        self.loc = run_dir if isinstance(run_dir, RunLocation) else RunLocation.of(run_dir)
        self.run_dir = self.loc.local  # this node's directory of the run
        self.logs = self.run_dir / "logs"

    # ------------------------------------------------------------------ failures

    def add_failures(self, *failures: Failure) -> None:
        now = time.time()
        self.loc.append_jsonl(
            f"logs/{FAILURES}", [{**asdict(f), "time": f.time or now} for f in failures]
        )

    def failures(self, session: str | None = None) -> list[dict[str, Any]]:
        """Failure records (of one session when given), oldest first."""
        records = self.loc.read_jsonl(f"logs/{FAILURES}")
        return [r for r in records if session is None or r.get("session") == session]

    def failure_events(self, session: str) -> set[str]:
        """Distinct failures of a session (one per failed attempt, whatever the ranks)."""
        return {r.get("event") or f"t{r.get('time')}" for r in self.failures(session)}

    def mark_attempt_failed(self, event: str) -> None:
        """Any rank's training process of attempt `event` failed: the other ranks'
        agents stop theirs (`attempt_failed`)."""
        self.loc.write_text(f"logs/.failed-{event}", "")

    def attempt_failed(self, event: str) -> bool:
        return self.loc.exists(f"logs/.failed-{event}")

    # ------------------------------------------------------------------ attempts

    def attempt_started(
        self,
        session: str,
        start_step: int,
        world_size: int,
        layout: dict[str, Any] | None = None,
        resharded_from: dict[str, Any] | None = None,
    ) -> None:
        """An attempt began at `start_step` on `layout` (tp/pp/dp/strategy/zero_stage);
        `resharded_from`: the layout of the checkpoint it resumed, when different."""
        record = {
            "session": session,
            "start_step": start_step,
            "world_size": world_size,
            "time": time.time(),
        }
        if layout is not None:
            record["layout"] = layout
        if resharded_from is not None:
            record["resharded_from"] = resharded_from
        self.loc.append_jsonl(f"logs/{ATTEMPTS}", [record])

    def first_step_done(self, session: str, step: int) -> None:
        """When an attempt completed its first step (recovery time = this minus the
        failure's time)."""
        self.loc.append_jsonl(
            f"logs/{ATTEMPTS}", [{"session": session, "first_step": step, "time": time.time()}]
        )

    def attempts(self) -> list[dict[str, Any]]:
        """Every start of the training processes in this run directory."""
        return [r for r in self.loc.read_jsonl(f"logs/{ATTEMPTS}") if "start_step" in r]

    def first_steps(self) -> list[dict[str, Any]]:
        """{"session", "first_step", "time"} of each attempt that completed a step."""
        return [r for r in self.loc.read_jsonl(f"logs/{ATTEMPTS}") if "first_step" in r]

    def restarts(self) -> int:
        """Restarts after a failure or a resize within one start of the run (one
        `trainlab train`: its session): the attempts beyond each session's first.
        A resume, an `--extend` or a job retry is a new start, not a restart
        (logs/attempts.jsonl lists every attempt of every start)."""
        attempts = self.attempts()
        return max(0, len(attempts) - len({a.get("session") for a in attempts}))

    # ------------------------------------------------------------------ resizes

    def resize_of_latest_attempt(self, first_step_at: float) -> dict[str, Any] | None:
        """The resize the newest attempt made, when its world size differs from the
        attempt the run last trained on (`_trained_before`) (an elastic run continued
        smaller after a loss, or larger once capacity returned): {step, from_world_size, to_world_size, from_dp,
        to_dp, reason, steps_redone, seconds}; None when the size did not change.

        `steps_redone`: the steps the earlier attempt had reached (the newest step rank 0
        logged, or a failure's step) past this attempt's start; `seconds`: from the
        loss (the first failure recorded after the earlier attempt started; for a
        growth, that attempt's last logged step) to `first_step_at`, when this
        attempt completed its first step."""
        starts = self.attempts()
        if len(starts) < 2:
            return None
        now = starts[-1]
        # A resize happens within one `trainlab train` (a later start at another
        # size, a resume or a job retry, is the user's choice or a new placement).
        if starts[-2].get("session") != now.get("session"):
            return None
        before = self._trained_before(starts, now)
        if before.get("world_size") == now.get("world_size"):
            return None
        grew = int(now["world_size"]) > int(before["world_size"])
        since = float(before.get("time", 0.0))
        lost = [f for f in self.failures() if float(f.get("time", 0.0)) >= since]
        progress = self._progress()
        reached = [int(f["step"]) for f in lost if f.get("step") is not None]
        if progress and float(progress.get("time", 0.0)) >= since:
            reached.append(int(progress["step"]))
        start = int(now["start_step"])
        loss_at = min((float(f["time"]) for f in lost), default=None)
        if loss_at is None and progress:
            loss_at = float(progress.get("time", 0.0))
        return {
            "step": start,
            "from_world_size": int(before["world_size"]),
            "to_world_size": int(now["world_size"]),
            "from_dp": (before.get("layout") or {}).get("dp"),
            "to_dp": (now.get("layout") or {}).get("dp"),
            "reason": "capacity returned" if grew else "node lost",
            "steps_redone": max([0, *(r - start for r in reached)]),
            "seconds": round(first_step_at - loss_at, 3) if loss_at is not None else None,
        }

    def _trained_before(self, starts: list[dict[str, Any]], now: dict[str, Any]) -> dict[str, Any]:
        """The attempt of `now`'s session the run last trained on: the newest earlier
        one that completed a step. A restart that failed before its first step (Ray
        restarting the group at the old size on a view that still counted a lost
        node) is passed over, so the resize is measured from where training was: its
        size, the steps redone, the time since the loss. Without any first-step
        record, the attempt just before."""
        session = now.get("session")
        earlier = [a for a in starts[:-1] if a.get("session") == session]
        bounds = [float(a.get("time", 0.0)) for a in (*earlier, now)]
        stepped = [
            float(r.get("time", 0.0)) for r in self.first_steps() if r.get("session") == session
        ]
        for i in range(len(earlier) - 1, -1, -1):
            if any(bounds[i] <= t < bounds[i + 1] for t in stepped):
                return earlier[i]
        return earlier[-1]

    def add_resize(self, session: str, record: dict[str, Any]) -> None:
        """Record a resize (`resize_of_latest_attempt`) in logs/attempts.jsonl."""
        self.loc.append_jsonl(
            f"logs/{ATTEMPTS}", [{"session": session, "resize": record, "time": time.time()}]
        )

    def resizes(self) -> list[dict[str, Any]]:
        """Every resize of the run, oldest first."""
        return [
            r["resize"]
            for r in self.loc.read_jsonl(f"logs/{ATTEMPTS}")
            if isinstance(r.get("resize"), dict)
        ]

    # ------------------------------------------------------------------ progress

    def write_progress(self, step: int) -> None:
        """Rank 0's newest logged step, for failures that take the agent down too.
        Written every step: storage that does not take it (an object store's
        outage) is warned about and training goes on; a later step writes it again."""
        if self._in_outage():
            return
        try:
            self.loc.write_text(f"logs/{PROGRESS}", json.dumps({"step": step, "time": time.time()}))
        except OSError as e:
            self._outage(f"logs/{PROGRESS} not written", e)

    def _in_outage(self) -> bool:
        return time.monotonic() < getattr(self, "_quiet_until", float("-inf"))

    def _outage(self, what: str, error: OSError) -> None:
        """A per-step record storage did not take: one warning a minute at most, and
        no per-step request for OUTAGE_BACKOFF_S."""
        now = time.monotonic()
        self._quiet_until = now + OUTAGE_BACKOFF_S
        if now - getattr(self, "_warned_at", float("-inf")) >= OUTAGE_WARN_EVERY_S:
            self._warned_at = now
            log.warning("%s (%s); training goes on, it is tried again next step", what, error)

    def last_logged_step(self) -> int | None:
        progress = self._progress()
        return int(progress["step"]) if progress else None

    def _progress(self) -> dict[str, Any] | None:
        """{"step", "time"} of progress.json, or None when there is none to read."""
        try:
            record = json.loads(self.loc.read_text(f"logs/{PROGRESS}") or "")
            int(record["step"])
            return record
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # ------------------------------------------------------------------ extensions

    def add_extension(self, record: dict[str, Any]) -> None:
        """The run was continued past its total_steps (`trainlab train --extend`):
        what changed, the config hashes before and after, the hash the run keeps."""
        self.loc.append_jsonl(f"logs/{EXTENSIONS}", [{**record, "time": time.time()}])

    def extensions(self) -> list[dict[str, Any]]:
        return self.loc.read_jsonl(f"logs/{EXTENSIONS}")

    # ------------------------------------------------------------------ interrupts

    def request_interrupt(self) -> None:
        """Ask the training processes to stop at the next step boundary (a Ctrl-C)."""
        self.loc.write_text(f"logs/{INTERRUPT_FLAG}", "")

    def interrupt_requested(self) -> bool:
        """Whether the driver asked to stop (asked every step: storage that does not
        answer is no request, and is warned about)."""
        if self._in_outage():
            return False
        try:
            return self.loc.exists(f"logs/{INTERRUPT_FLAG}")
        except OSError as e:
            self._outage(f"logs/{INTERRUPT_FLAG} not read", e)
            return False

    def clear_interrupt(self) -> None:
        """A new start of the run (a resume) is not interrupted by an old Ctrl-C."""
        self.loc.delete(f"logs/{INTERRUPT_FLAG}")

    # ------------------------------------------------------------------ growth

    # An elastic run grows at a checkpoint taken for it (docs/elastic.md): Ray's
    # resize check (trainlab.train.driver.elastic, in Ray Train's controller) asks
    # for one, rank 0 takes it at the next step boundary and holds the ranks there,
    # the controller restarts the group larger from it, so no step is redone. One
    # small record, `logs/resize.json` (a Growth); deleted to cancel.

    def request_growth(self, to_world_size: int) -> str:
        request_id = f"{time.time_ns():x}"
        self._write_growth(Growth(request_id, to_world_size, GrowthState.REQUESTED))
        return request_id

    def growth(self) -> Growth | None:
        """The pending growth request, or None."""
        return Growth.parse(self.loc.read_text(f"logs/{RESIZE_REQUEST}"))

    def growth_accepted(self, request_id: str) -> None:
        """Rank 0 has asked the ranks to hold at this step's checkpoint (it may take
        long to commit: the controller waits for it)."""
        self._advance_growth(request_id, GrowthState.ACCEPTED)

    def growth_ready(self, request_id: str, step: int) -> None:
        """Rank 0 holds at `step`, whose checkpoint is committed."""
        self._advance_growth(request_id, GrowthState.READY, step)

    def growth_go(self, request_id: str) -> None:
        """The controller restarts the group now: the ranks keep holding."""
        self._advance_growth(request_id, GrowthState.GO)

    def cancel_growth(self) -> None:
        """No growth (capacity gone again, a new worker group): the ranks go on."""
        self.loc.delete(f"logs/{RESIZE_REQUEST}")

    def _advance_growth(self, request_id: str, state: GrowthState, step: int | None = None) -> None:
        """Move request `request_id` forward to `state`; a request cancelled or
        replaced meanwhile, or already past `state`, is left as it is."""
        record = self.growth()
        if record is not None and record.id == request_id and record.state.before(state):
            self._write_growth(
                replace(record, state=state, step=record.step if step is None else step)
            )

    def _write_growth(self, record: Growth) -> None:
        self.loc.write_text(f"logs/{RESIZE_REQUEST}", json.dumps(record.to_json()))

    # ------------------------------------------------------------------ chaos

    def chaos_killed(self, step: int) -> bool:
        """train.chaos killed a training process at `step` already (once per run)."""
        return self.loc.exists(f"logs/chaos-step-{step:08d}.json")

    def record_chaos_kill(self, step: int, rank: int) -> str:
        """Written by a training process right before train.chaos kills it; returns
        the error text the agent will record for it."""
        error = f"chaos: train.chaos.kill_at_steps killed rank {rank} at step {step}"
        record = {"step": step, "rank": rank, "time": time.time(), "error": error}
        self.loc.write_text(f"logs/chaos-step-{step:08d}.json", json.dumps(record))
        return error

    def chaos_kill(self, rank: int, since: float) -> dict[str, Any] | None:
        """The chaos kill of `rank`'s training process at or after time `since`, if any."""
        names = [n for n in self.loc.list("logs") if n.startswith("chaos-step-")]
        for name in sorted(names, reverse=True):
            try:
                rec = json.loads(self.loc.read_text(f"logs/{name}") or "")
            except (OSError, ValueError):
                continue
            if rec.get("rank") == rank and rec.get("time", 0) >= since:
                return rec
        return None

    # ------------------------------------------------------------------ room

    def reserve_room(self, size: int = RESERVE_BYTES) -> bool:
        """Hold `size` bytes of the run's disk (logs/.reserve) for the records of its
        end; False when there is not even that much room (nothing held). A run in
        object storage has no disk of its own to fill (trainlab.location)."""
        return self.loc.home.reserve(f"logs/{RESERVE}", size)

    def release_room(self) -> None:
        """Free the room `reserve_room` held (the disk failed a write, or the run ends)."""
        self.loc.home.release(f"logs/{RESERVE}")

    # ------------------------------------------------------------------ summary

    def write_summary(self, summary: dict[str, Any]) -> str:
        """Write run_summary.json; returns where (a path, or the store URI). Storage
        that is unavailable is retried with backoff (trainlab.location.read_retrying)
        before the write fails (an OSError: the trainer's storage fault)."""
        text = json.dumps(summary, indent=2, default=str) + "\n"
        try:
            read_retrying(lambda: self.loc.write_text(SUMMARY, text), self.loc.uri_of(SUMMARY))
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from e
        return self.loc.uri_of(SUMMARY)

    def read_summary(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.loc.read_text(SUMMARY) or "")
        except (OSError, ValueError):
            return None
