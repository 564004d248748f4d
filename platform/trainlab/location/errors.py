"""What a read or write of storage that did not succeed means: its kind.

- *absent*: the object or file is not there;
- *corrupt*: it is there and does not parse or match its checksum;
- *unavailable*: timeouts, 5xx, throttling, refused connections: it may well be
  there, and a later try may succeed;
- *refused*: the storage answered and will not take it (a full disk, a
  read-only mount, no permission): trying again at once does not help.

Only absent or corrupt may make a checkpoint invalid; nothing is ever deleted on
a read that did not succeed. `read_retrying` retries an unavailable read with
backoff, as S3 clients do, then raises `StoreUnavailable` (exit 74).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from trainlab.errors import UserError, first_line
from trainlab.exitcodes import STORAGE_FAULT

log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageError(OSError):
    """A read or write of storage that did not succeed, with its kind."""

    kind = "unavailable"


class Absent(StorageError, FileNotFoundError):
    """The object or file is not there (also a FileNotFoundError)."""

    kind = "absent"


class Corrupt(StorageError):
    """It is there, and does not parse or does not match its checksum."""

    kind = "corrupt"


class Unavailable(StorageError):
    """Storage did not answer as it should (timeout, 5xx, throttling, a refused
    connection): the object may well be there."""

    kind = "unavailable"


class Refused(StorageError):
    """The storage answered and will not take it: no space, read-only, no permission."""

    kind = "refused"


class Conflict(StorageError):
    """A conditional write found the object at another version than expected (or
    present where it was to be created): someone else wrote it first."""

    kind = "conflict"


REFUSED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class StoreUnavailable(UserError):
    """Storage stayed unavailable through every retry: the command stops, nothing
    was changed (exit 74, the storage code; run it again when the store answers)."""

    exit_code = STORAGE_FAULT


# How pyarrow's filesystems (and the SDKs below them) say "not there".
_ABSENT_MARKS = ("path does not exist", "nosuchkey", "no such key", "not found", "404",
                 "no such file", "does not exist", "nosuchbucket")  # fmt: skip


def storage_error(err: BaseException, what: str) -> StorageError:
    """`err`, raised while reading or writing `what`, as a storage error of its kind."""
    if isinstance(err, StorageError):
        return err
    text = first_line(str(err)) or type(err).__name__
    if isinstance(err, FileNotFoundError | NotADirectoryError):
        return Absent(f"{what}: not there")
    if isinstance(err, OSError) and err.errno in REFUSED_ERRNOS:
        reason = err.strerror or text
        return Refused(err.errno, f"{what}: {reason[:1].lower()}{reason[1:]}")
    if isinstance(err, ValueError | UnicodeDecodeError | json.JSONDecodeError):
        return Corrupt(f"{what}: {text}")
    lowered = text.lower()
    if isinstance(err, OSError) and any(m in lowered for m in _ABSENT_MARKS):
        return Absent(f"{what}: not there ({text})")
    return Unavailable(f"{what}: {text}")


# Errors of a write that the storage will not take whoever retries it.
_DISK_FAULTS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def refused_write(err: BaseException) -> str | None:
    """A command's one line for a write its storage refused (a full disk, a
    read-only mount, a quota, a failing disk: exit 74, trainlab.exitcodes), or None
    for any other error. `Refused` says what it was writing; a bare OSError its file."""
    if isinstance(err, Refused):
        return f"storage refused a write: {err.strerror or err}"
    if isinstance(err, OSError) and err.errno in _DISK_FAULTS and not isinstance(err, StorageError):
        reason = os.strerror(err.errno)
        where = f"{err.filename}: " if err.filename else ""
        return f"storage refused a write: {where}{reason[:1].lower()}{reason[1:]}"
    return None


# Retries of an unavailable read: delays in seconds (about 30 s in all), or
# TRAINLAB_STORE_RETRY_S seconds in all when set (tests shorten it).
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)


# A shorter budget for what a person waits on (a Ctrl-C's stop): `retry_budget`.
_BUDGET_S: float | None = None


@contextlib.contextmanager
def retry_budget(seconds: float) -> Iterator[None]:
    """Within: retries of unavailable storage take at most `seconds` in all (a
    Ctrl-C in a store outage stops in seconds, not after every retry)."""
    global _BUDGET_S
    saved, _BUDGET_S = _BUDGET_S, seconds
    try:
        yield
    finally:
        _BUDGET_S = saved


def _retry_delays() -> tuple[float, ...]:
    total = os.environ.get("TRAINLAB_STORE_RETRY_S")
    budget = float(total) if total is not None else sum(RETRY_DELAYS)
    if _BUDGET_S is not None:
        budget = min(budget, _BUDGET_S)
    if budget == sum(RETRY_DELAYS):
        return RETRY_DELAYS
    scale = budget / sum(RETRY_DELAYS)
    return tuple(d * scale for d in RETRY_DELAYS)


def read_retrying(read: Callable[[], T], what: str) -> T:
    """`read()` (or a write), retried with backoff while storage is unavailable;
    any other kind raises at once (`Absent`, `Corrupt`, `Refused`), and storage that
    stays unavailable raises `StoreUnavailable` naming what could not be done."""
    delays = _retry_delays()
    # Under a `retry_budget` the tries themselves count too (an SDK retries inside
    # each): none starts after the budget is spent.
    deadline = time.monotonic() + _BUDGET_S if _BUDGET_S is not None else None
    for attempt in range(len(delays) + 1):
        try:
            return read()
        except Exception as err:  # noqa: BLE001 - classified below
            kind = storage_error(err, what)
            if not isinstance(kind, Unavailable):
                raise kind from err
            spent = (
                deadline is not None and time.monotonic() + delays[attempt % len(delays)] > deadline
            )
            if attempt == len(delays) or spent:
                raise StoreUnavailable(
                    f"{kind}: storage unavailable through {attempt + 1} tries over "
                    f"{sum(delays):.0f} s; nothing was changed: run the command again when "
                    "it answers"
                ) from err
            log.warning("%s (try %d; retrying in %.1f s)", kind, attempt + 1, delays[attempt])
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")
