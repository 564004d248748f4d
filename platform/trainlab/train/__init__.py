"""The execution layer: runs what the config and plan say on Ray Train.

`run(cfg, ...)` is the one entry point (the CLI, trainers/pretrain.py and the
demo call it); see trainlab.train.launcher. Importing this package stays
light: torch and Ray load only when a run starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainlab.train.launcher import TrainingFailed


def run(cfg: Any, **kwargs: Any) -> dict[str, Any]:
    """Train `cfg` on Ray Train and return its run summary (see launcher.run)."""
    from trainlab.train.launcher import run as _run

    return _run(cfg, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "TrainingFailed":
        from trainlab.train.launcher import TrainingFailed

        return TrainingFailed
    raise AttributeError(name)


__all__ = ["TrainingFailed", "run"]
