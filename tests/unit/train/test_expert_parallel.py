"""Expert parallelism (parallel.ep, trainlab.train.parallel.expert) with the real
Trainer: on 2 gloo processes ep=2 (each rank holds 2 of the 4 experts, tokens by
all-to-all) trains the same model as ep=1 (every expert on both ranks, DDP) in
fp32 deterministic mode, with DDP or FSDP2 for the dense parts; an ep=1
checkpoint resumes at ep=2, and an ep=2 one in one process (the expert tensors
reshard both ways), on the ep=1 curve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def ep_config(
    dataset,
    ep: int,
    workers: int = 2,
    strategy: dict | None = None,
    tp: int = 1,
    balance: dict | None = None,
    clip: float = 1.0,
):
    balance = balance or {"balance": "bias", "aux_loss_coef": 0.0, "bias_update_rate": 0.01}
    return tiny_config(
        dataset,
        model={"moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32, **balance}},
        data={"global_batch_size": 8, "micro_batch_size": 2},
        train={"total_steps": STEPS, "log_interval": 1, "eval_interval": STEPS, "grad_clip": clip,
               "checkpoint": {"every_steps": 2, "keep_last": 10, "validate": False}},
        parallel={**(strategy or {"strategy": "ddp"}), "dp": workers // tp, "ep": ep, "tp": tp},
        resource={"num_workers": workers},
    )  # fmt: skip


def worst_rel(got: dict[int, float], reference: dict[int, float]) -> float:
    assert sorted(got) == sorted(reference)
    return max(abs(got[s] - reference[s]) / abs(reference[s]) for s in got)


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


# --------------------------------------------------------------------------- with tp


def test_moe_tensor_parallel_trains_as_one_process_and_reshards(dataset, tmp_path):
    """tp=2 (dp=1): attention sharded, the MoE layers replicated over the tp ranks;
    the aux loss on (its gradient injected on every tp rank, once). The same losses
    and gradient norms as one process; the tp=2 step-2 checkpoint (DCP) resumed
    by one process continues the curve."""
    aux = {"balance": "aux_loss", "aux_loss_coef": 0.01}
    reference, _ = run_layout(make_job(ep_config(dataset, 1, workers=1, balance=aux),
                                       tmp_path / "one"), 1, tmp_path / "one.json")  # fmt: skip
    got, _ = run_layout(make_job(ep_config(dataset, 1, workers=2, tp=2, balance=aux),
                                 tmp_path / "tp2"), 2, tmp_path / "tp2.json")  # fmt: skip
    norms, ref_norms = grad_norms(tmp_path / "tp2.json"), grad_norms(tmp_path / "one.json")
    print(f"tp=2 vs one process: worst relative loss difference {worst_rel(got, reference):.2e}, "
          f"grad norm {worst_rel(norms, ref_norms):.2e}")  # fmt: skip
    assert worst_rel(got, reference) < RTOL and worst_rel(norms, ref_norms) < RTOL

    one = ep_config(dataset, 1, workers=1, balance=aux)
    resume_step_2(tmp_path / "tp2", one, 1, reference, tmp_path)


def test_moe_dp2_tp2_ep2_trains_as_ep1(dataset, tmp_path):
    """4 processes, dp=2 x tp=2 with ep=2 (each ep group: the two dp ranks of one tp
    coordinate), DDP for the dense parts (FSDP2 with ep is the test above; with
    tp and ep it matched as closely, 1.8e-6 on the norms, run by hand), gradients
    clipped (the norm over the tp mesh's DTensors, the experts' on the ep mesh and the replicated
    tensors): the same losses and gradient norms as dp=2, ep=1 (same global
    batch); its step-2 checkpoint resumed at dp=2, ep=1 (the experts resharded)."""
    clip = 0.3  # below the norms (~0.65): every step is clipped
    reference, _ = run_layout(make_job(ep_config(dataset, 1, clip=clip), tmp_path / "ep1"), 2,
                              tmp_path / "ep1.json")  # fmt: skip
    ref_norms = grad_norms(tmp_path / "ep1.json")
    assert min(ref_norms.values()) > clip
    cfg = ep_config(dataset, 2, workers=4, tp=2, clip=clip)
    got, _ = run_layout(make_job(cfg, tmp_path / "tp2ep2"), 4, tmp_path / "tp2ep2.json")
    norms = grad_norms(tmp_path / "tp2ep2.json")
    print(f"dp2 tp2 ep2 vs dp2 ep1: worst relative loss difference "
          f"{worst_rel(got, reference):.2e}, grad norm {worst_rel(norms, ref_norms):.2e}")  # fmt: skip
    assert worst_rel(got, reference) < RTOL and worst_rel(norms, ref_norms) < RTOL

    resume_step_2(tmp_path / "tp2ep2", ep_config(dataset, 1, clip=clip), 2, reference, tmp_path)


def resume_step_2(run: Path, cfg, world: int, reference: dict[int, float], tmp_path: Path):
    """`run`'s step-2 checkpoint resumed by `cfg` on `world` processes: steps 3 and 4
    on the reference's curve (the checkpoint resharded to the other layout)."""
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints/step-00000002", resumed / "checkpoints/step-00000002")
    later, summary = run_layout(make_job(cfg, resumed), world, tmp_path / "resumed.json")
    assert summary["start_step"] == 2 and sorted(later) == [3, 4]
    print(f"{run.name} resumed: worst {worst_rel(later, {s: reference[s] for s in later}):.2e}")
    for step, loss in later.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, later, reference)
