"""The prepared GPU check (devtools/gpu_check.py, `make gpu-check`), tested without a GPU:

- its CPU rehearsal runs every step through the real trainer in a subprocess whose
  imports are limited to what the GPU machine has plus the carried wheels (Ray and
  MLflow, and everything else outside that list, raise on import), and writes the JSON;
- without a CUDA GPU, the check (and `make gpu-check`) exits 2 with one line;
- the wheel helpers: tags, offline installation (pip and unpacking), the synthetic stream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

from devtools import gpu_check
from tests.conftest import REPO

SCRIPT = REPO / "devtools" / "gpu_check.py"

# Top-level modules the GPU machine's python3 has besides the standard library:
# torch (and what torch itself requires), numpy, pyarrow, tokenizers, pyyaml,
# safetensors, transformers.
MACHINE_MODULES = {
    "torch", "torchgen", "functorch", "triton", "nvidia", "numpy", "pyarrow", "tokenizers",
    "yaml", "safetensors", "transformers", "filelock", "fsspec", "jinja2", "markupsafe",
    "networkx", "sympy", "mpmath", "setuptools", "pkg_resources", "typing_extensions",
    # what transformers itself requires (its Requires-Dist and theirs)
    "packaging", "huggingface_hub", "regex", "tqdm", "typer", "click", "kernels", "hf_xet",
    "httpx2", "httpcore2", "h11", "anyio", "idna", "certifi", "sniffio", "charset_normalizer",
    "truststore",
}  # fmt: skip
# What the carried wheels (gpu_check.WHEEL_PACKAGES) provide.
WHEEL_MODULES = {
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_extensions",
    "typing_inspection",
}
REPO_MODULES = {"trainlab", "devtools", "tests", "gpu_check", "sitecustomize"}
ALWAYS_BLOCKED = {"ray", "mlflow"}

SITECUSTOMIZE = textwrap.dedent(
    """
    import os
    import sys

    _ALLOWED = set(os.environ["GPU_CHECK_TEST_ALLOWED"].split(","))
    _BLOCKED = set(os.environ["GPU_CHECK_TEST_BLOCKED"].split(","))
    _LOG = os.environ["GPU_CHECK_TEST_LOG"]


    def _blocked(name):
        top = name.partition(".")[0]
        if top in _BLOCKED:
            return True
        return not (top in sys.stdlib_module_names or top in _ALLOWED or top.startswith("_"))


    class _OnlyTheGpuMachine:
        # Wraps a finder: a module outside the list is not found, as on the GPU
        # machine (import raises ModuleNotFoundError, find_spec returns None).
        def __init__(self, inner):
            self._inner = inner

        def find_spec(self, name, path=None, target=None):
            if _blocked(name):
                with open(_LOG, "a") as f:
                    f.write(name.partition(".")[0] + "\\n")
                return None
            return self._inner.find_spec(name, path, target)

        def __getattr__(self, attr):
            return getattr(self._inner, attr)


    _KEEP = ("BuiltinImporter", "FrozenImporter")
    sys.meta_path[:] = [
        f if getattr(f, "__name__", type(f).__name__) in _KEEP else _OnlyTheGpuMachine(f)
        for f in sys.meta_path
    ]
    """
)


def _blocked_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose python processes (and their children) can import only
    the standard library, the GPU machine's packages, the wheels and the repo."""
    site = tmp_path / "blocker"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), str(REPO / "platform"), str(REPO)]),
        GPU_CHECK_TEST_ALLOWED=",".join(sorted(MACHINE_MODULES | WHEEL_MODULES | REPO_MODULES)),
        GPU_CHECK_TEST_BLOCKED=",".join(sorted(ALWAYS_BLOCKED)),
        GPU_CHECK_TEST_LOG=str(tmp_path / "blocked.log"),
        OUT=str(tmp_path / "out"),
        CUDA_VISIBLE_DEVICES="",
    )
    return env


