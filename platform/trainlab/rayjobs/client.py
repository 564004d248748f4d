"""Talking to a cluster's job server: address, list, stop, follow.

The address of the Jobs API (the dashboard, e.g. http://127.0.0.1:8265) comes
from, in order: `--address`, `RAY_API_SERVER_ADDRESS`, `RAY_ADDRESS` when it is
an http(s) URL, and the cluster started by `trainlab cluster up`.

Ray 2.60 clusters require a token. We send it ourselves as a bearer header
(`trainlab.rayjobs.auth`), so the client works without the caller having to
export `RAY_AUTH_MODE=token`. Never in clear to another machine: with a token,
a plain `http://` address that is not loopback is refused unless the caller
passes `allow_plain_http` (`--allow-plain-http`), and then warned about; use
`https://` (a TLS proxy in front of the dashboard) or an SSH tunnel to
127.0.0.1 instead (docs/security.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from trainlab.errors import UserError, first_line
from trainlab.rayjobs.auth import auth_headers
from trainlab.rayjobs.localcluster import read_state

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- address


def resolve_address(address: str | None = None) -> str:
    """The Jobs API URL to use; UserError when none is known."""
    if not address:
        address = os.environ.get("RAY_API_SERVER_ADDRESS") or None
    if not address:
        env = os.environ.get("RAY_ADDRESS", "")
        address = env if env.startswith(("http://", "https://")) else None
    if not address:
        state = read_state()
        address = state.dashboard_url if state else None
    if not address:
        raise UserError(
            "no Ray cluster given: start one with `trainlab cluster up` (its Jobs API "
            "is http://127.0.0.1:8290), or pass --address http://HOST:PORT (8265 for a "
            "cluster from `ray start`), or set RAY_API_SERVER_ADDRESS"
        )
    if address.startswith("ray://"):
        raise UserError(
            f"--address {address}: give the dashboard URL (http://HOST:PORT: 8290 for "
            "`trainlab cluster up`, 8265 for `ray start`), "
            "not a Ray Client address"
        )
    if "://" not in address:
        address = f"http://{address}"
    return address.rstrip("/")


@contextlib.contextmanager
def _only_this_address(url: str) -> Iterator[None]:
    """Ray's client lets RAY_API_SERVER_ADDRESS/RAY_ADDRESS override the address it is
    given; pin it to ours while the client is built."""
    saved = {k: os.environ.get(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")}
    os.environ["RAY_API_SERVER_ADDRESS"] = url
    os.environ.pop("RAY_ADDRESS", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def is_loopback(host: str) -> bool:
    """True for localhost and 127.0.0.0/8, ::1."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plain_http_problem(url: str, has_token: bool) -> str | None:
    """Why sending the cluster's token to `url` would expose it (plain HTTP to a
    host that is not this machine), or None."""
    parts = urlsplit(url)
    if not has_token or parts.scheme != "http" or is_loopback(parts.hostname or ""):
        return None
    return (
        f"--address {url}: the cluster's auth token would travel in clear text (plain "
        "http:// to another machine); use https:// (a TLS proxy in front of the "
        "dashboard) or an SSH tunnel to 127.0.0.1, or pass --allow-plain-http on a "
        "network you trust"
    )


