"""The prepared GPU check (`make gpu-check`): the whole GPU story in one short run.

On a machine with one CUDA GPU (H100/H200 class: under 8 minutes), through the
real trainer (`trainlab.train.loop.trainer.Trainer`) in a plain process, no Ray:

1. `train_bf16_fsdp`: a ~1B Llama, bf16, FSDP2 at world size 1 (a 1-rank
   process group and the trainer's own `apply_parallelism`, see `GroupEnv`), a
   step loop on synthetic tokens: tokens/s and MFU (the planner's FLOPs per
   token over the device's peak);
2. `memory`: that run's peak device memory next to the plan's
   `memory_per_device_bytes` and the trace (`trainlab.train.memtrace.trace_memory`);
3. `fp16_grad_scaler`: fp16 with the grad scaler, under FSDP and without;
4. `kill_resume`: deterministic mode, a run killed (train.chaos) after its
   mid-run checkpoint and resumed by a fresh process ends with the same weights,
   bit for bit, as an uninterrupted run (FSDP and plain);
5. the fast path (docs/gpu.md): `eager_vs_compiled` (the 1B run of (1), which
   compiles its blocks, against the same run with `train.compile: false`:
   tokens/s, MFU, compile time), `host_syncs` (a quiet step under
   `torch.cuda.set_sync_debug_mode`: zero), `dense_vs_flex` (step time and
   peak memory of SDPA's dense mask against FlexAttention's block mask on
   packed rows at 4k, 8k and 16k tokens; which SDPA backend runs);
6. `moe` (docs/moe.md): the routed experts' grouped GEMM (torch._grouped_mm,
   bf16) against the per-expert loop, numerics and time, and a small MoE
   trained at parallel.ep 1 (one device).

Every figure goes into one JSON: `$OUT/gpu-check.json` when $OUT is set, else
gpu-check.json at the repository root (or --out). Each step is timed and
recorded even when another fails; the JSON is rewritten after every step.
Exit status: 0 all steps ok, 1 a step failed, 2 no CUDA GPU (one line on
stderr), 3 the wheels it needs are missing.

The GPU machine has no network and only its own python3 with torch, numpy,
pyarrow, tokenizers, pyyaml, safetensors and transformers. What else the check
imports (pydantic and its dependencies: `WHEEL_PACKAGES`) comes as wheels that
`make gpu-wheels` downloads here (`--download-wheels`); the check installs them
offline into .gpu-site before it starts and never downloads.

`--cpu-rehearsal` runs the same code paths on CPU with tiny models in seconds
(gloo instead of NCCL, host RSS instead of device memory); the unit test runs
it with Ray and MLflow made unimportable.

Only the standard library is imported at module level, so the "no GPU" answer
and the wheel installation work before anything else is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "trainlab.gpu_check/1"
JSON_NAME = "gpu-check.json"

EXIT_FAILED = 1
EXIT_NO_GPU = 2
EXIT_NO_WHEELS = 3

# What the check imports that the GPU machine's python3 lacks: pydantic (the
# config schema) and its dependencies. typing-extensions is there (torch needs
# it) but possibly older than pydantic-core requires, so it comes too.
WHEEL_PACKAGES = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-extensions",
    "typing-inspection",
)
# What the machine has: never carried as a wheel.
MACHINE_PACKAGES = (
    "torch",
    "numpy",
    "pyarrow",
    "tokenizers",
    "pyyaml",
    "safetensors",
    "transformers",
)
WHEELS_MAX_MIB = 30.0
WHEEL_TARGET = (
    "--python-version",
    "3.12",
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--only-binary=:all:",
    "--implementation",
    "cp",
)
DEFAULT_WHEELS = ".gpu-wheels"
DEFAULT_SITE = ".gpu-site"
_REEXEC_ENV = "TRAINLAB_GPU_CHECK_SITE_READY"

# Dense bf16/fp16 tensor-core peak (TFLOP/s, no sparsity) by device name; the
# first substring that matches wins.
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)
CPU_NOMINAL_TFLOPS = 1.0  # the rehearsal's stand-in, so the MFU arithmetic runs

GPU_TIME_BUDGET_S = 420.0  # the steps; plus wheel install and start-up: < 8 min
CPU_TIME_BUDGET_S = 300.0


# --------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class Size:
    model: dict[str, Any]
    seq_len: int
    micro_batch: int
    steps: int
    log_interval: int


GPU_SIZES = {
    # ~1.08B parameters: Llama-style, GQA, untied embeddings, 16k tokens per step.
    "train": Size(
        {
            "hidden_size": 2048,
            "num_layers": 20,
            "num_heads": 16,
            "num_kv_heads": 8,
            "vocab_size": 32000,
            "max_seq_len": 2048,
            "tie_embeddings": False,
        },
        seq_len=2048,
        micro_batch=8,
        steps=30,
        log_interval=5,
    ),
    "fp16": Size(
        {
            "hidden_size": 1024,
            "num_layers": 8,
            "num_heads": 16,
            "num_kv_heads": 8,
            "vocab_size": 32000,
            "max_seq_len": 1024,
        },
        seq_len=1024,
        micro_batch=8,
        steps=8,
        log_interval=2,
    ),
    "resume": Size(
        {
            "hidden_size": 512,
            "num_layers": 4,
            "num_heads": 8,
            "num_kv_heads": 4,
            "vocab_size": 8192,
            "max_seq_len": 256,
        },
        seq_len=256,
        micro_batch=8,
        steps=8,
        log_interval=2,
    ),
}
_TINY = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 128,
    "vocab_size": 512,
    "max_seq_len": 32,
}
CPU_SIZES = {
    "train": Size(_TINY, seq_len=32, micro_batch=2, steps=6, log_interval=2),
    "fp16": Size(_TINY, seq_len=32, micro_batch=2, steps=4, log_interval=2),
    "resume": Size(_TINY, seq_len=32, micro_batch=2, steps=6, log_interval=2),
}


# --------------------------------------------------------------------------- wheels


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    """The normalized project name of a wheel file."""
    return _norm(filename.split("-")[0])


def wheel_fits(filename: str) -> bool:
    """Whether a wheel installs on CPython 3.12, manylinux x86-64."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) < 5:
        return False
    pythons, abis, platforms = (set(p.split(".")) for p in parts[-3:])
    py_ok = bool(pythons & {"py3", "cp312"})
    abi_ok = bool(abis & {"none", "abi3", "cp312"})
    plat_ok = "any" in platforms or any(
        re.fullmatch(r"(manylinux\d*|manylinux_2_\d+)_x86_64", p) for p in platforms
    )
    if "abi3" in abis and not py_ok:  # cp3X-abi3 with X <= 12 also fits
        py_ok = any(re.fullmatch(r"cp3(\d+)", p) and int(p[3:]) <= 12 for p in pythons)
    return py_ok and abi_ok and plat_ok


