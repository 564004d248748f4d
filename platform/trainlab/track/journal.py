"""Records that survive the store: a run's tracking writes wait in a local journal.

Rank 0's MLflow callback (trainlab.track.mlflow_cb) never writes to the store
directly. Every record (the run's start with its tags and params, metric
points, tags, artifact references, the end and its status) is first appended
to `{run_dir}/logs/mlflow-journal.jsonl`, one JSON entry a line, each append
fsynced. Entries are then applied to the store in order by `flush_journal`;
`{run_dir}/logs/mlflow-journal.flushed` keeps the byte offset applied so far
(and the MLflow run id). A store that is locked, slow or down only delays the
record: the entries wait in the journal and are applied when the store
answers: by the run's own background flusher, at the run's end, or by the
next trainlab command that opens the store (trainlab.track.backend.client_for
flushes the pending journals of the run directories under the runs root), or
by `trainlab track-flush RUN_DIR`.

Replay is idempotent: the start finds the run by its `run_key` tag before
creating one; tags and params are set to the same values; metric points carry
their timestamp, so a point applied twice (a flush interrupted before its
offset was recorded) is the same (key, step, timestamp, value), which the
store keeps once. One flusher at a time per journal (an flock on
`mlflow-journal.lock`, not waited for).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JOURNAL = "mlflow-journal.jsonl"
MARKER = "mlflow-journal.flushed"
LOCK = "mlflow-journal.lock"
METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
PARAMS_PER_BATCH = 100
TAGS_PER_BATCH = 100
FLUSH_COMMAND = "trainlab track-flush"

# MLflow error codes of an entry the store will never take (not of a busy store):
# such an entry is logged and skipped, so it cannot hold back the rest.
_REFUSED = frozenset({"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST"})


# Entries that wait this long without a failure are said (a slow store).
WARN_AFTER_S = 30.0


def retry_s() -> float:
    """Seconds between a running run's attempts at a store that did not answer."""
    return float(os.environ.get("TRAINLAB_STORE_RETRY_S") or 5.0)


def end_wait_s() -> float:
    """How long a run's end waits for its records to reach the store."""
    return float(os.environ.get("TRAINLAB_STORE_END_WAIT_S") or 30.0)


def run_key(run_dir: str) -> str:
    """Identity of a training run in MLflow: a hash of its absolute run directory
    (or of its URI, for a run in object storage)."""
    from trainlab.location import locate

    return hashlib.sha256(locate(run_dir).resolved().uri.encode()).hexdigest()[:32]


def now_ms() -> int:
    return int(time.time() * 1000)


