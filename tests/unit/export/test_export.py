"""`trainlab export`: real checkpoints of a few training steps of each
architecture (one process, and FSDP over 2 gloo processes for the sharded DCP
format) exported and loaded back with transformers' Auto classes; the logits on
real unpacked text must equal trainlab's own in fp32, and `generate` must run."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from tokenizers import Tokenizer

import trainlab.models.attention as attention_pkg
from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from tests.unit.notebooks.real_store import real_store
from trainlab.cli import main as cli_main
from trainlab.config.loader import to_yaml, validate_raw
from trainlab.export.exporter import export_model, parse_size
from trainlab.export.hf import refusals
from trainlab.train.loop.checkpointer import load_weights_on_cpu
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv

transformers = pytest.importorskip("transformers")

TEXT = (
    "def read_config(path):\n"
    '    """Return the parsed configuration file at path."""\n'
    "    with open(path) as f:\n"
    "        return json.load(f)\n"
)
STEPS = {"total_steps": 4, "checkpoint": {"every_steps": 4}}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def train_run(dataset: Path, run_dir: Path, callbacks=None, train=None, **sections) -> Path:
    """A real run directory ({runs_root}/{date}/{name}) after a few steps in process."""
    cfg = tiny_config(dataset, train={**STEPS, **(train or {})}, **sections)
    job = make_job(cfg, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(job.cfg))
    Trainer(job, local_loader(job), DistEnv(), callbacks).fit()
    return run_dir


def assert_same_model(out: Path, result: dict) -> None:
    """transformers loads `out` and computes trainlab's logits; generate runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(hf_model).__name__ == result["hf_class"]
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    run_cfg = validate_raw(yaml.safe_load((Path(result["run_dir"]) / "config.yaml").read_text()))
    ours_tok = Tokenizer.from_file(str(Path(run_cfg.data.path) / "tokenizer.json"))
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids[0].tolist() == ours_tok.encode(TEXT).ids  # the ids trained on
    ours = load_weights_on_cpu(Path(result["checkpoint"]), run_cfg)
    with torch.no_grad():
        expected = ours(ids)
        got = hf_model(ids).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4
    generated = hf_model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert generated.shape == (1, ids.shape[1] + 4)
    assert generated[0, ids.shape[1]].item() == expected[0, -1].argmax().item()  # greedy


