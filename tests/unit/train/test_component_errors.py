"""A bug in a user's component (train.components) ends the run instead of being
restarted max_failures times (issue 38, item 11): its hooks are guarded, a
programming error becomes a ComponentError naming the factory, the component, the
hook and the step; errors a restart may get past (an OSError, a RuntimeError of
a collective) pass through unchanged."""

from __future__ import annotations

import pytest

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.train.loop.components import Component, ComponentError, build_components
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv

FACTORY = f"{__name__}:components"


class Probe(Component):
    """A user's component with a bug at step 2 (or another error, by `raise_`)."""

    raise_: type[BaseException] | None = None

    def __init__(self) -> None:
        self.seen: list[int] = []

    def after_step(self, loop, step):
        self.seen.append(step)
        if step == 2:
            if self.raise_ is not None:
                raise self.raise_("flaky")
            return step + "2"  # TypeError: the bug


def components(cfg):
    return [Probe()]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def test_a_bug_in_a_hook_is_a_component_error_naming_where(dataset, tmp_path):
    cfg = tiny_config(dataset, train={"total_steps": 6, "components": [FACTORY]})
    job = make_job(cfg, tmp_path / "run")
    trainer = Trainer(job, local_loader(job), DistEnv())
    [probe] = [c for c in trainer.components if isinstance(c, Probe)]  # still its class
    with pytest.raises(ComponentError) as raised:
        trainer.fit()
    assert str(raised.value) == (
        f"train.components {FACTORY!r}: Probe.after_step at step 2 raised TypeError: "
        "unsupported operand type(s) for +: 'int' and 'str'"
    )
    assert probe.seen == [1, 2] and trainer.step == 2


@pytest.mark.parametrize("error", [OSError, RuntimeError, KeyboardInterrupt])
def test_errors_a_restart_may_get_past_pass_through(error):
    [probe] = build_components([FACTORY], cfg=None)
    probe.raise_ = error

    class Loop:
        step = 2

    probe.after_step(Loop(), 1)
    with pytest.raises(error):
        probe.after_step(Loop(), 2)
