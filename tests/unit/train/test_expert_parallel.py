"""Expert parallelism (parallel.ep, trainlab.train.parallel.expert) with the real
Trainer: on 2 gloo processes ep=2 (each rank holds 2 of the 4 experts, tokens by
all-to-all) trains the same model as ep=1 (every expert on both ranks, DDP) in
fp32 deterministic mode, with DDP or FSDP2 for the dense parts; an ep=1
checkpoint resumes at ep=2, and an ep=2 one in one process (the expert tensors
reshard both ways), on the ep=1 curve."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from tests.unit.train.layout_runner import Losses, grad_norms, run_layout
from trainlab.run.records import RunRecords
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv

STEPS = 4
# fp32; the layouts differ in float summation order only: the experts' rows of
# both ranks meet in one batched matmul at ep=2, their gradients are summed by
# the all-to-all's backward instead of DDP's all-reduce (measured: 3e-8 worst).
RTOL = 1e-5


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def ep_config(dataset, ep: int, workers: int = 2, strategy: dict | None = None):
    return tiny_config(
        dataset,
        model={"moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32,
                       "balance": "bias", "aux_loss_coef": 0.0, "bias_update_rate": 0.01}},
        data={"global_batch_size": 8, "micro_batch_size": 2},
        train={"total_steps": STEPS, "log_interval": 1, "eval_interval": STEPS,
               "checkpoint": {"every_steps": 2, "keep_last": 10, "validate": False}},
        parallel={**(strategy or {"strategy": "ddp"}), "dp": workers, "ep": ep},
        resource={"num_workers": workers},
    )  # fmt: skip


def test_ep2_trains_as_ep1_and_reshards_to_one_process(dataset, tmp_path):
    reference, _ = run_layout(
        make_job(ep_config(dataset, 1), tmp_path / "ep1"), 2, tmp_path / "ep1.json"
    )
    assert reference[STEPS] < reference[1]
    got, summary = run_layout(make_job(ep_config(dataset, 2), tmp_path / "ep2"), 2,
                              tmp_path / "ep2.json")  # fmt: skip
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
    print(f"ep=2 vs ep=1: worst relative loss difference {worst:.2e}")
    assert sorted(got) == sorted(reference)
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, got, reference)
    # the experts' gradients too (Adam would hide a wrong scale in the loss): the
    # global norm counts every expert once, at the same mean-over-tokens scale
    norms, ref_norms = grad_norms(tmp_path / "ep2.json"), grad_norms(tmp_path / "ep1.json")
    for step, norm in norms.items():
        assert norm == pytest.approx(ref_norms[step], rel=RTOL), (step, norms, ref_norms)

    # FSDP2 (ZeRO-3) for the dense parts with ep=2: the same curve
    fsdp = {"strategy": "fsdp", "zero_stage": 3}
    sharded, _ = run_layout(make_job(ep_config(dataset, 2, strategy=fsdp), tmp_path / "fsdp"), 2,
                            tmp_path / "fsdp.json")  # fmt: skip
    for step, loss in sharded.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, sharded, reference)
    for step, norm in grad_norms(tmp_path / "fsdp.json").items():
        assert norm == pytest.approx(ref_norms[step], rel=RTOL), (step, norm, ref_norms)
    worst_fsdp = max(abs(sharded[s] - reference[s]) / abs(reference[s]) for s in reference)
    print(f"ep=2 + FSDP vs ep=1: worst relative loss difference {worst_fsdp:.2e}")

    # ep=1's step-2 checkpoint (plain expert tensors) resumed at ep=2: resharded, and
    # the optimizer keeps the kernel it was built with (not ep=1's fused AdamW)
    into_ep2 = tmp_path / "into-ep2"
    (into_ep2 / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "ep1/checkpoints/step-00000002",
                    into_ep2 / "checkpoints/step-00000002")  # fmt: skip
    later, summary = run_layout(make_job(ep_config(dataset, 2), into_ep2), 2,
                                tmp_path / "into-ep2.json")  # fmt: skip
    assert summary["start_step"] == 2 and sorted(later) == [3, 4]
    for step, loss in later.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, later, reference)

    # ep=2's step-2 checkpoint (experts sharded over 2 ranks) into one process
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "ep2/checkpoints/step-00000002",
                    resumed / "checkpoints/step-00000002")  # fmt: skip
    job = make_job(ep_config(dataset, 1, workers=1), resumed)
    seen = Losses(str(tmp_path / "one.losses.json"), None)
    trainer = Trainer(job, local_loader(job), DistEnv(), seen)
    trainer.fit()
    assert trainer.start_step == 2 and sorted(seen.losses) == [3, 4]
    # the layout records name ep: the checkpoint's, and the attempt that resharded it
    meta = json.loads((tmp_path / "ep2/checkpoints/step-00000002/checkpoint.json").read_text())
    assert meta["layout"]["ep"] == 2
    (attempt,) = RunRecords(resumed).attempts()
    assert attempt["resharded_from"]["ep"] == 2 and "ep" not in attempt["layout"]
    for step, loss in seen.losses.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, seen.losses, reference)