@pytest.mark.parametrize(
    "arch, model, shard",
    [
        ("gpt2", {"num_kv_heads": 4}, "60KB"),  # tied; fused c_attn; sharded + index
        ("llama", {"tie_embeddings": False}, "5GB"),  # GQA, untied lm_head, one file
        ("llama_qknorm", {}, "5GB"),  # -> Qwen3ForCausalLM
        ("hf:llama", {"tie_embeddings": False}, "5GB"),  # a transformers family: save_pretrained
        ("hf:qwen3_moe", {"ffn_hidden_size": 32,  # an MoE family, experts as 3-D tensors
                          "options": {"num_experts": 4, "num_experts_per_tok": 2}}, "5GB"),
        # trainlab's MoE family (model.moe) -> MixtralForCausalLM, Qwen3MoeForCausalLM
        ("llama", {"moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32}}, "5GB"),
        ("llama_qknorm", {"moe": {"num_experts": 4, "top_k": 2, "first_dense_layers": 1,
                                  "router": {"normalize_top_k": False}}}, "5GB"),
    ],
)
def test_round_trip_through_transformers(dataset, tmp_path, arch, model, shard):
    name = arch.replace(":", "-")
    run = train_run(dataset, tmp_path / "runs" / "2026-01-02" / name, model={"arch": arch, **model})
    out = tmp_path / "hf"
    result = export_model(run, out, max_shard_bytes=parse_size(shard))
    assert result["step"] == 4 and result["checkpoint_format"] == "dcp"  # every layout's
    assert result["mlflow_run_id"] is None  # this run has no MLflow record
    names = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "export.json"} <= names
    if shard == "60KB":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert "lm_head.weight" not in index["weight_map"]  # tied
    else:
        assert "model.safetensors" in names
    assert_same_model(out, result)
    if arch == "llama":
        check_bf16_export(run, tmp_path / "hf-bf16")


def run_config(run: Path):
    return validate_raw(yaml.safe_load((run / "config.yaml").read_text()))


def check_bf16_export(run: Path, out: Path) -> None:
    """--dtype bf16: the weights are trainlab's rounded to bf16, and the config says so."""
    from safetensors import safe_open

    export_model(run, out, dtype="bf16", track=False)
    with safe_open(out / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ours = load_weights_on_cpu(run / "checkpoints/step-00000004", run_config(run)).state_dict()
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, ours["layers.0.attn.q.weight"].to(torch.bfloat16))


# --------------------------------------------------------------------------- FSDP


def _fsdp_worker(rank: int, world: int, port: int, dataset: str, run_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = tiny_config(
            Path(dataset),
            model={"arch": "llama_qknorm"},
            train=STEPS,
            parallel={"strategy": "fsdp", "zero_stage": 3},
            resource={"num_workers": world},
        )
        job = make_job(cfg, Path(run_dir))
        if rank == 0:
            (Path(run_dir) / "config.yaml").write_text(to_yaml(job.cfg))
        from trainlab.data import WorkerLoader

        loader = WorkerLoader(job.data_spec, rank, world, backend="local")
        env = DistEnv(rank, world, 0, torch.device("cpu"))
        Trainer(job, loader, env, None).fit()
        # Both ranks leave together: once, in CI, rank 1 tore its process group down
        # while rank 0 was still finishing and died of SIGABRT ("terminate called
        # without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp_sharded_checkpoint_round_trips(dataset, tmp_path):
    """FSDP (ZeRO-3) on 2 processes saves sharded DCP; the export reads it tensor by
    tensor without a process group and loads identically in transformers."""
    run = tmp_path / "runs" / "2026-01-02" / "fsdp"
    run.mkdir(parents=True)
    mp.spawn(_fsdp_worker, args=(2, _free_port(), str(dataset), str(run)), nprocs=2, join=True)
    assert (run / "checkpoints/step-00000004/state/.metadata").exists()
    out = tmp_path / "hf"
    result = export_model(run, out, track=False)
    assert result["checkpoint_format"] == "dcp" and result["hf_class"] == "Qwen3ForCausalLM"
    assert_same_model(out, result)


# --------------------------------------------------------------------------- refusals, CLI, MLflow


def tempered_attention(q, k, v, mask, dropout):
    """A custom variant: softmax at temperature 2 (no transformers class has it)."""
    dense = None if mask.is_plain_causal else mask.dense()
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense, is_causal=dense is None, scale=0.5 / q.shape[-1] ** 0.5,
        enable_gqa=True,
    )


def test_what_transformers_cannot_represent_is_refused_by_name(dataset, tmp_path, capsys,
                                                              monkeypatch):
    # a real run with a registered custom variant (in a copy of the registry: no leak)
    monkeypatch.setattr(attention_pkg, "_REGISTRY", dict(attention_pkg._REGISTRY))
    attention_pkg.register("sdpa_tempered")(tempered_attention)
    run = train_run(dataset, tmp_path / "runs" / "2026-01-02" / "t",
                    model={"attention": "sdpa_tempered"}, data={"seq_len": 16})
    code, out, err = trainlab(capsys, "export", str(run), "--out", str(tmp_path / "hf"))
    assert code == 2 and out == ""
    assert err == (
        "error: model.attention = 'sdpa_tempered': transformers has no equivalent of this "
        "attention variant; export supports auto, sdpa, flex, eager\n"
    )
    assert not (tmp_path / "hf").exists()
    cfg = tiny_config(dataset)
    assert refusals(cfg.model) == []
    for kernel in ("auto", "flex", "eager"):  # the recipes' default is auto: exportable
        assert refusals(cfg.model.model_copy(update={"attention": kernel})) == []
    other = cfg.model.model_copy(update={"arch": "mamba"})
    assert refusals(other)[0].startswith("model.arch = 'mamba': no transformers class")


def trainlab(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        cli_main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_cli_exports_and_logs_to_the_runs_mlflow_record(tmp_path_factory, tmp_path, capsys,
                                                        monkeypatch):
    """A real run with its MLflow record (the session's small real store): the
    export's checksum and files are in that run."""
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    store = real_store(tmp_path_factory)
    runs_root, run_dir = store.runs_root, store.run_dir
    out = tmp_path / "exported"
    code, stdout, _ = trainlab(capsys, "export", str(run_dir / "checkpoints/step-00000004"),
                               "--out", str(out), "--json")
    assert code == 0
    result = json.loads(stdout.strip().splitlines()[-1])
    record = json.loads((out / "export.json").read_text())
    assert result["sha256"] == record["sha256"]
    assert record["files"]["model.safetensors"]["bytes"] == (out / "model.safetensors").stat().st_size
    client = MlflowClient(f"sqlite:///{runs_root / 'mlflow.db'}")
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["run_dir"] == str(run_dir.resolve())
    assert run.data.tags["export.latest.sha256"] == record["sha256"]
    assert run.data.tags["export.latest.path"] == str(out.resolve())
    logged = client.download_artifacts(run.info.run_id, "exports/step-00000004-fp32/export.json")
    assert json.loads(Path(logged).read_text())["sha256"] == record["sha256"]
    capsys.readouterr()

    # bad input: one line, exit 2
    for argv, message in [
        (["--out", str(out)], f"--out {out.resolve()}: exists and is not empty"),
        (["--out", str(tmp_path / "x"), "--step", "3"], "--step 3: "),
        (["--out", str(tmp_path / "x"), "--max-shard-size", "lots"], "--max-shard-size 'lots'"),
    ]:
        code, stdout, err = trainlab(capsys, "export", str(run_dir), *argv)
        assert code == 2 and err.startswith(f"error: {message}"), err
        assert len(err.strip().splitlines()) == 1 and stdout == ""


def test_an_moe_transformers_cannot_represent_is_refused_by_name():
    from trainlab.config.schema import ModelConfig

    moe = {"num_experts": 4, "top_k": 2, "balance": "bias", "shared_experts": 1,
           "capacity_factor": 1.5, "router": {"score": "sigmoid"}}  # fmt: skip
    got = refusals(ModelConfig(moe=moe))
    for field in ("router.score", "shared_experts", "balance", "capacity_factor"):
        assert any(f"model.moe.{field} = " in r and "MixtralForCausalLM" in r for r in got), field
    assert refusals(ModelConfig(moe={"num_experts": 4})) == []
    dense_first = refusals(ModelConfig(moe={"num_experts": 4, "first_dense_layers": 1}))
    assert len(dense_first) == 1 and "every layer of MixtralForCausalLM" in dense_first[0]
    assert refusals(ModelConfig(arch="llama_qknorm", moe={"num_experts": 4,
                                                          "first_dense_layers": 1})) == []


def test_a_run_in_object_storage_exports_as_the_same_run_on_a_disk(
    tmp_path_factory, tmp_path, s3_env, monkeypatch
):
    """One path for a run on a disk and in a store: the run's files put in S3
    (moto's server) export the same model, from the run and from its checkpoint,
    as its directory does; a name that is no run is one line."""
    from trainlab.errors import UserError
    from trainlab.location import locate

    monkeypatch.setenv("TRAINLAB_SCRATCH_DIR", str(tmp_path / "scratch"))
    run_dir = real_store(tmp_path_factory).run_dir
    _, bucket = s3_env
    there = locate(f"s3://{bucket}/runs/2026-12-07/tiny")
    for rel, _ in locate(run_dir).walk():
        if rel == "config.yaml" or rel.startswith("checkpoints/step-"):
            there.upload(run_dir / rel, rel)
    on_disk = export_model(run_dir, tmp_path / "disk", track=False)
    from_run = export_model(there.uri, tmp_path / "run", track=False)
    newest = f"checkpoints/step-{on_disk['step']:08d}"
    from_checkpoint = export_model(there.uri_of(newest), tmp_path / "ckpt", track=False)
    assert on_disk["sha256"] == from_run["sha256"] == from_checkpoint["sha256"]
    assert from_run["run_dir"] == from_checkpoint["run_dir"] == there.uri
    assert from_run["checkpoint"] == from_checkpoint["checkpoint"] == there.uri_of(newest)
    with pytest.raises(UserError, match="--step 3: .* has no checkpoint of that step"):
        export_model(there.uri, tmp_path / "x", step=3, track=False)
    with pytest.raises(UserError, match="no such directory"):
        export_model(f"s3://{bucket}/nothing", tmp_path / "y", track=False)
