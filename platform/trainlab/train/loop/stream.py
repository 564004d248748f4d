"""The worker side of the training stream, as the loop sees it (declared once:
the agent's pipe protocol derives its loader calls from it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainlab.data.pack import Batch


class StreamLoader(Protocol):
    """The worker side of the training stream (docs/contracts.md, section 3)."""

    def iter_from(self, step: int) -> Iterator[tuple[int, list[Batch]]]: ...
    def validation_batches(self, source: str, n: int) -> list[Batch]: ...
    def delivered_shares(self, step: int) -> dict[str, float]: ...
    def state_dict(self, step: int | None = None) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# The calls a training process makes of its agent's loader, one round trip each
# (`iter_from` is the stream itself: its own requests, with prefetching).
LOADER_CALLS: tuple[str, ...] = tuple(
    name for name in vars(StreamLoader) if not name.startswith("_") and name != "iter_from"
)