class Journal:
    """The journal of one run directory."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)
        logs = self.run_dir / "logs"
        self.path = logs / JOURNAL
        self.marker = logs / MARKER
        self.lock_path = logs / LOCK
        self._append_lock = threading.Lock()
        self.last_error: str | None = None  # why the latest flush stopped, if the store failed

    # ------------------------------------------------------------------ writing

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Append entries (one write, fsynced): they are durable when this returns."""
        if not entries:
            return
        data = "".join(json.dumps(e, separators=(",", ":"), default=str) + "\n" for e in entries)
        with self._append_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data.encode())
                os.fsync(fd)
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ reading

    def state(self) -> dict[str, Any]:
        try:
            state = json.loads(self.marker.read_text())
            return state if isinstance(state, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_state(self, state: dict[str, Any]) -> None:
        tmp = self.marker.with_name(self.marker.name + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.marker)

    def entries(self, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        """(offset after the entry, entry) from byte `start`; a torn last line
        (no newline yet) is not an entry."""
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                offset = start
                for line in f:
                    if not line.endswith(b"\n"):
                        return
                    offset += len(line)
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        log.warning("%s: unreadable entry at byte %d skipped", self.path, offset)
                        continue
                    yield offset, entry
        except FileNotFoundError:
            return

    def has_pending(self) -> bool:
        try:
            size = self.path.stat().st_size
        except OSError:
            return False
        return size > int(self.state().get("offset") or 0)

    def pending_count(self) -> int:
        """Entries not yet in the store."""
        if not self.has_pending():
            return 0
        return sum(1 for _ in self.entries(int(self.state().get("offset") or 0)))

    def has_start(self) -> bool:
        return any(e.get("op") == "start" for _, e in self.entries())

    def metric_high_water(self) -> dict[str, int]:
        """Each metric's largest step journaled (every start of the run)."""
        last: dict[str, int] = {}
        for _, entry in self.entries():
            if entry.get("op") == "metrics":
                for key, _value, _ts, step in entry["points"]:
                    last[key] = max(last.get(key, -1), int(step))
        return last

    @contextlib.contextmanager
    def flushing(self) -> Iterator[bool]:
        """The flusher's lock, not waited for: yields False when another holds it."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- the store


def store_busy(uri: str) -> bool:
    """The embedded (SQLite) store is locked by another process right now. A quick
    probe: MLflow itself waits 20 s on a locked database before it gives up."""
    # trainlab.track.backend.embedded_db_path (the store's opening imports this module)
    db = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    if db is None or not db.is_file():
        return False
    try:
        con = sqlite3.connect(str(db), timeout=0.05, isolation_level=None)
        try:
            con.execute("BEGIN IMMEDIATE")
            con.execute("ROLLBACK")
        finally:
            con.close()
    except sqlite3.OperationalError:
        return True
    return False


def flush_journal(journal: Journal, client: Any, on_start: Any = None) -> int:
    """Apply `journal`'s pending entries to the store of `client`, in order; returns
    how many still wait (0: all are in). Never raises for a store that does not
    answer: what was not applied stays for the next flush. `on_start(run, existed)`
    is called after each start entry is applied. A flush of the same journal in
    progress elsewhere is not waited for (returns the pending count)."""
    journal.last_error = None
    with journal.flushing() as mine:
        if not mine:  # another flush is on it: not a failure
            return journal.pending_count()
        state = journal.state()
        offset = int(state.get("offset") or 0)
        group: list[tuple[int, dict[str, Any]]] = []
        try:
            for end, entry in journal.entries(offset):
                if entry.get("op") == "metrics" and _points(group) < METRICS_PER_BATCH:
                    group.append((end, entry))
                    continue
                if group:
                    _apply_metrics(client, journal, state, group)
                    group = []
                if entry.get("op") == "metrics":
                    group.append((end, entry))
                    continue
                _apply_one(client, journal, state, entry, on_start)
                state["offset"] = end
                journal._save_state(state)
            if group:
                _apply_metrics(client, journal, state, group)
        except _StoreDown as e:
            journal.last_error = str(e)
            log.debug("MLflow store did not answer (%s); records wait in %s", e, journal.path)
        return journal.pending_count()


class _StoreDown(Exception):
    pass


def _points(group: list[tuple[int, dict[str, Any]]]) -> int:
    return sum(len(e["points"]) for _, e in group)


@contextlib.contextmanager
def _store_call(journal: Journal, what: str) -> Iterator[None]:
    """A store call: an error of a busy or unreachable store stops the flush
    (_StoreDown); an entry the store refuses for good is logged and skipped."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - sorted below
        code = getattr(e, "error_code", "")
        if code in _REFUSED and "locked" not in str(e):
            log.warning("%s: the store refused %s, skipped: %s", journal.path, what, e)
            return
        raise _StoreDown(str(e).splitlines()[0][:200] if str(e) else type(e).__name__) from e


def _run_id(client: Any, journal: Journal, state: dict[str, Any]) -> str:
    """The MLflow run of the journal's run directory (found by its run_key)."""
    if state.get("run_id"):
        return str(state["run_id"])
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(
        ids, filter_string=f"tags.run_key = '{run_key(str(journal.run_dir))}'", max_results=1
    )
    if not runs:
        raise _StoreDown(f"no MLflow run for {journal.run_dir} yet")
    state["run_id"] = runs[0].info.run_id
    return state["run_id"]


def _apply_metrics(
    client: Any, journal: Journal, state: dict[str, Any], group: list[tuple[int, dict[str, Any]]]
) -> None:
    from mlflow.entities import Metric

    with _store_call(journal, "metric points"):
        run_id = _run_id(client, journal, state)
        points = [
            Metric(key, float(value), int(ts), int(step))
            for _, entry in group
            for key, value, ts, step in entry["points"]
        ]
        for i in range(0, len(points), METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=points[i : i + METRICS_PER_BATCH])
    state["offset"] = group[-1][0]
    journal._save_state(state)


def _apply_one(
    client: Any, journal: Journal, state: dict[str, Any], entry: dict[str, Any], on_start: Any
) -> None:
    op = entry.get("op")
    with _store_call(journal, f"a {op} entry"):
        if op == "start":
            run, existed = _apply_start(client, entry)
            state["run_id"] = run.info.run_id
            if on_start is not None:
                on_start(run, existed)
            return
        run_id = _run_id(client, journal, state)
        if op == "tags":
            from mlflow.entities import RunTag

            items = [RunTag(k, v) for k, v in entry["tags"].items()]
            for i in range(0, len(items), TAGS_PER_BATCH):
                client.log_batch(run_id, tags=items[i : i + TAGS_PER_BATCH])
        elif op == "artifact":
            if Path(entry["path"]).exists():
                client.log_artifact(run_id, entry["path"], entry.get("artifact_path"))
            else:
                log.warning("%s: %s is gone; not logged", journal.path, entry["path"])
        elif op == "artifacts":
            if Path(entry["path"]).is_dir():
                client.log_artifacts(run_id, entry["path"], entry.get("artifact_path"))
        elif op == "text":
            client.log_text(run_id, entry["text"], entry["file"])
        elif op == "dict":
            client.log_dict(run_id, entry["data"], entry["file"])
        elif op == "figures":
            _log_figures(client, run_id, entry)
        elif op == "end":
            client.set_terminated(run_id, entry["status"], end_time=entry.get("time"))
        else:
            log.warning("%s: unknown entry %r skipped", journal.path, op)


def _apply_start(client: Any, entry: dict[str, Any]) -> tuple[Any, bool]:
    """Find the run by its run_key (continued: status RUNNING and the resume tags)
    or create it with its tags, params and start artifacts."""
    from mlflow.entities import Param, RunTag

    from trainlab.track.experiments import get_or_create_experiment

    exp_id = get_or_create_experiment(client, entry["experiment"], entry.get("artifact_location"))
    runs = client.search_runs(
        [exp_id],
        filter_string=f"tags.run_key = '{entry['run_key']}'",
        max_results=1,
        order_by=["attributes.start_time DESC"],
    )
    if runs and runs[0].data.params:
        run = runs[0]
        client.update_run(run.info.run_id, status="RUNNING")
        tags = [RunTag(k, v) for k, v in entry.get("resume_tags", {}).items()]
        if tags:
            client.log_batch(run.info.run_id, tags=tags)
        return run, True
    if runs:  # created by a flush cut short before its params: completed here
        run_id = runs[0].info.run_id
        items = [RunTag(k, v) for k, v in entry["tags"].items()]
        for i in range(0, len(items), TAGS_PER_BATCH):
            client.log_batch(run_id, tags=items[i : i + TAGS_PER_BATCH])
    else:
        run = client.create_run(
            exp_id, run_name=entry["run_name"], tags=entry["tags"], start_time=entry.get("time")
        )
        run_id = run.info.run_id
    params = [Param(k, v) for k, v in entry.get("params", {}).items()]
    for i in range(0, len(params), PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[i : i + PARAMS_PER_BATCH])
    for art in entry.get("artifacts", []):
        if "text" in art:
            client.log_text(run_id, art["text"], art["file"])
        elif "data" in art:
            client.log_dict(run_id, art["data"], art["file"])
        elif Path(art["path"]).exists():
            client.log_artifact(run_id, art["path"], art.get("artifact_path"))
    return client.get_run(run_id), False


def _log_figures(client: Any, run_id: str, entry: dict[str, Any]) -> None:
    from trainlab.track.plots import loss_curve_figure, mix_share_figure, normalized_mix
    from trainlab.track.series import metric_series

    series = metric_series(client, run_id, prefixes=("loss", "val_loss/", "share/"))
    val = {k.removeprefix("val_loss/"): v for k, v in series.items() if k.startswith("val_loss/")}
    shares = {k.removeprefix("share/"): v for k, v in series.items() if k.startswith("share/")}
    name = entry["name"]
    client.log_figure(
        run_id,
        loss_curve_figure(series.get("loss", []), val, title=f"{name}: loss"),
        "loss_curve.png",
    )
    client.log_figure(
        run_id,
        mix_share_figure(
            shares, normalized_mix(entry["mix"]), title=f"{name}: delivered token share"
        ),
        "mix_shares.png",
    )


# --------------------------------------------------------------------------- run directories


def pending_journals(runs_root: str | os.PathLike[str]) -> list[Journal]:
    """Journals with entries not yet in the store, of the run directories
    ({runs_root}/{date}/{name}) under `runs_root`."""
    root = Path(runs_root)
    found = []
    for path in sorted(root.glob(f"*/*/logs/{JOURNAL}")):
        journal = Journal(path.parents[1])
        if journal.has_pending():
            found.append(journal)
    return found


def flush_pending(client: Any, runs_root: str | os.PathLike[str]) -> dict[str, int]:
    """Flush every pending journal under `runs_root` (the hook of every command
    that opens the store); returns {run_dir: records still waiting}. Never raises."""
    left: dict[str, int] = {}
    try:
        journals = pending_journals(runs_root)
    except OSError as e:
        log.warning("could not look for pending records under %s: %s", runs_root, e)
        return left
    for journal in journals:
        try:
            before = journal.pending_count()
            waiting = flush_journal(journal, client)
        except Exception as e:  # noqa: BLE001 - another run's records must not fail a command
            log.warning("could not flush the records of %s: %s", journal.run_dir, e)
            continue
        left[str(journal.run_dir)] = waiting
        if waiting < before:
            log.info("%s: %d record(s) written to the store", journal.run_dir, before - waiting)
        if waiting == 0:
            clear_pending_in_summary(journal.run_dir)
    return left


def clear_pending_in_summary(run_dir: str | os.PathLike[str]) -> None:
    """run_summary.json stops saying records wait, once they are all in the store."""
    from trainlab.run.records import RunRecords
    from trainlab.track.ended import summary_is_current

    records = RunRecords(run_dir)
    summary = records.read_summary()
    if summary and summary.get("records_pending") and summary_is_current(run_dir):
        summary["records_pending"] = 0
        records.write_summary(summary)


class Flusher:
    """A run's background flusher: applies its journal whenever woken (a new
    entry) and retries every retry_s() while the store does not answer."""

    def __init__(self, journal: Journal, connect: Any, uri: str, on_start: Any = None):
        self.journal = journal
        self._connect = connect  # () -> client (opens the store)
        self.uri = uri
        self.on_start = on_start
        self.client: Any = None
        self._next_try = 0.0  # after a failed attempt: not before this (monotonic)
        self.ready = False  # on_start was called for this flusher's run
        self._down = False
        self._pending_since: float | None = None  # when entries started waiting
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainlab-journal", daemon=True)

    def start(self) -> Flusher:
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def try_flush(self) -> int:
        """One attempt now; returns the entries still waiting. A store that failed
        (locked, an error) is retried every `retry_s()` and said once; entries left
        by a flush that raced new ones go at the next wake, said only when they
        have waited `WARN_AFTER_S`."""
        error = None
        left = None
        if store_busy(self.uri):
            error = "locked by another process"
        else:
            try:
                if self.client is None:
                    self.client = self._connect()
                left = flush_journal(self.journal, self.client, self._started)
                error = self.journal.last_error
                self._adopt()
            except Exception as e:  # noqa: BLE001 - a tracking outage must not end training
                error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        if left is None:
            left = self.journal.pending_count()
        if not left:
            if self._down:
                log.info(
                    "MLflow store answers again; the records of %s are in", self.journal.run_dir
                )
            self._down, self._pending_since = False, None
            return 0
        now = time.monotonic()
        self._pending_since = self._pending_since or now
        if error is not None:
            self._next_try = now + retry_s()
        if not self._down and (error is not None or now - self._pending_since >= WARN_AFTER_S):
            log.warning(
                "MLflow store did not answer (%s); %d record(s) wait in %s, retried every %g s",
                error or f"records waiting for {now - self._pending_since:.0f} s",
                left,
                self.journal.path,
                retry_s(),
            )
            self._down = True
        return left

    def _started(self, run: Any, existed: bool) -> None:
        self.ready = True
        if self.on_start is not None:
            self.on_start(run, existed)

    def _adopt(self) -> None:
        """The journal's start was applied by another process (a command that
        opened the store while this run's flusher waited): its run is this one's."""
        run_id = self.journal.state().get("run_id")
        if self.ready or not run_id:
            return
        self._started(self.client.get_run(run_id), True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(retry_s())
            self._wake.clear()
            wait = self._next_try - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                break
            if self._stop.is_set():
                break
            if self.journal.has_pending():
                self.try_flush()

    def wait(self, timeout: float) -> int:
        """Wait (bounded) until the journal is in the store; returns what waits."""
        deadline = time.monotonic() + timeout
        while self.journal.has_pending() and time.monotonic() < deadline:
            self.wake()
            time.sleep(0.05)
        return self.journal.pending_count()

    def close(self, timeout: float) -> int:
        """Flush until done or `timeout`, then stop; returns the entries still waiting."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        left = self.try_flush()
        while left and time.monotonic() < deadline:
            time.sleep(min(retry_s(), max(0.0, deadline - time.monotonic())))
            left = self.try_flush()
        return left