def test_the_blocker_blocks(tmp_path):
    env = _blocked_env(tmp_path)
    for name in ("ray", "mlflow", "psutil"):
        proc = subprocess.run(
            [sys.executable, "-c", f"import {name}"], env=env, capture_output=True
        )
        assert proc.returncode != 0, name
        assert f"No module named '{name}'".encode() in proc.stderr
    ok = subprocess.run(
        [sys.executable, "-c", "import torch, numpy, pydantic, trainlab.train.loop.trainer"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
@pytest.mark.extended  # 40 s on 2 cores; `make gpu-check` runs the real thing on a GPU
def test_cpu_rehearsal_runs_every_step_without_ray_or_mlflow(tmp_path):
    env = _blocked_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-rehearsal", "--work-dir", str(tmp_path)],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=560,
    )
    out = tmp_path / "out" / "gpu-check.json"  # $OUT/gpu-check.json
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    detail = json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk != "layouts"} for k, v in report["steps"].items()}
    )[:4000]
    assert proc.returncode == 0, detail + proc.stderr[-2000:]
    blocked = tmp_path / "blocked.log"
    attempted = set(blocked.read_text().split()) if blocked.exists() else set()
    assert not attempted & ALWAYS_BLOCKED, attempted

    assert report["schema"] == gpu_check.SCHEMA
    assert report["mode"] == "cpu-rehearsal" and report["ok"] is True
    env_ = report["environment"]
    assert env_["torch"] and env_["python"] and env_["device_name"] == "cpu"
    assert env_["peak_tflops"] == gpu_check.CPU_NOMINAL_TFLOPS
    assert env_["process_group"] == "gloo, 1 rank"
    steps = report["steps"]
    assert list(steps) == [
        "train_bf16_fsdp", "memory", "fp16_grad_scaler", "muon_bf16_fsdp",
        "eager_vs_compiled", "host_syncs", "dense_vs_flex", "hf_architectures", "moe",
        "kill_resume", "checkpoint_stall",
    ]  # fmt: skip
    moe = steps["moe"]  # the CPU's grouped GEMM (fp32) is the loop's result; ep 1 trains
    assert moe["grouped_mm"] is False and moe["grouped_vs_loop_max_rel"] <= 1e-5
    assert moe["train_status"] == "completed" and min(moe["load_max_over_mean"]) >= 1.0
    hf = steps["hf_architectures"]["by_arch"]
    assert all(r["isolation_max_abs"] < 1e-5 and r["grads_finite"] for r in hf.values()), hf
    assert all(s["ok"] and s["seconds"] >= 0 for s in steps.values())

    train = steps["train_bf16_fsdp"]
    assert train["layout"]["fully_shard_applied"] is True
    assert train["layout"]["strategy"] == "fsdp" and train["layout"]["world_size"] == 1
    assert train["precision"] == "bf16" and train["loss_finite"]
    assert train["tokens_per_s"] > 0 and train["flops_per_token"] > 0
    expected_mfu = train["flops_per_token"] * train["tokens_per_s"] / (train["peak_tflops"] * 1e12)
    assert train["mfu"] == pytest.approx(expected_mfu)
    assert train["summary"]["status"] == "completed"
    assert train["summary"]["final_step"] == train["steps"]
    assert len(train["summary"]["weights_sha256"]) == 64

    mem = steps["memory"]
    assert mem["measured_peak_bytes"] > 0 and mem["plan_total_bytes"] > 0
    assert set(mem["plan_memory_per_device_bytes"]) >= {"parameters", "gradients", "optimizer", "total"}
    assert mem["measured_vs_plan"] == pytest.approx(
        mem["measured_peak_bytes"] / mem["plan_total_bytes"] - 1, abs=1e-3
    )
    # The trace either gave a total or says why not (trainlab.train.memtrace).
    assert mem["trace"].get("total") is not None or mem["trace"].get("error")
    assert "plan_vs_trace" in mem and "measured_vs_trace" in mem

    fp16 = steps["fp16_grad_scaler"]
    assert set(fp16["variants"]) == {"fsdp", "plain"}
    for name, v in fp16["variants"].items():
        assert v["ok"] and v["loss_finite"], name
        assert v["scaler_scale"] == 1.0 and v["scaler_enabled"] is False  # no CUDA: disabled
    assert fp16["variants"]["fsdp"]["sharded"] and not fp16["variants"]["plain"]["sharded"]

    muon = steps["muon_bf16_fsdp"]
    assert muon["sharded"] and muon["status"] == "completed" and muon["losses"]

    # The fast path (docs/gpu.md): on CPU nothing compiles (auto) and flex runs forward only.
    ec = steps["eager_vs_compiled"]
    assert ec["tokens_per_s_eager"] > 0 and ec["compiled_on"] is False and ec["mfu_eager"] > 0
    syncs = steps["host_syncs"]
    assert syncs["local_scalar_dense"] == 0 and syncs["cuda_sync_warnings"] is None
    flex = steps["dense_vs_flex"]
    assert flex["backward"] is False and set(flex["by_seq_len"]) == {"64", "128"}
    for row in flex["by_seq_len"].values():
        assert row["sdpa"]["step_time_s"] > 0 and row["flex"]["step_time_s"] > 0, row
    assert flex["sdpa_backends"]["causal"]["runs"]

    kr = steps["kill_resume"]
    assert kr["deterministic"] is True
    for name, v in kr["layouts"].items():
        assert v["killed_by_chaos"] and v["killed"]["returncode"] == -9, name
        assert v["resumed_start_step"] == kr["checkpoint_every"], name
        assert v["bitwise_identical"], name
        assert v["reference_weights_sha256"] == v["resumed_weights_sha256"], name
    assert kr["layouts"]["fsdp"]["sharded"] and not kr["layouts"]["plain"]["sharded"]

    stall = steps["checkpoint_stall"]
    assert stall["params"] == 10_000_000 and not stall["pinned_memory"]
    assert stall["stall_ratio"] > 0 and len(stall["async_blocked_s"]) == 2


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("gpu-check:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_without_a_gpu_it_exits_2_with_one_line(tmp_path):
    env = _blocked_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.json")],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == gpu_check.EXIT_NO_GPU
    assert "no CUDA GPU" in _one_line(proc.stderr)
    assert not (tmp_path / "x.json").exists()
    assert proc.stdout == ""


def test_make_gpu_check_without_a_gpu_exits_2(tmp_path):
    env = {**_blocked_env(tmp_path), "MAKEFLAGS": ""}
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", f"GPU_PYTHON={sys.executable}"],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU" in _one_line(proc.stderr)


# --------------------------------------------------------------------------- wheels


@pytest.mark.parametrize(
    ("name", "fits"),
    [
        ("pydantic-2.14.4-py3-none-any.whl", True),
        ("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
        ("pydantic_core-2.50.5-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", False),
        ("pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_aarch64.whl", False),
        ("pydantic_core-2.50.5-cp312-cp312-macosx_11_0_arm64.whl", False),
        ("cryptography-44.0.0-cp39-abi3-manylinux_2_28_x86_64.whl", True),
        ("foo-1.0-cp313-abi3-manylinux_2_28_x86_64.whl", False),
    ],
)
def test_wheel_tags(name, fits):
    assert gpu_check.wheel_fits(name) is fits


def test_wheel_list_is_what_the_machine_lacks():
    names = {gpu_check._norm(n) for n in gpu_check.WHEEL_PACKAGES}
    assert "pydantic" in names and "pydantic-core" in names
    assert not names & {gpu_check._norm(n) for n in gpu_check.MACHINE_PACKAGES}
    assert {n.replace("-", "_") for n in names} == WHEEL_MODULES


def _fake_wheel(folder: Path, name: str = "gpucheckdemo") -> Path:
    """A minimal valid pure-Python wheel."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{info}/RECORD", record)
    return path


@pytest.mark.parametrize("use_pip", [True, False])
def test_install_wheels_offline(tmp_path, use_pip):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheel = _fake_wheel(wheels)
    assert gpu_check.install_wheels(wheels, site, use_pip=use_pip) == [wheel.name]
    assert (site / "gpucheckdemo" / "__init__.py").read_text() == "VALUE = 42\n"
    marker = site / "gpucheckdemo" / "untouched"
    marker.write_text("")
    gpu_check.install_wheels(wheels, site, use_pip=use_pip)  # same wheels: nothing to do
    assert marker.exists()
    proc = subprocess.run(
        [sys.executable, "-c", "import gpucheckdemo; print(gpucheckdemo.VALUE)"],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert proc.stdout.strip() == "42"


def test_missing_wheels_exit_3(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "pydantic" else real(n, *a)
    )
    monkeypatch.delenv(gpu_check._REEXEC_ENV, raising=False)
    args = gpu_check.parse_args(["--wheels", str(tmp_path / "none"), "--site", str(tmp_path / "s")])
    with pytest.raises(SystemExit) as exc:
        gpu_check.ensure_site(args)
    assert exc.value.code == gpu_check.EXIT_NO_WHEELS
    assert "make gpu-wheels" in capsys.readouterr().err


# --------------------------------------------------------------------------- pieces


def test_peak_tflops_by_device_name():
    assert gpu_check.peak_tflops_for("NVIDIA H200")[0] == 989.0
    assert gpu_check.peak_tflops_for("NVIDIA H100 80GB HBM3")[0] == 989.0
    assert gpu_check.peak_tflops_for("NVIDIA H100 PCIe")[0] == 756.0
    assert gpu_check.peak_tflops_for("NVIDIA A100-SXM4-80GB")[0] == 312.0
    assert gpu_check.peak_tflops_for("Some GPU")[0] is None


def test_synthetic_loader_is_a_pure_function_of_the_step():
    a = gpu_check.SyntheticLoader(vocab=100, seq_len=8, micro_batch=3, grad_accum=2, seed=5)
    b = gpu_check.SyntheticLoader(vocab=100, seq_len=8, micro_batch=3, grad_accum=2, seed=5)
    step, batches = next(a.iter_from(4))
    it = b.iter_from(0)
    for _ in range(5):
        got = next(it)
    assert step == got[0] == 4 and len(batches) == 2
    for x, y in zip(batches, got[1], strict=True):
        assert set(x) == {"input_ids", "labels", "position_ids", "document_ids"}
        assert all(np.array_equal(x[k], y[k]) for k in x)
        assert x["input_ids"].shape == (3, 8) and x["input_ids"].dtype == np.int64
        assert np.array_equal(x["input_ids"][:, 1:], x["labels"][:, :-1])
        assert x["input_ids"].max() < 100
    state = a.state_dict(4)
    b.load_state_dict(state)
    assert b.step == 4
    with pytest.raises(RuntimeError):
        b.load_state_dict({**state, "seed": 6})
    assert a.delivered_shares(4) == {"synthetic": 1.0}
    assert len(a.validation_batches("synthetic", 2)) == 2 and a.validation_batches("x", 2) == []