def _offline_pip_env() -> dict[str, str]:
    """pip without this machine's configuration (no extra index, no find-links)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def download_wheels(dest: Path) -> int:
    """`make gpu-wheels`: the wheels of WHEEL_PACKAGES for CPython 3.12 manylinux
    x86-64 into `dest`, at the versions this environment runs; then an offline
    resolution check against only those files. Prints the list and the size."""
    from importlib import metadata

    pins = []
    for name in WHEEL_PACKAGES:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "download", "--quiet", "--dest", str(dest), *WHEEL_TARGET, *pins], check=True
    )
    wheels = sorted(dest.glob("*.whl"))
    problems = [
        f"{w.name}: not for CPython 3.12 manylinux x86-64" for w in wheels if not wheel_fits(w.name)
    ]
    machine = {_norm(n) for n in MACHINE_PACKAGES}
    problems += [
        f"{w.name}: the GPU machine has it"
        for w in wheels
        if wheel_name(w.name) in machine or wheel_name(w.name).startswith("nvidia-")
    ]
    missing = {_norm(n) for n in WHEEL_PACKAGES} - {wheel_name(w.name) for w in wheels}
    problems += [f"{m}: no wheel downloaded" for m in sorted(missing)]
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.name}  {w.stat().st_size / 2**20:.2f} MiB")
    print(f"{len(wheels)} wheels, {total / 2**20:.2f} MiB in {dest}")
    if total > WHEELS_MAX_MIB * 2**20:
        problems.append(f"{total / 2**20:.1f} MiB > {WHEELS_MAX_MIB:g} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        dry = subprocess.run(
            [
                *pip,
                "install",
                "--quiet",
                "--no-index",
                "--find-links",
                str(dest),
                "--target",
                tmp,
                *WHEEL_TARGET,
                *[str(w) for w in wheels],
            ],
            env=_offline_pip_env(),
            capture_output=True,
            text=True,
        )
        if dry.returncode:
            problems.append("offline install for 3.12 failed: " + dry.stderr.strip()[-500:])
    for p in problems:
        print(f"gpu-wheels: {p}", file=sys.stderr)
    return 1 if problems else 0


def install_wheels(wheels: Path, site: Path, use_pip: bool | None = None) -> list[str]:
    """Install every wheel of `wheels` into `site`, offline: `pip install --no-index
    --find-links WHEELS --target SITE`, or, when this python3 has no working pip,
    by unpacking the wheels (a wheel is a zip of what goes into site-packages).
    Returns the wheel names; does nothing when `site` already holds exactly these."""
    files = sorted(wheels.glob("*.whl"))
    names = [w.name for w in files]
    stamp = site / ".installed"
    if stamp.is_file() and stamp.read_text().split() == names:
        return names
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    env = _offline_pip_env()
    pip = [sys.executable, "-m", "pip"]
    if use_pip is None:
        use_pip = subprocess.run([*pip, "--version"], capture_output=True, env=env).returncode == 0
    installed = False
    if use_pip:
        args = ["install", "--quiet", "--no-index", "--find-links", str(wheels)]
        proc = subprocess.run(
            [*pip, *args, "--target", str(site), *map(str, files)], env=env, text=True
        )
        installed = proc.returncode == 0
        if not installed:
            print("gpu-check: pip could not install the wheels; unpacking them", file=sys.stderr)
    if not installed:
        for w in files:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
    stamp.write_text("\n".join(names) + "\n")
    return names


def _pythonpath(*extra: Path) -> str:
    parts = [str(p) for p in extra] + [str(REPO / "platform"), str(REPO)]
    old = os.environ.get("PYTHONPATH")
    return os.pathsep.join(parts + ([old] if old else []))


def ensure_site(args: argparse.Namespace) -> list[str] | None:
    """Make pydantic importable: when it is not, install the carried wheels into
    the site folder and start this script again with that folder first on the
    path (torch has already loaded the machine's typing_extensions). Returns the
    wheels in use, None when nothing was needed (a development environment)."""
    import importlib.util

    wheels, site = Path(args.wheels).resolve(), Path(args.site).resolve()
    stamp = site / ".installed"
    if os.environ.get(_REEXEC_ENV):
        return stamp.read_text().split() if stamp.is_file() else None
    if importlib.util.find_spec("pydantic") is not None:
        return stamp.read_text().split() if stamp.is_file() else None
    if not wheels.is_dir() or not any(wheels.glob("*.whl")):
        _die(
            EXIT_NO_WHEELS,
            f"gpu-check: pydantic is not importable and {wheels} holds no wheels: run "
            "`make gpu-wheels` where there is network and carry .gpu-wheels",
        )
    install_wheels(wheels, site)
    env = {**os.environ, _REEXEC_ENV: "1", "PYTHONPATH": _pythonpath(site)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env)
    return None  # pragma: no cover - execve does not return


# --------------------------------------------------------------------------- helpers


def _die(code: int, message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def peak_tflops_for(name: str) -> tuple[float | None, str]:
    for key, value in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return value, f"table: {key}"
    return None, f"unknown device {name!r} (pass --peak-tflops)"


def _write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def jsonable(x: Any) -> Any:
    """Plain JSON of a result object (to_json(), a dataclass, a mapping)."""
    if hasattr(x, "to_json"):
        x = x.to_json()
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = dataclasses.asdict(x)
    return json.loads(json.dumps(x, default=str))


# --------------------------------------------------------------------------- the trainer's inputs


class SyntheticLoader:
    """A `StreamLoader` (trainlab.train.loop.trainer) of synthetic token rows, a pure
    function of (seed, step): each row is an arithmetic progression modulo the
    vocabulary with its own start and stride, one document per row (so the
    attention takes its plain causal path), learnable from two tokens back."""

    SOURCE = "synthetic"

    def __init__(self, vocab: int, seq_len: int, micro_batch: int, grad_accum: int, seed: int):
        self.vocab, self.seq_len, self.micro_batch = vocab, seq_len, micro_batch
        self.grad_accum, self.seed = grad_accum, seed
        self.step = 0

    def _rows(self, *key: int) -> dict[str, Any]:
        import numpy as np

        rng = np.random.default_rng([self.seed, *key])
        start = rng.integers(0, self.vocab, size=(self.micro_batch, 1))
        stride = rng.integers(1, max(2, min(self.vocab, 64)), size=(self.micro_batch, 1))
        seq = (start + stride * np.arange(self.seq_len + 1)) % self.vocab
        seq = seq.astype(np.int64)
        return {
            "input_ids": seq[:, :-1].copy(),
            "labels": seq[:, 1:].copy(),
            "position_ids": np.tile(np.arange(self.seq_len, dtype=np.int64), (self.micro_batch, 1)),
            "document_ids": np.zeros((self.micro_batch, self.seq_len), dtype=np.int32),
        }

    def iter_from(self, step: int) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        while True:
            self.step = step
            yield step, [self._rows(0, step, i) for i in range(self.grad_accum)]
            step += 1

    def validation_batches(self, source: str, n: int) -> list[dict[str, Any]]:
        return [self._rows(1, i) for i in range(n)] if source == self.SOURCE else []

    def delivered_shares(self, step: int) -> dict[str, float]:
        return {self.SOURCE: 1.0}

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        return {"kind": self.SOURCE, "seed": self.seed, "step": self.step if step is None else step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.SOURCE or state.get("seed") != self.seed:
            raise RuntimeError(f"checkpoint data state {state} is not this synthetic stream")
        self.step = int(state["step"])


def group_env_class() -> type:
    """`DistEnv` that counts an initialized 1-rank process group as distributed, so
    the trainer's `apply_parallelism` wraps with FSDP2 at world size 1 (the
    library's `DistEnv.distributed` is False for one worker: no wrapping)."""
    import torch.distributed as dist

    from trainlab.train.parallel.distributed import DistEnv

    class GroupEnv(DistEnv):
        @property
        def distributed(self) -> bool:
            return dist.is_available() and dist.is_initialized()

    return GroupEnv


def experiment_raw(
    size: Size,
    *,
    precision: str,
    layout: str,
    device: str,
    deterministic: bool = False,
    every: int | None = None,
    kill_at: tuple[int, ...] = (),
    validate: bool = False,
    eval_every: int | None = None,
    gpu_memory_gb: float = 80.0,
    peak_tflops: float | None = None,
    optimizer: str = "adamw",
    compile: str = "auto",
) -> dict[str, Any]:
    """The experiment config (raw) of one of the check's runs."""
    steps = size.steps
    return {
        "name": "gpu-check",
        "purpose": "devtools/gpu_check.py",
        "model": {"arch": "llama", **size.model},
        "data": {
            "path": "synthetic",
            "seq_len": size.seq_len,
            "micro_batch_size": size.micro_batch,
        },
        "train": {
            "lr": 3e-4,
            "warmup_steps": 2,
            "total_steps": steps,
            "log_interval": size.log_interval,
            "eval_interval": eval_every or steps,
            "eval_batches": 1,
            "precision": precision,
            "deterministic": deterministic,
            "seed": 7,
            "checkpoint": {
                "every_steps": every or steps,
                "keep_last": 2,
                "keep_best": 1,
                "async_save": False,
                "validate": validate,
            },
            "chaos": {"kill_at_steps": list(kill_at)},
            "optimizer": {"name": optimizer},
            "compile": compile,
        },
        "parallel": (
            {"strategy": "fsdp", "zero_stage": 3}
            if layout == "fsdp"
            else {"strategy": "ddp", "zero_stage": 0}
        ),
        "resource": {
            "num_workers": 1,
            # fp16 needs use_gpu (a config rule); the rehearsal runs it on CPU anyway.
            "use_gpu": device == "cuda" or precision == "fp16",
            "gpu_memory_gb": gpu_memory_gb,
            "peak_tflops": peak_tflops,
        },
        "tracking": {"system_metrics": False},
    }


def make_job(raw: dict[str, Any], run_dir: Path, session: str) -> Any:
    """What the launcher would hand a worker, fed by the synthetic stream (no
    prepared dataset)."""
    from trainlab.config import ExperimentConfig
    from trainlab.train.job import in_process_job

    return in_process_job(
        ExperimentConfig.model_validate(raw),
        run_dir,
        session,
        synthetic_source=SyntheticLoader.SOURCE,
    )


def loader_for(job: Any) -> SyntheticLoader:
    c = job.cfg
    return SyntheticLoader(
        c.model.vocab_size, c.data.seq_len, c.data.micro_batch_size, c.data.grad_accum_steps, 11
    )


class Recorder:
    """A trainer callback keeping the logged metrics and when things happened."""

    def __init__(self, device: Any):
        from trainlab.train.loop.callbacks import Callback

        self.device = device
        self.windows: list[dict[str, float]] = []
        self.times: dict[str, float] = {}
        self.training_peak: int | None = None
        recorder = self

        class _CB(Callback):
            def on_run_start(self, ctx: Any) -> None:
                recorder.times["run_start"] = time.perf_counter()

            def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
                recorder.windows.append({"step": step, **metrics})
                recorder.times["last_step"] = time.perf_counter()
                recorder.training_peak = _peak_bytes(recorder.device)

            def on_eval(self, step: int, val_losses: dict[str, float]) -> None:
                recorder.times["eval_end"] = time.perf_counter()

            def on_checkpoint(self, step: int, path: str, valid: bool, val: Any) -> None:
                recorder.times["checkpoint_end"] = time.perf_counter()

            def on_run_end(self, summary: dict[str, Any]) -> None:
                recorder.times["run_end"] = time.perf_counter()

        self.callback = _CB()


def _peak_bytes(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _peak_reserved(device: Any) -> int | None:
    import torch

    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def _reset_peak(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _is_sharded(model: Any) -> bool:
    p = next(model.parameters())
    return type(p).__name__ == "DTensor"


def train_run(job: Any, device: Any, layout: str) -> tuple[Any, dict[str, Any], Recorder]:
    """Build the real Trainer for `job` and fit it; returns (trainer, summary, recorder)."""
    from trainlab.train.loop.trainer import Trainer
    from trainlab.train.parallel.distributed import DistEnv

    env_cls = group_env_class() if layout == "fsdp" else DistEnv
    env = env_cls(rank=0, world_size=1, local_rank=0, device=device)
    rec = Recorder(device)
    t0 = time.perf_counter()
    trainer = Trainer(job, loader_for(job), env, callbacks=rec.callback)
    rec.times["built"] = time.perf_counter()
    rec.times["build_s"] = rec.times["built"] - t0
    summary = trainer.fit() or {}
    rec.times["fit_done"] = time.perf_counter()
    return trainer, summary, rec


@contextlib.contextmanager
def process_group(device: Any) -> Iterator[str]:
    """A 1-rank process group (NCCL on CUDA, gloo on CPU) for the FSDP layout."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        yield dist.get_backend()
        return
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        yield backend
    finally:
        dist.destroy_process_group()


SUMMARY_KEYS = (
    "status",
    "final_step",
    "start_step",
    "final_loss",
    "val_loss",
    "tokens_seen",
    "tokens_per_s",
    "tokens_per_s_median",
    "weights_sha256",
    "wall_seconds",
    "peak_memory_bytes",
    "planned_memory_bytes",
    "restarts",
)


def _summary_subset(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k) for k in SUMMARY_KEYS}


# --------------------------------------------------------------------------- the check


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rehearsal = bool(args.cpu_rehearsal)
        self.sizes = CPU_SIZES if self.rehearsal else GPU_SIZES
        self.budget = args.time_budget or (
            CPU_TIME_BUDGET_S if self.rehearsal else GPU_TIME_BUDGET_S
        )
        self.t0 = time.perf_counter()
        self.out = Path(args.out) if args.out else _default_out()
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.work_dir))
        self.report: dict[str, Any] = {
            "schema": SCHEMA,
            "mode": "cpu-rehearsal" if self.rehearsal else "gpu",
            "ok": False,
            "started_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "time_budget_s": self.budget,
            "steps": {},
        }
        self.train_result: dict[str, Any] = {}
        self.train_windows: list[dict[str, Any]] = []
        self.train_job: Any = None

    # ---------------------------------------------------------------- plumbing

    def remaining(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.report["wall_s"] = round(time.perf_counter() - self.t0, 2)
        steps = self.report["steps"].values()
        self.report["ok"] = bool(steps) and all(s.get("ok") for s in steps)
        _write_json(self.out, self.report)

    def step(self, name: str, fn: Callable[[dict[str, Any]], None], needs_s: float) -> None:
        rec: dict[str, Any] = {}
        self.report["steps"][name] = rec
        if self.remaining() < needs_s:
            rec["ok"] = False
            rec["error"] = (
                f"skipped: {self.remaining():.0f} s of the {self.budget:.0f} s budget left, "
                f"the step needs about {needs_s:.0f} s"
            )
            self.save()
            print(f"[gpu-check] {name}: {rec['error']}", flush=True)
            return
        print(f"[gpu-check] {name} ...", flush=True)
        t = time.perf_counter()
        try:
            fn(rec)
            rec.setdefault("ok", True)
        except Exception as exc:  # noqa: BLE001 - every step is recorded, whatever fails
            rec["ok"] = False
            rec["error"] = _error(exc)
            rec["traceback"] = traceback.format_exc()[-4000:]
        finally:
            rec["seconds"] = round(time.perf_counter() - t, 2)
            if self.device.type == "cuda":
                _reset_peak(self.device)
            self.save()
        status = "ok" if rec.get("ok") else f"FAILED: {rec.get('error')}"
        print(f"[gpu-check] {name}: {status} ({rec['seconds']} s)", flush=True)

    def run(self) -> int:
        import torch

        self.device = torch.device("cpu") if self.rehearsal else torch.device("cuda", 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.report["environment"] = self.environment()
        self.save()
        try:
            try:  # the steps record their own failures; this is the group's
                with process_group(self.device) as backend:
                    self.report["environment"]["process_group"] = f"{backend}, 1 rank"
                    self.step(
                        "train_bf16_fsdp", self.train_bf16_fsdp, 20 if self.rehearsal else 150
                    )
                    self.step("memory", self.memory, 5 if self.rehearsal else 30)
                    self.step("fp16_grad_scaler", self.fp16, 5 if self.rehearsal else 40)
                    self.step("muon_bf16_fsdp", self.muon, 5 if self.rehearsal else 40)
                    self.step("eager_vs_compiled", self.eager_vs_compiled, 10 if self.rehearsal else 60)
                    self.step("host_syncs", self.host_syncs, 10 if self.rehearsal else 20)
                    self.step("dense_vs_flex", self.dense_vs_flex, 10 if self.rehearsal else 90)
                    self.step("hf_architectures", self.hf_architectures, 10 if self.rehearsal else 60)
                    self.step("moe", self.moe, 10 if self.rehearsal else 40)
            except Exception as exc:  # noqa: BLE001
                self.report["error"] = f"process group: {_error(exc)}"
                self.report["traceback"] = traceback.format_exc()[-4000:]
                self.report["steps"].setdefault(
                    "train_bf16_fsdp", {"ok": False, "error": "not run"}
                )
            self.step("kill_resume", self.kill_resume, 30 if self.rehearsal else 100)
            self.step("checkpoint_stall", self.checkpoint_stall, 10 if self.rehearsal else 40)
        finally:
            if not self.args.keep:
                shutil.rmtree(self.work, ignore_errors=True)
            self.save()
        print(f"[gpu-check] wrote {self.out}: ok={self.report['ok']}", flush=True)
        return 0 if self.report["ok"] else EXIT_FAILED

    def environment(self) -> dict[str, Any]:
        import torch

        env: dict[str, Any] = {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()
            if torch.backends.cudnn.is_available()
            else None,
            "wheels": self.args.installed_wheels,
        }
        try:
            import pydantic

            env["pydantic"] = pydantic.VERSION
        except Exception as exc:  # noqa: BLE001
            env["pydantic"] = _error(exc)
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            env["device_name"] = torch.cuda.get_device_name(self.device)
            env["device_count"] = torch.cuda.device_count()
            env["device_memory_bytes"] = int(props.total_memory)
            env["compute_capability"] = f"{props.major}.{props.minor}"
            with contextlib.suppress(Exception):
                v = torch.cuda.nccl.version()
                env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            peak, source = peak_tflops_for(env["device_name"])
        else:
            env["device_name"] = "cpu"
            peak, source = CPU_NOMINAL_TFLOPS, "nominal (cpu rehearsal)"
        if self.args.peak_tflops:
            peak, source = self.args.peak_tflops, "--peak-tflops"
        env["peak_tflops"], env["peak_tflops_source"] = peak, source
        self.peak_tflops = peak
        return env

    def _raw(self, kind: str, **kw: Any) -> dict[str, Any]:
        gpu_gb = self.report["environment"].get("device_memory_bytes", 80 * 2**30) / 2**30
        return experiment_raw(
            self.sizes[kind],
            device=self.device.type,
            gpu_memory_gb=round(gpu_gb, 2),
            peak_tflops=self.peak_tflops,
            **kw,
        )

    # ---------------------------------------------------------------- (1)

    def train_bf16_fsdp(self, rec: dict[str, Any]) -> None:
        import torch.distributed as dist

        raw = self._raw("train", precision="bf16", layout="fsdp")
        job = self.train_job = make_job(raw, self.work / "train", "gpu-check-train")
        _reset_peak(self.device)
        size = self.sizes["train"]
        rec.update(
            model=dict(job.cfg.model.model_dump()),
            num_params=job.plan["num_params"],
            seq_len=size.seq_len,
            micro_batch=size.micro_batch,
            steps=size.steps,
            tokens_per_step=job.cfg.tokens_per_step,
            precision="bf16",
            layout={
                "strategy": job.cfg.parallel.strategy,
                "zero_stage": job.cfg.parallel.zero_stage,
                "world_size": dist.get_world_size(),
                "backend": dist.get_backend(),
                "how": "1-rank process group + the trainer's apply_parallelism "
                "(GroupEnv: DistEnv.distributed true for an initialized group)",
            },
        )
        trainer, summary, r = train_run(job, self.device, "fsdp")
        fsdp_wrapped = _is_sharded(trainer.model)
        from trainlab.train import parallel

        rec["layout"]["fully_shard_applied"] = fsdp_wrapped
        rec["layout"]["mixed_precision_policy"] = hasattr(parallel, "fsdp_mixed_precision")
        peak_total = _peak_bytes(self.device)
        fpt = float(job.plan["flops_per_token"])
        tps = summary.get("tokens_per_s") or (r.windows[-1]["tokens_per_s"] if r.windows else None)
        mfu = fpt * tps / (self.peak_tflops * 1e12) if tps and self.peak_tflops else None
        step_times = [w["step_time_s"] for w in r.windows[1:]] or [
            w["step_time_s"] for w in r.windows
        ]
        ckpt_s = None
        if "checkpoint_end" in r.times:
            ckpt_s = r.times["checkpoint_end"] - r.times.get("eval_end", r.times["last_step"])
        losses = [(w["step"], w["loss"]) for w in r.windows]
        rec.update(
            flops_per_token=fpt,
            peak_tflops=self.peak_tflops,
            tokens_per_s=tps,
            tokens_per_s_median=summary.get("tokens_per_s_median"),
            mfu=mfu,
            mfu_trainer_last_window=r.windows[-1].get("mfu") if r.windows else None,
            step_time_s_median=sorted(step_times)[len(step_times) // 2] if step_times else None,
            losses=losses,
            loss_first=losses[0][1] if losses else None,
            loss_last=losses[-1][1] if losses else None,
            loss_finite=all(math.isfinite(v) for _, v in losses) and bool(losses),
            build_s=round(r.times["build_s"], 2),
            fit_s=round(r.times["fit_done"] - r.times["built"], 2),
            final_checkpoint_s=round(ckpt_s, 2) if ckpt_s is not None else None,
            finish_s=round(
                r.times["fit_done"] - r.times.get("checkpoint_end", r.times["fit_done"]), 2
            ),
            summary=_summary_subset(summary),
        )
        self.train_windows = list(r.windows)
        self.train_result = {
            "peak_total": peak_total,
            "peak_training": r.training_peak,
            "summary": summary,
            "reserved": _peak_reserved(self.device),
        }
        del trainer
        shutil.rmtree(self.work / "train", ignore_errors=True)
        problems = []
        if summary.get("status") != "completed":
            problems.append(f"run status {summary.get('status')!r}")
        if not fsdp_wrapped:
            problems.append("the model was not sharded by fully_shard")
        if not rec["loss_finite"]:
            problems.append("non-finite loss")
        if problems:
            rec["ok"], rec["error"] = False, "; ".join(problems)

    # ---------------------------------------------------------------- (2)

    def memory(self, rec: dict[str, Any]) -> None:
        job = self.train_job
        if job is None:
            raise RuntimeError("the bf16 FSDP run built no job")
        measured = self.train_result.get("peak_total")
        rec["measured_kind"] = (
            "torch.cuda.max_memory_allocated"
            if self.device.type == "cuda"
            else "host RSS (ru_maxrss)"
        )
        rec["measured_peak_bytes"] = measured
        rec["measured_peak_training_bytes"] = self.train_result.get("peak_training")
        rec["measured_peak_reserved_bytes"] = self.train_result.get("reserved")
        summary = self.train_result.get("summary") or {}
        rec["summary_peak_memory_bytes"] = summary.get("peak_memory_bytes")
        rec["summary_planned_memory_bytes"] = summary.get("planned_memory_bytes")
        plan_mem = job.plan.get("memory_per_device_bytes") or {}
        rec["plan_memory_per_device_bytes"] = plan_mem
        planned = plan_mem.get("total")
        rec["plan_total_bytes"] = planned
        try:
            import importlib

            importlib.import_module("trainlab.plan.memory")
            rec["plan_memory_module"] = "trainlab.plan.memory"
        except Exception as exc:  # noqa: BLE001
            rec["plan_memory_module"] = _error(exc)
        trace = self.trace(job)
        rec["trace"] = trace
        traced = trace.get("total")
        rec["trace_total_bytes"] = traced

        def ratio(a: Any, b: Any) -> float | None:
            return round(a / b - 1, 4) if a and b else None

        rec["measured_vs_plan"] = ratio(measured, planned)
        rec["measured_vs_trace"] = ratio(measured, traced)
        rec["plan_vs_trace"] = ratio(planned, traced)  # the planner's estimate_error
        # max_memory_allocated counts tensors only: compare it also without the
        # constant `framework` share (CUDA context, NCCL buffers, fragmentation)
        # that the plan and the trace add; and the allocator's reserved peak.
        plan_fw = plan_mem.get("framework") or 0
        trace_fw = trace.get("framework") or 0
        rec["plan_tensor_bytes"] = planned - plan_fw if planned else None
        rec["trace_tensor_bytes"] = traced - trace_fw if traced else None
        rec["measured_vs_plan_tensors"] = ratio(measured, rec["plan_tensor_bytes"])
        rec["measured_vs_trace_tensors"] = ratio(measured, rec["trace_tensor_bytes"])
        rec["reserved_vs_plan"] = ratio(rec["measured_peak_reserved_bytes"], planned)
        keys = (
            "measured_vs_plan",
            "measured_vs_trace",
            "plan_vs_trace",
            "measured_vs_plan_tensors",
            "measured_vs_trace_tensors",
            "reserved_vs_plan",
        )
        rec["within_10pct"] = {
            k: (abs(rec[k]) <= 0.10 if rec[k] is not None else None) for k in keys
        }
        missing = [n for n, v in (("measured", measured), ("plan", planned)) if not v]
        if missing:
            rec["ok"], rec["error"] = False, f"no {' or '.join(missing)} figure"
        if traced is None:
            rec["warnings"] = [f"no trace: {trace.get('error')}"]

    def trace(self, job: Any) -> dict[str, Any]:
        """trainlab.train.memtrace.trace_memory(cfg) in its own process (it may start a
        fake process group), or why not."""
        import importlib.util

        try:
            found = importlib.util.find_spec("trainlab.train.memtrace") is not None
        except Exception as exc:  # noqa: BLE001
            return {"error": _error(exc)}
        if not found:
            return {"error": "trainlab.train.memtrace is not importable (no such module)"}
        spec = {"role": "trace", "raw": job.cfg.model_dump(mode="json")}
        out = self.worker(spec, "trace", timeout=min(180.0, max(10.0, self.remaining() - 60)))
        if out.get("returncode") != 0 or "result" not in out:
            return {"error": out.get("error") or "trace worker failed", "log": out.get("log")}
        result = out["result"]
        result["seconds"] = out["seconds"]
        return result

    # ---------------------------------------------------------------- (3)

    def fp16(self, rec: dict[str, Any]) -> None:
        variants = {}
        for layout in ("fsdp", "plain"):
            v: dict[str, Any] = {"ok": False}
            variants[layout] = v
            t = time.perf_counter()
            try:
                raw = self._raw("fp16", precision="fp16", layout=layout)
                job = make_job(raw, self.work / f"fp16-{layout}", f"gpu-check-fp16-{layout}")
                trainer, summary, r = train_run(job, self.device, layout)
                scaler = trainer.state.model.scaler
                losses = [(w["step"], w["loss"]) for w in r.windows]
                v.update(
                    sharded=_is_sharded(trainer.model),
                    losses=losses,
                    loss_finite=bool(losses) and all(math.isfinite(x) for _, x in losses),
                    scaler_enabled=bool(scaler is not None and scaler.is_enabled()),
                    scaler_scale=float(scaler.get_scale()) if scaler is not None else None,
                    grad_norms=[w.get("grad_norm") for w in r.windows],
                    tokens_per_s=summary.get("tokens_per_s")
                    or (r.windows[-1]["tokens_per_s"] if r.windows else None),
                    status=summary.get("status"),
                )
                v["ok"] = (
                    v["loss_finite"]
                    and summary.get("status") == "completed"
                    and (v["scaler_enabled"] or self.device.type != "cuda")
                )
                del trainer
            except Exception as exc:  # noqa: BLE001
                v["error"] = _error(exc)
                v["traceback"] = traceback.format_exc()[-3000:]
            v["seconds"] = round(time.perf_counter() - t, 2)
            shutil.rmtree(self.work / f"fp16-{layout}", ignore_errors=True)
        rec["variants"] = variants
        if self.device.type != "cuda":
            rec["note"] = "CPU: torch.amp.GradScaler('cuda') disables itself (scale 1.0)"
        bad = [k for k, v in variants.items() if not v["ok"]]
        if bad:
            rec["ok"], rec["error"] = False, f"failed: {', '.join(bad)}"

    def muon(self, rec: dict[str, Any]) -> None:
        """Muon (trainlab.optim.muon) under FSDP2 in bf16: the sharded hidden matrices
        gathered, orthogonalised by Newton-Schulz in bf16 on the device, sliced back;
        the run completes with finite losses (`loss_fell` says whether the last logged
        loss is below the first: a few steps of Muon move less than AdamW's)."""
        raw = self._raw("fp16", precision="bf16", layout="fsdp", optimizer="muon")
        job = make_job(raw, self.work / "muon", "gpu-check-muon")
        trainer, summary, r = train_run(job, self.device, "fsdp")
        losses = [(w["step"], w["loss"]) for w in r.windows]
        rec.update(
            sharded=_is_sharded(trainer.model),
            losses=losses,
            status=summary.get("status"),
            tokens_per_s=r.windows[-1]["tokens_per_s"] if r.windows else None,
        )
        finite = bool(losses) and all(math.isfinite(x) for _, x in losses)
        rec["loss_fell"] = bool(losses) and losses[-1][1] < losses[0][1]  # information
        rec["ok"] = finite and summary.get("status") == "completed" and rec["sharded"]
        if not rec["ok"]:
            rec["error"] = f"losses {losses}, status {summary.get('status')}"
        del trainer
        shutil.rmtree(self.work / "muon", ignore_errors=True)

    # ---------------------------------------------------------------- (5) the fast path

    def eager_vs_compiled(self, rec: dict[str, Any]) -> None:
        """The 1B run of (1) again with `train.compile: false`: tokens/s and MFU
        eager next to (1)'s, which compiled its blocks (`auto` on CUDA)."""
        raw = self._raw("train", precision="bf16", layout="fsdp", compile="false")
        job = make_job(raw, self.work / "eager", "gpu-check-eager")
        trainer, summary, r = train_run(job, self.device, "fsdp")
        fpt = float(job.plan["flops_per_token"])
        eager = summary.get("tokens_per_s") or (r.windows[-1]["tokens_per_s"] if r.windows else None)
        compiled = (self.train_result.get("summary") or {}).get("tokens_per_s")

        def mfu(tps: Any) -> float | None:
            return fpt * tps / (self.peak_tflops * 1e12) if tps and self.peak_tflops else None

        compile_s = [w.get("compile_time_s") for w in self.train_windows if "compile_time_s" in w]
        rec.update(
            compiled_run="train_bf16_fsdp (train.compile auto: on for CUDA)",
            compiled_on=self.device.type == "cuda",
            tokens_per_s_eager=eager,
            tokens_per_s_compiled=compiled,
            mfu_eager=mfu(eager),
            mfu_compiled=mfu(compiled),
            speedup=round(compiled / eager, 3) if eager and compiled else None,
            compile_time_s=compile_s[0] if compile_s else None,
            peak_bytes_eager=_peak_bytes(self.device),
            peak_bytes_compiled=self.train_result.get("peak_total"),
            status=summary.get("status"),
        )
        del trainer
        shutil.rmtree(self.work / "eager", ignore_errors=True)
        if summary.get("status") != "completed":
            rec["ok"], rec["error"] = False, f"eager run {summary.get('status')!r}"

    def host_syncs(self, rec: dict[str, Any]) -> None:
        """Device-to-host syncs of a step that neither logs, evaluates nor
        checkpoints: torch.cuda.set_sync_debug_mode("warn") on CUDA (each sync
        warns), `aten._local_scalar_dense` under a dispatch mode on CPU (and CUDA)."""
        import warnings

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        from trainlab.train.loop.metrics import launch
        from trainlab.train.loop.trainer import Trainer
        from trainlab.train.parallel.distributed import DistEnv

        class Reads(TorchDispatchMode):
            count = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                if func is torch.ops.aten._local_scalar_dense.default:
                    self.count += 1
                return func(*args, **(kwargs or {}))

        raw = self._raw("resume", precision="bf16", layout="plain")
        raw["train"]["log_interval"] = 1000
        job = make_job(raw, self.work / "syncs", "gpu-check-syncs")
        trainer = Trainer(job, loader_for(job), DistEnv(rank=0, world_size=1, local_rank=0, device=self.device))
        trainer._start()
        stream = trainer.loader.iter_from(0)
        for _ in range(2):
            trainer.train_step(next(stream)[1])
        batches = next(stream)[1]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        reads = Reads()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with reads:
                    loss, norm = trainer.train_step(batches)
                    launch(trainer.env, trainer.step, loss, norm, 0.0, 0.0)
            finally:
                if self.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)]
        rec.update(
            local_scalar_dense=reads.count,
            cuda_sync_warnings=len(syncs) if self.device.type == "cuda" else None,
            examples=syncs[:5],
        )
        del trainer
        shutil.rmtree(self.work / "syncs", ignore_errors=True)
        if reads.count or syncs:
            rec["ok"], rec["error"] = False, f"{reads.count} reads, {len(syncs)} sync warnings"

    def dense_vs_flex(self, rec: dict[str, Any]) -> None:
        """Step time and peak memory of SDPA with the dense mask against FlexAttention
        with the block mask on packed rows (documents of 64-2048 tokens), bf16, at
        4k, 8k and 16k tokens per row; and which SDPA backend runs for the dense
        mask and for plain causal rows. The CPU rehearsal runs forward only
        (FlexAttention has no CPU backward) at 64 and 128 tokens."""
        import torch

        from trainlab.config.schema import ModelConfig
        from trainlab.models import build_model

        cuda = self.device.type == "cuda"
        lengths = (4096, 8192, 16384) if cuda else (64, 128)
        size = self.sizes["fp16"].model
        results: dict[str, Any] = {}
        for seq in lengths:
            row: dict[str, Any] = {}
            g = torch.Generator().manual_seed(seq)
            docs = torch.full((1, seq), -1, dtype=torch.int32)
            at, d = 0, 0
            while at < seq:
                n = int(torch.randint(64 if cuda else 4, 2048 if cuda else 40, (1,), generator=g))
                docs[0, at : at + n] = d
                at, d = at + n, d + 1
            ids = torch.randint(0, size["vocab_size"], (1, seq), generator=g)
            batch = {"input_ids": ids.to(self.device), "document_ids": docs.to(self.device)}
            for impl in ("sdpa", "flex"):
                # The model section alone: on CPU flex is measured forward only, which
                # a training config (flex on CPU: a validate error) would refuse.
                model_cfg = ModelConfig.model_validate(
                    {**size, "arch": "llama", "max_seq_len": seq, "attention": impl}
                )
                torch.manual_seed(0)
                model = build_model(model_cfg).to(self.device)
                times: list[float] = []
                try:
                    _reset_peak(self.device)
                    for _ in range(4):
                        t = time.perf_counter()
                        with torch.autocast(self.device.type, dtype=torch.bfloat16):
                            if cuda:
                                model(**batch).float().mean().backward()
                            else:
                                with torch.no_grad():
                                    model(**batch)
                        if cuda:
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t)
                    row[impl] = {
                        "step_time_s": sorted(times[1:])[len(times[1:]) // 2],
                        "first_s": times[0],
                        "peak_bytes": _peak_bytes(self.device),
                    }
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory at 16k dense
                    row[impl] = {"error": _error(exc)}
                del model
            results[str(seq)] = row
        rec["backward"] = cuda
        rec["by_seq_len"] = results
        rec["sdpa_backends"] = self._sdpa_backends()
        bad = [k for k, r in results.items() if "error" in r.get("flex", {})]
        if bad:
            rec["ok"], rec["error"] = False, f"flex failed at {', '.join(bad)}"

    def moe(self, rec: dict[str, Any]) -> None:
        """model.moe (docs/moe.md): (a) the routed experts' grouped GEMM against the
        per-expert loop it replaces, on this device (CUDA: torch._grouped_mm in
        bf16 under autocast; the CPU rehearsal: fp32 through _GroupedMM): the
        largest difference relative to the output's largest value, and the time of
        a forward+backward of each; (b) a small MoE llama trained by the real
        Trainer on one device (parallel.ep 1), plain layout: finite losses and the
        router metrics logged."""
        import torch

        from trainlab.models.moe.experts import GroupedExperts, grouped_mm_available

        cuda = self.device.type == "cuda"
        hidden, width = (1024, 512) if cuda else (64, 32)
        counts = [384, 256, 192, 128, 64, 32, 16, 0] if cuda else [24, 16, 8, 0]
        torch.manual_seed(0)
        experts = GroupedExperts(len(counts), hidden, width).to(self.device)
        experts.init_weights(0.02, 0.01)
        c = torch.tensor(counts, device=self.device)
        x = torch.randn(sum(counts), hidden, device=self.device, requires_grad=True)

        def autocast() -> Any:
            if cuda:
                return torch.autocast("cuda", dtype=torch.bfloat16)
            return contextlib.nullcontext()

        def timed(forward: Any) -> tuple[float, Any]:
            with autocast():
                forward(x, c).float().sum().backward()  # warm-up
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                with autocast():
                    out = forward(x, c)
                out.float().sum().backward()
            if cuda:
                torch.cuda.synchronize()
            return (time.perf_counter() - t) / 10, out.detach().float()

        with autocast():
            rec["grouped_mm"] = grouped_mm_available(x)
        grouped_s, grouped = timed(experts)
        loop_s, loop = timed(experts.looped_forward)
        rel = float((grouped - loop).abs().max() / loop.abs().max().clamp(min=1e-30))
        rec.update(
            rows_per_expert=counts,
            shape={"hidden": hidden, "expert_width": width},
            grouped_vs_loop_max_rel=rel,
            grouped_s=grouped_s,
            loop_s=loop_s,
            grouped_speedup=loop_s / grouped_s if grouped_s else None,
        )
        raw = self._raw("resume", precision="bf16" if cuda else "fp32", layout="plain")
        h = raw["model"]["hidden_size"]
        raw["model"]["moe"] = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": h // 2}
        job = make_job(raw, self.work / "moe", "gpu-check-moe")
        trainer, summary, r = train_run(job, self.device, "plain")
        losses = [w["loss"] for w in r.windows]
        loads = [w.get("moe/load_max_over_mean") for w in r.windows]
        rec.update(
            train_status=summary.get("status"),
            losses=losses,
            load_max_over_mean=loads,
            tokens_per_s=r.windows[-1]["tokens_per_s"] if r.windows else None,
        )
        tolerance = 2e-2 if cuda else 1e-5  # bf16 rounding vs fp32 summation order
        rec["ok"] = (
            rel <= tolerance
            and rec["grouped_mm"] == cuda
            and summary.get("status") == "completed"
            and bool(losses)
            and all(math.isfinite(v) for v in losses)
            and all(v is not None and v >= 1.0 for v in loads)
        )
        if not rec["ok"]:
            rec["error"] = f"grouped vs loop {rel:.3g}, status {summary.get('status')}, loads {loads}"
        del trainer
        shutil.rmtree(self.work / "moe", ignore_errors=True)

    def hf_architectures(self, rec: dict[str, Any]) -> None:
        """`model.arch: hf:TYPE` on the device (trainlab.models.hf): hf:llama with
        `attention: auto` (transformers' FlexAttention kernel with trainlab's block
        mask on CUDA; SDPA with the dense mask in the CPU rehearsal) and hf:qwen3_moe
        (its experts as one grouped matmul, torch._grouped_mm in bf16 on CUDA). Each:
        the logits of every document of a packed row against the document alone
        (fp32), then a bf16 autocast forward and backward, its peak memory."""
        import torch

        from trainlab.config.schema import ModelConfig
        from trainlab.models import build_model

        size = self.sizes["fp16"].model
        seq = 256 if self.device.type == "cuda" else 64
        lengths = [seq // 4, seq // 2, seq - seq // 4 - seq // 2]
        families = {
            "hf:llama": {},
            "hf:qwen3_moe": {"ffn_hidden_size": 64,
                             "options": {"num_experts": 8, "num_experts_per_tok": 2}},
        }  # fmt: skip
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, size["vocab_size"], (1, seq), generator=g).to(self.device)
        docs = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
        pos = torch.cat([torch.arange(n) for n in lengths])[None].to(self.device)
        docs = docs[None].to(self.device)
        out: dict[str, Any] = {}
        for arch, extra in families.items():
            model_cfg = ModelConfig.model_validate(
                {**size, "arch": arch, "max_seq_len": seq, "attention": "auto", **extra}
            )
            torch.manual_seed(0)
            model = build_model(model_cfg).to(self.device)
            with torch.no_grad():
                packed = model(ids, position_ids=pos, document_ids=docs)
                worst, at = 0.0, 0
                for n in lengths:
                    alone = model(ids[:, at : at + n])
                    worst = max(worst, (packed[:, at : at + n] - alone).abs().max().item())
                    at += n
            _reset_peak(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = model(ids, position_ids=pos, document_ids=docs).float().mean()
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            out[arch] = {
                "attention": getattr(model, "_impl", None),
                "isolation_max_abs": worst,
                "loss": loss.item(),
                "grads_finite": all(bool(torch.isfinite(x).all()) for x in grads),
                "peak_bytes": _peak_bytes(self.device),
            }
            del model
        rec["by_arch"] = out
        bad = [a for a, r in out.items() if r["isolation_max_abs"] > 1e-3 or not r["grads_finite"]]
        if bad:
            rec["ok"], rec["error"] = False, f"documents leak or gradients not finite: {bad}"

    def _sdpa_backends(self) -> dict[str, Any]:
        """Which SDPA backends accept the dense-mask call and the plain causal one
        (bf16, GQA); the dispatcher takes the first of flash, efficient, cudnn,
        math that accepts a call."""
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        q = torch.randn(1, 16, 256, 64, device=self.device, dtype=dtype)
        kv = torch.randn(1, 8, 256, 64, device=self.device, dtype=dtype)
        mask = torch.ones(256, 256, dtype=torch.bool, device=self.device).tril()[None, None]
        out: dict[str, Any] = {}
        for call, kw in (("dense_mask", {"attn_mask": mask}), ("causal", {"is_causal": True})):
            ok = []
            for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
                try:
                    with sdpa_kernel(getattr(SDPBackend, b)):
                        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True, **kw)
                    ok.append(b)
                except Exception:  # noqa: BLE001, S112 - not available for this call
                    continue
            out[call] = {"accepted": ok, "runs": ok[0] if ok else None}
        return out

    # ---------------------------------------------------------------- (4)

    def checkpoint_stall(self, rec: dict[str, Any]) -> None:
        """How long an async checkpoint blocks the loop next to a synchronous save
        of the same state (trainlab.train.loop.checkpointer.begin_save with the
        stager the trainer keeps: pinned host buffers, non-blocking copies on
        CUDA): fp32 weights and two AdamW moments of ~110 M parameters on the
        device (10 M in the rehearsal), one warm-up save, then interleaved
        samples. Target: ratio <= 0.2."""
        import statistics

        import torch

        from trainlab.train.loop.checkpointer import begin_save, host_stager

        n = (10 if self.rehearsal else 110) * 1_000_000 // 8
        state = {
            part: {f"t{i}": torch.randn(n, device=self.device) for i in range(8)}
            for part in ("model", "exp_avg", "exp_avg_sq")
        }
        root = self.work / "stall"
        stager = host_stager()
        sync_s, blocked_s, total_s = [], [], []
        try:
            begin_save(state, str(root / "warm"), True, True, None, stager)(root)
            for i in range(2 if self.rehearsal else 3):
                t0 = time.perf_counter()
                begin_save(state, str(root / f"sync{i}"), False, True)(root)
                sync_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                finish = begin_save(state, str(root / f"async{i}"), True, True, None, stager)
                blocked_s.append(time.perf_counter() - t0)
                finish(root)
                total_s.append(time.perf_counter() - t0)
        finally:
            stager.close()
            shutil.rmtree(root, ignore_errors=True)
        ratio = statistics.median(blocked_s) / statistics.median(sync_s)
        rec.update(
            params=n * 8,
            state_bytes=n * 8 * 3 * 4,
            pinned_memory=self.device.type == "cuda",
            sync_s=[round(x, 3) for x in sync_s],
            async_blocked_s=[round(x, 3) for x in blocked_s],
            async_total_s=[round(x, 3) for x in total_s],
            stall_ratio=round(ratio, 4),
            target="<= 0.2",
        )

    def kill_resume(self, rec: dict[str, Any]) -> None:
        size = self.sizes["resume"]
        n = size.steps
        every, kill = n // 2, n // 2 + n // 4
        rec.update(steps=n, checkpoint_every=every, kill_at_step=kill, deterministic=True)
        precision = "bf16"
        rec["precision"] = precision
        layouts = {}
        workers_left = 6  # three runs per layout, sharing what is left of the budget

        def timeout() -> float:
            nonlocal workers_left
            share = max(20.0, self.remaining() / max(workers_left, 1))
            workers_left -= 1
            return share

        for layout in ("fsdp", "plain"):
            v: dict[str, Any] = {"ok": False}
            layouts[layout] = v
            common = {"precision": precision, "layout": layout, "deterministic": True}
            common.update(every=every, validate=True, eval_every=every)
            ref_raw = self._raw("resume", **common)
            chaos_raw = self._raw("resume", kill_at=(kill,), **common)
            base = self.work / f"resume-{layout}"
            ref = self.worker(
                {"role": "train", "raw": ref_raw, "layout": layout, "run_dir": str(base / "ref")},
                f"{layout}-ref",
                timeout=timeout(),
            )
            killed = self.worker(
                {"role": "train", "raw": chaos_raw, "layout": layout, "run_dir": str(base / "b")},
                f"{layout}-killed",
                timeout=timeout(),
            )
            resumed = self.worker(
                {"role": "train", "raw": chaos_raw, "layout": layout, "run_dir": str(base / "b")},
                f"{layout}-resumed",
                timeout=timeout(),
            )
            rs = (ref.get("result") or {}).get("summary") or {}
            ss = (resumed.get("result") or {}).get("summary") or {}
            v.update(
                reference={k: ref.get(k) for k in ("returncode", "seconds", "error")},
                killed={k: killed.get(k) for k in ("returncode", "seconds", "error")},
                resumed={k: resumed.get(k) for k in ("returncode", "seconds", "error")},
                sharded=(ref.get("result") or {}).get("sharded"),
                reference_weights_sha256=rs.get("weights_sha256"),
                resumed_weights_sha256=ss.get("weights_sha256"),
                reference_final_loss=rs.get("final_loss"),
                resumed_final_loss=ss.get("final_loss"),
                resumed_start_step=ss.get("start_step"),
            )
            v["killed_by_chaos"] = killed.get("returncode") == -9
            v["bitwise_identical"] = bool(rs.get("weights_sha256")) and rs.get(
                "weights_sha256"
            ) == ss.get("weights_sha256")
            v["ok"] = (
                v["bitwise_identical"] and v["killed_by_chaos"] and ss.get("start_step") == every
            )
            if not v["ok"]:
                v["logs"] = {
                    name: w.get("log")
                    for name, w in (("reference", ref), ("killed", killed), ("resumed", resumed))
                }
            shutil.rmtree(base, ignore_errors=True)
        rec["layouts"] = layouts
        bad = [k for k, v in layouts.items() if not v["ok"]]
        if bad:
            rec["ok"], rec["error"] = False, f"not identical or not resumed: {', '.join(bad)}"

    # ---------------------------------------------------------------- workers

    def worker(self, spec: dict[str, Any], name: str, timeout: float) -> dict[str, Any]:
        """Run `spec` in a fresh python process; returns its exit code, time, result, log."""
        spec = {**spec, "device": self.device.type, "result": str(self.work / f"{name}.json")}
        spec_path = self.work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log_path = self.work / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        if self.device.type == "cuda":
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        t = time.perf_counter()
        out: dict[str, Any] = {}
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=str(REPO),
                    timeout=timeout,
                )
                out["returncode"] = proc.returncode
            except subprocess.TimeoutExpired:
                out["returncode"] = None
                out["error"] = f"timed out after {timeout:.0f} s"
        out["seconds"] = round(time.perf_counter() - t, 2)
        result = Path(spec["result"])
        if result.is_file():
            out["result"] = json.loads(result.read_text())
            if "error" in out["result"]:
                out["error"] = out["result"]["error"]
        out["log"] = _tail(log_path)
        return out


def _default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / JSON_NAME if out else REPO / JSON_NAME


# --------------------------------------------------------------------------- worker processes


def run_worker(spec_path: Path) -> int:
    """One role in a fresh process: `train` (a run of the kill-resume step, maybe
    killed by train.chaos) or `trace` (the planner's memory trace)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spec = json.loads(spec_path.read_text())
    result_path = Path(spec["result"])
    try:
        if spec["role"] == "trace":
            import trainlab.train.memtrace as tracing
            from trainlab.config import ExperimentConfig

            cfg = ExperimentConfig.model_validate(spec["raw"])
            if hasattr(tracing, "trace_step"):  # the breakdown plus where the peak was
                res = tracing.trace_step(cfg)
                out = {**jsonable(res.memory)}
                out.update(
                    phase=getattr(res, "phase", None),
                    world_size=getattr(res, "world_size", None),
                    trace_seconds=getattr(res, "seconds", None),
                    tracker_raw=jsonable(getattr(res, "raw", {})),
                    notes=list(getattr(res, "notes", [])),
                )
            else:
                result = jsonable(tracing.trace_memory(cfg))
                out = result if isinstance(result, dict) else {"value": result}
        else:
            import torch

            device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            layout = spec["layout"]
            run_dir = Path(spec["run_dir"])
            job = make_job(spec["raw"], run_dir, "gpu-check-resume")
            ctx = process_group(device) if layout == "fsdp" else contextlib.nullcontext()
            with ctx:
                trainer, summary, _ = train_run(job, device, layout)
                out = {"summary": summary, "sharded": _is_sharded(trainer.model)}
    except Exception as exc:  # noqa: BLE001 - the parent records it
        traceback.print_exc()
        out = {"error": _error(exc)}
        _write_json(result_path, out)
        return 1
    _write_json(result_path, out)
    return 0


# --------------------------------------------------------------------------- entry


def require_cuda() -> None:
    """Exit 2 with one line unless torch sees a CUDA GPU."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        _die(EXIT_NO_GPU, f"gpu-check: no CUDA GPU: torch is not importable ({_error(exc)})")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        _die(
            EXIT_NO_GPU,
            f"gpu-check: no CUDA GPU (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}, torch.cuda.is_available() is False); "
            "run it on a GPU machine, or pass --cpu-rehearsal",
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-rehearsal", action="store_true", help="tiny models on CPU, in seconds")
    p.add_argument("--out", help=f"the JSON (default: $OUT/{JSON_NAME}, else the repo root)")
    p.add_argument("--wheels", default=str(REPO / DEFAULT_WHEELS), help="wheels to install")
    p.add_argument("--site", default=str(REPO / DEFAULT_SITE), help="where to install them")
    p.add_argument("--download-wheels", metavar="DIR", help="`make gpu-wheels`: fetch them")
    p.add_argument("--peak-tflops", type=float, help="device peak bf16 TFLOP/s for MFU")
    p.add_argument("--time-budget", type=float, help="seconds for all steps")
    p.add_argument("--work-dir", help="parent of the scratch folder (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(Path(args.worker))
    if args.download_wheels:
        return download_wheels(Path(args.download_wheels))
    if not args.cpu_rehearsal:
        require_cuda()
    args.installed_wheels = ensure_site(args)  # may start this script again
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
