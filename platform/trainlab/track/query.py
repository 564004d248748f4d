"""Reading runs back out of MLflow: listing, one comparable row per run, curves.

The rows are plain dicts (JSON-ready), shared by `trainlab compare`,
`trainlab runs` and the comparison notebook, so they always agree.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from trainlab.errors import UserError
from trainlab.redact import redact
from trainlab.repeats import experiment_key
from trainlab.track.backend import client_for, embedded_db_path
from trainlab.track.heartbeat import ACTIVE_TAG
from trainlab.track.mlflow_cb import EXTENDED_TAG, TOTAL_STEPS_TAG
from trainlab.track.series import metric_series

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

# Config keys that describe the record, not the experiment: never "differing".
RECORD_KEYS = frozenset({"name", "purpose", "expectation", "owner"})
MIX_PREFIX = "data.mix."
# Config keys holding a local path: `trainlab train` may record them relative to
# the checkout, `submit`/`tune` absolute; the same place is not a difference.
PATH_KEYS = frozenset({"data.path", "train.runs_root", "resource.storage"})
SEARCH_PAGE = 1000
TOTAL_STEPS_KEY = "train.total_steps"
# Among the differences: how a run was extended (`trainlab train --extend`).
EXTENDED_KEY = "extended (--extend)"
ENV_PREFIX = "env."


# --------------------------------------------------------------------------- metric histories


def _values(client: MlflowClient, run_id: str, key: str) -> list[float]:
    return [m.value for m in client.get_metric_history(run_id, key)]


# --------------------------------------------------------------------------- finding runs


def parse_since(text: str | None) -> datetime | None:
    """`--since` as a datetime: an ISO date (2026-05-01) or date and time, local time."""
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(
            f"--since {text!r}: expected a date like 2026-05-01 or 2026-05-01T14:30"
        ) from None
    return when if when.tzinfo else when.astimezone()


def open_store(uri: str) -> MlflowClient | None:
    """A client on `uri`, or None when the embedded store has not been created yet
    (reading must not create an empty database as a side effect)."""
    db = embedded_db_path(uri)
    if db is not None and not db.is_file():
        return None
    return client_for(uri)


def _experiment_ids(client: MlflowClient, experiment: str | None, uri: str) -> list[str]:
    if experiment is None:
        return [e.experiment_id for e in client.search_experiments()]
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        known = sorted(e.name for e in client.search_experiments())
        raise UserError(
            f"--experiment {experiment!r}: no such experiment in {redact(uri)} "
            f"(known: {', '.join(known) or 'none'})"
        )
    return [exp.experiment_id]


def find_runs(
    uri: str,
    names: Sequence[str] = (),
    experiment: str | None = None,
    since: datetime | None = None,
    limit: int | None = None,
) -> list[Run]:
    """trainlab runs in the store, newest first. `names` selects by run name (the
    run directory's), config name or run id; a name that matches nothing is a
    user error."""
    client = open_store(uri)
    if client is None:
        if names:
            raise UserError(
                f"no runs recorded yet in {redact(uri)}: nothing matches {', '.join(names)}"
            )
        return []
    ids = _experiment_ids(client, experiment, uri)
    filters = ["tags.run_key != ''"]
    if since is not None:
        filters.append(f"attributes.start_time >= {int(since.timestamp() * 1000)}")
    # Opening the store (client_for) ended the lost runs: their status is `lost`.
    runs = _search_all(client, ids, " and ".join(filters), None if names else limit)
    if names:
        runs = [r for r in runs if _labels(r) & set(names)]
        found = set().union(*(_labels(r) for r in runs))
        missing = [n for n in names if n not in found]
        if missing:
            where = f" in experiment {experiment!r}" if experiment else ""
            raise UserError(
                f"no run named {', '.join(map(repr, missing))}{where} in {redact(uri)}"
                " (see `trainlab runs`)"
            )
        runs = runs[:limit] if limit else runs
    return runs


def _labels(run: Run) -> set[str]:
    """What selects a run on the command line: its MLflow run name (its run
    directory's, e.g. `tiny-2`), its config's name (`tiny`: every run of it) and
    its run id; a group's id (trainlab.repeats) selects its seeds."""
    labels = {run.info.run_name, run.info.run_id, run.data.params.get("name")}
    labels.add(run.data.tags.get("group_id"))  # a `--repeats` group: all its seeds
    return {label for label in labels if label}


def _search_all(
    client: MlflowClient, ids: list[str], filter_string: str, limit: int | None
) -> list[Run]:
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs(
            ids,
            filter_string=filter_string,
            max_results=min(limit or SEARCH_PAGE, SEARCH_PAGE),
            order_by=["attributes.start_time DESC"],
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token or (limit and len(runs) >= limit):
            return runs[:limit] if limit else runs


# --------------------------------------------------------------------------- rows


def parse_param(text: str) -> Any:
    """Inverse of the callback's param encoding: JSON where it parses, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _iso(ms: int | None) -> str | None:
    return (
        datetime.fromtimestamp(ms / 1000, UTC).astimezone().isoformat(timespec="seconds")
        if ms
        else None
    )


def _status(run: Run) -> str:
    return run.data.tags.get("status") or run.info.status.lower()


def _wall_time_s(run: Run) -> float:
    end = run.info.end_time or int(time.time() * 1000)
    return round((end - run.info.start_time) / 1000, 1)


def run_overview(run: Run, experiment_names: dict[str, str]) -> dict[str, Any]:
    """The cheap fields (no metric histories): for `trainlab runs`."""
    return {
        "name": run.info.run_name,
        "run_id": run.info.run_id,
        "experiment": experiment_names.get(run.info.experiment_id, run.info.experiment_id),
        "status": _status(run),
        "started": _iso(run.info.start_time),
        "duration_s": _wall_time_s(run),
        "active_s": _active_s(run),
        "records_pending": _records_pending(run),
    }


def _records_pending(run: Run) -> int:
    """Records of the run still waiting in its journal for the store (opening the
    store wrote what it could; a live run's own flusher may hold the rest)."""
    from trainlab.track.journal import Journal

    run_dir = run.data.tags.get("run_dir")
    if not run_dir:
        return 0
    try:
        return Journal(run_dir).pending_count()
    except OSError:
        return 0


def _active_s(run: Run) -> float | None:
    """Time the run's training processes ran, summed over its starts (a resumed
    run's wall time also counts the idle time between them)."""
    try:
        return round(float(run.data.tags[ACTIVE_TAG]), 1)
    except (KeyError, ValueError):
        return None


def run_row(client: MlflowClient, run: Run, experiment_names: dict[str, str]) -> dict[str, Any]:
    """One comparable row: overview, headline results, mix and the flattened params."""
    params = {k: parse_param(v) for k, v in sorted(run.data.params.items())}
    total_steps = _total_steps(run, params)
    if total_steps is not None:  # an extended run's real length (its params keep the first)
        params[TOTAL_STEPS_KEY] = total_steps
    metrics = run.data.metrics
    rid = run.info.run_id
    val = client.get_metric_history(rid, "val_loss/all") if "val_loss/all" in metrics else []
    tps = _values(client, rid, "tokens_per_s") if "tokens_per_s" in metrics else []
    mem = _values(client, rid, "mem_peak_gb") if "mem_peak_gb" in metrics else []
    row = run_overview(run, experiment_names)
    row.pop("duration_s")
    final_step = _final_step(run, "loss")
    per_step = params.get("plan.tokens_per_step")
    row |= {
        "final_step": final_step,
        "total_steps": total_steps,
        # Tokens trained: the steps logged times the plan's tokens per step.
        "tokens_trained": (
            final_step * per_step if final_step is not None and isinstance(per_step, int) else None
        ),
        # `trainlab train --extend`: each extension of the run (trainlab.track.mlflow_cb).
        "extended": run.data.tags.get(EXTENDED_TAG) or None,
        "final_loss": metrics.get("loss"),
        # One definition everywhere (checkpoint lines, run_summary.json, runs, compare):
        # val_loss is the held-out evaluation at a step (here the latest one),
        # best_val_loss the lowest of the run's evaluations.
        "val_loss": max(val, key=lambda m: m.step).value if val else None,
        "best_val_loss": min(m.value for m in val) if val else None,
        "tokens_per_second": statistics.median(tps) if tps else None,
        "peak_memory_gb": max(mem) if mem else None,
        "wall_time_s": _wall_time_s(run),
        "mix": {
            k.removeprefix(MIX_PREFIX): v for k, v in params.items() if k.startswith(MIX_PREFIX)
        },
        "config_hash": run.data.tags.get("config_hash"),
        "dataset_fingerprint": run.data.tags.get("dataset_fingerprint"),
        "git_commit": run.data.tags.get("git_commit"),
        "group_id": run.data.tags.get("group_id"),
        "experiment_key": experiment_key(params),
        # What it ran with (trainlab.envlock: the `env.*` tags).
        "environment": {
            k.removeprefix(ENV_PREFIX): v
            for k, v in sorted(run.data.tags.items())
            if k.startswith(ENV_PREFIX)
        },
        "params": params,
    }
    return row


def _total_steps(run: Run, params: dict[str, Any]) -> int | None:
    """The length the run trains to: its `total_steps` tag (set at every start, so
    an --extend shows), else the param it started with."""
    tag = run.data.tags.get(TOTAL_STEPS_TAG)
    if tag is not None and tag.isdigit():
        return int(tag)
    value = params.get(TOTAL_STEPS_KEY)
    return value if isinstance(value, int) else None


def _final_step(run: Run, key: str) -> int | None:
    for m in run.data._metric_objs:
        if m.key == key:
            return m.step
    return None


def normalized(key: str, value: Any) -> Any:
    """A path-valued key's value as an absolute path (relative ones are taken
    from the current directory: the checkout, where trainlab runs)."""
    if key in PATH_KEYS and isinstance(value, str) and value and "://" not in value:
        return os.path.abspath(value)
    return value


def differing_keys(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Config keys whose value differs between the rows (a key missing from some
    row counts as differing unless the others hold null there); record fields such
    as `purpose` are left out."""
    rows = list(rows)
    if len(rows) < 2:
        return []
    keys = sorted(set().union(*(r["params"] for r in rows)) - RECORD_KEYS)

    def value(row: dict[str, Any], key: str) -> str:
        # A key a run's config did not have yet (recorded before the key existed) is
        # the same as one set to null (`model.moe: null`): nothing to show apart.
        return json.dumps(normalized(key, row["params"].get(key)), sort_keys=True)

    return [k for k in keys if len({value(r, k) for r in rows}) > 1]


def compare_runs(
    uri: str,
    names: Sequence[str] = (),
    experiment: str | None = None,
    since: datetime | None = None,
) -> list[dict[str, Any]]:
    """One row per run, newest first; each row's `differing` holds its values of
    the config keys that differ between the rows."""
    runs = find_runs(uri, names, experiment, since)
    if not runs:
        return []
    client = client_for(uri)
    exp_names = {e.experiment_id: e.name for e in client.search_experiments()}
    rows = [run_row(client, r, exp_names) for r in runs]
    keys = differing_keys(rows)
    env_keys = differing_environment(rows)
    # An extension differs like a config key (its length is train.total_steps).
    extended = len(rows) > 1 and len({r["extended"] for r in rows}) > 1
    for row in rows:
        row["differing"] = {k: row["params"].get(k) for k in keys}
        if extended:
            row["differing"][EXTENDED_KEY] = row["extended"]
        row["environment_differing"] = {k: row["environment"].get(k) for k in env_keys}
    return rows


# Environment keys that differ between any two runs by design, never "differing".
ENV_NOT_COMPARED = frozenset({"git_commit", "git_dirty", "nodes"})


def differing_environment(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Environment keys (python, torch, lock_sha256, accelerator, ...) whose value
    differs between the rows, like `differing_keys` for the config; the code
    version is compare's own column (git_commit), not an environment difference."""
    rows = list(rows)
    if len(rows) < 2:
        return []
    keys = sorted(set().union(*(r["environment"] for r in rows)) - ENV_NOT_COMPARED)
    return [k for k in keys if len({r["environment"].get(k) for r in rows}) > 1]


def compare_report(
    uri: str,
    names: Sequence[str] = (),
    experiment: str | None = None,
    since: datetime | None = None,
) -> dict[str, Any]:
    """`trainlab compare --json`: {"runs": compare_runs' rows, "groups": each
    group's bands per metric (mean, std, n), "comparisons": every other run or
    group against the oldest (difference, interval, verdict: trainlab.track.noise)}."""
    from trainlab.track.noise import noise_report, units

    rows = compare_runs(uri, names, experiment, since)
    us = units(rows)
    singles = [u for u in us if not u["group_id"]]
    # Two single runs borrow the band of a recorded group of their experiment.
    recorded = recorded_groups(uri) if rows and len(singles) >= 2 else {}
    return {"runs": rows, **noise_report(rows, recorded)}


def recorded_groups(uri: str) -> dict[str, dict[str, Any]]:
    """The store's groups by experiment key (the one with most seeds, then newest)."""
    from trainlab.track.noise import group_summary, units

    client = client_for(uri)
    exp_names = {e.experiment_id: e.name for e in client.search_experiments()}
    ids = list(exp_names)
    members = _search_all(client, ids, "tags.group_id != '' and tags.run_key != ''", None)
    rows = [run_row(client, r, exp_names) for r in members]
    best: dict[str, dict[str, Any]] = {}
    for unit in units(rows):
        g = group_summary(unit)
        key = g["experiment_key"]
        if key not in best or g["n"] > best[key]["n"]:
            best[key] = g
    return best


def list_runs(
    uri: str, experiment: str | None = None, since: datetime | None = None, limit: int = 20
) -> list[dict[str, Any]]:
    """Recent runs, newest first: name, status, started, duration."""
    runs = find_runs(uri, (), experiment, since, limit)
    if not runs:
        return []
    client = client_for(uri)
    exp_names = {e.experiment_id: e.name for e in client.search_experiments()}
    return [run_overview(r, exp_names) for r in runs]


def run_curves(
    uri: str,
    run_ids: Sequence[str],
    prefixes: Sequence[str] = ("loss", "val_loss/", "share/"),
) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Metric curves of several runs: {run_id: {metric: [(step, value), ...]}}."""
    client = client_for(uri)
    return {run_id: metric_series(client, run_id, prefixes) for run_id in run_ids}