def connect(address: str | None = None, *, allow_plain_http: bool = False) -> Any:
    """A `JobSubmissionClient` for the cluster; UserError when it cannot be reached,
    or when the token would go over plain HTTP to another machine (unless
    `allow_plain_http`, then a warning)."""
    url = resolve_address(address)
    headers = auth_headers()
    problem = plain_http_problem(url, bool(headers))
    if problem and not allow_plain_http:
        raise UserError(problem)
    if problem:
        log.warning("warning: sending the cluster's auth token over plain HTTP to %s", url)
    from ray.job_submission import JobSubmissionClient

    # Ray's client logs every package it zips and uploads at INFO; trainlab says
    # what it does itself.
    for name in ("ray._private.runtime_env.packaging", "ray.dashboard.modules.dashboard_sdk"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        with _only_this_address(url):
            return JobSubmissionClient(url, headers=headers)
    except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError, auth errors
        raise UserError(f"cannot reach the Ray cluster at {url}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    if "Missing authentication token" in text or "401" in text.split("\n", 1)[0]:
        return (
            "the cluster requires a token: set RAY_AUTH_TOKEN or put it in "
            "~/.ray/auth_token (`ray get-auth-token` on the head node prints it)"
        )
    return first_line(e)


# --------------------------------------------------------------------------- jobs


@dataclass
class JobRow:
    job_id: str
    status: str
    name: str
    kind: str
    start_time: float | None
    end_time: float | None
    entrypoint: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "status": self.status,
            "name": self.name,
            "kind": self.kind,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "duration_s": self.duration_s,
            "entrypoint": self.entrypoint,
            "message": self.message,
        }

    @property
    def duration_s(self) -> float | None:
        if self.start_time is None:
            return None
        end = self.end_time or time.time()
        return round(end - self.start_time, 1)


def _seconds(ms: int | None) -> float | None:
    return ms / 1000.0 if ms else None


def list_jobs(client: Any) -> list[JobRow]:
    """Every job the cluster knows, newest first."""
    rows = []
    for info in client.list_jobs():
        meta = info.metadata or {}
        rows.append(
            JobRow(
                job_id=info.submission_id or info.job_id or "?",
                status=str(getattr(info.status, "value", info.status)),
                name=meta.get("trainlab_name", ""),
                kind=meta.get("trainlab_kind", ""),
                start_time=_seconds(info.start_time),
                end_time=_seconds(info.end_time),
                entrypoint=info.entrypoint,
                message=(info.message or "").strip().splitlines()[0] if info.message else "",
            )
        )
    rows.sort(key=lambda r: r.start_time or 0.0, reverse=True)
    return rows


def job_info(client: Any, job_id: str) -> Any:
    try:
        return client.get_job_info(job_id)
    except RuntimeError as e:
        if "does not exist" in str(e) or "404" in str(e):
            raise UserError(
                f"job {job_id}: no such job on this cluster (`trainlab jobs` lists them)"
            ) from None
        raise


def stop_job(client: Any, job_id: str, wait_s: float = 30.0) -> str:
    """Ask the cluster to stop a job; wait until it is terminal; return its status."""
    info = job_info(client, job_id)
    status = str(getattr(info.status, "value", info.status))
    if status in TERMINAL:
        return status
    client.stop_job(job_id)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = str(getattr(client.get_job_status(job_id), "value", ""))
        if status in TERMINAL:
            return status
        time.sleep(0.5)
    return status


def wait_for(client: Any, job_id: str, timeout_s: float | None = None, poll_s: float = 1.0) -> Any:
    """Block until the job is terminal; return its JobInfo."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        info = client.get_job_info(job_id)
        if str(getattr(info.status, "value", info.status)) in TERMINAL:
            return info
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {info.status} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def follow(client: Any, job_id: str, write: Callable[[str], None]) -> Any:
    """Stream the job's logs to `write` until it ends; return its final JobInfo.

    Logs come over Ray's websocket tail; if that connection drops, the rest is
    fetched by polling, so a network hiccup never loses the job's outcome."""
    import asyncio

    # Ray logs an INFO line for every closed websocket; not news for our users.
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
    shown = 0

    async def tail() -> None:
        nonlocal shown
        async for chunk in client.tail_job_logs(job_id):
            write(chunk)
            shown += len(chunk)

    with contextlib.suppress(Exception):  # a dropped websocket: poll below
        asyncio.run(tail())
    while True:
        info = client.get_job_info(job_id)
        done = str(getattr(info.status, "value", info.status)) in TERMINAL
        logs = client.get_job_logs(job_id)
        if len(logs) > shown:
            write(logs[shown:])
            shown = len(logs)
        if done:
            return info
        time.sleep(1.0)
