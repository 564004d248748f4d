"""The Trainer is the `Loop` its components are promised (trainlab.train.loop.
protocol): every member the Protocol names exists on a constructed Trainer, with
a value of the declared kind, so a rename on either side fails here rather than
in a user's component mid-run."""

from __future__ import annotations

import inspect
import typing

import pytest

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.train.loop import protocol
from trainlab.train.loop.protocol import Loop
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv


def _members() -> tuple[dict[str, object], set[str]]:
    import trainlab.train.loop.protocol as module

    names = {**vars(module)}
    hints = typing.get_type_hints(Loop, globalns=names, localns=_localns())
    methods = {
        n for n, v in vars(Loop).items()
        if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))
    }  # fmt: skip
    return hints, methods


def _localns() -> dict[str, object]:
    """The names the Protocol's annotations use (imported for type checking only)."""
    import importlib

    where = {
        "nn": "torch.nn", "ckpts": "trainlab.run.checkpoints",
        "ExperimentConfig": "trainlab.config.schema", "TrainJob": "trainlab.train.job",
        "Callback": "trainlab.train.loop.callbacks",
        "Checkpointer": "trainlab.train.loop.checkpointer",
        "Meter": "trainlab.train.loop.metrics", "P0Rules": "trainlab.train.loop.metrics",
        "StepSignals": "trainlab.train.loop.metrics", "TrainState": "trainlab.train.loop.state",
        "StreamLoader": "trainlab.train.loop.stream",
        "DistEnv": "trainlab.train.parallel.distributed", "RunRecords": "trainlab.run.records",
    }  # fmt: skip
    out: dict[str, object] = {}
    for name, module in where.items():
        if name in ("nn", "ckpts"):
            out[name] = importlib.import_module(module)
        else:
            out[name] = getattr(importlib.import_module(module), name)
    return out


def test_the_trainer_has_every_member_of_the_loop_protocol(tmp_path_factory, tmp_path):
    cfg = tiny_config(dataset_dir(tmp_path_factory))
    job = make_job(cfg, tmp_path / "run")
    trainer = Trainer(job, local_loader(job), DistEnv())
    hints, methods = _members()
    assert {"cfg", "env", "checkpointer", "last_signals", "stop_reason"} <= set(hints)
    assert {"step", "model", "request_stop", "evaluate"} <= methods
    for name in methods:
        assert hasattr(trainer, name), name
        if inspect.isfunction(vars(Loop)[name]):
            got = inspect.signature(getattr(Trainer, name))
            want = inspect.signature(vars(Loop)[name])
            assert list(got.parameters) == list(want.parameters), name
    for name, kind in hints.items():
        assert hasattr(trainer, name), f"Loop.{name} is not on the Trainer"
        value = getattr(trainer, name)
        concrete = (
            inspect.isclass(kind)
            and kind is not typing.Any
            and not getattr(kind, "_is_protocol", False)
        )
        # (callbacks: rank 0's Callback, a CallbackList of none elsewhere: duck-typed)
        if concrete and name != "callbacks" and not isinstance(value, kind):
            pytest.fail(f"Loop.{name}: {type(value).__name__}, declared {kind.__name__}")
    assert protocol.__doc__ and "test_loop_protocol.py" in protocol.__doc__
