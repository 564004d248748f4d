"""`trainlab submit`: from a config to a Ray job on a cluster.

validate -> plan (a plan that does not fit is refused) -> stage the working_dir
(size checked) -> connect -> probe: every node sees the prepared data and the
storage -> optional smoke rehearsal (`--smoke`, as a job on the same cluster)
-> submit the training job -> job id; with follow, stream its logs until it
ends and resubmit it after an infrastructure failure (resource.job_retries).
The alert hooks' variables set here travel with the job encrypted, outside its
runtime env (trainlab.hooksecrets).

The job gets the fully resolved config (a YAML file inside the working_dir),
with data.path and train.runs_root made absolute: the job runs in Ray's copy
of the working_dir, and its run and MLflow record must land in this
repository's runs root (or the configured shared storage), not in that copy.
"""

from __future__ import annotations

import functools
import os
import secrets
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab import hooksecrets
from trainlab.errors import UserError
from trainlab.rayjobs import client as jobclient
from trainlab.rayjobs import runtime_env as renv
from trainlab.rayjobs.auth import auth_token
from trainlab.rayjobs.retry import (
    EXIT_INFRASTRUCTURE,
    INFRASTRUCTURE_JOB_ERRORS,
    is_infrastructure_job_failure,
)

TRAIN_SCRIPT = "trainers/pretrain.py"
SUBMITTED_DIR = ".trainlab/submitted"  # inside the staged working_dir
PROBE_TIMEOUT_S = 300.0

Say = Callable[[str], None]


def repo_root(start: Path | None = None) -> Path:
    """The repository the submission comes from: the nearest directory above
    `start` (default: the current one) holding pyproject.toml and trainers/."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file() and (d / "trainers").is_dir():
            return d
    raise UserError(
        f"{here}: not inside a trainlab repository (no pyproject.toml with a "
        "trainers/ folder above it); run trainlab submit from the repository"
    )


@dataclass
class Prepared:
    """A validated, planned config ready to ship; no cluster contacted yet."""

    cfg: Any  # ExperimentConfig with absolute data.path and train.runs_root
    plan: Any
    config_yaml: str
    repo: Path
    storage_uris: list[str]

    @property
    def name(self) -> str:
        return self.cfg.name

    @functools.cached_property
    def run_dir(self) -> str:
        """The run's directory, fixed at submission: {runs_root}/{date}/{name}[-N]. The
        job gets it as --run-dir, so a retried or resubmitted job continues this run."""
        from trainlab.run.dir import new_run_dir

        return str(new_run_dir(self.cfg))


def prepare(config: str, overrides: tuple[str, ...] | list[str], repo: Path) -> Prepared:
    """Validate and plan; refuse what `trainlab train` would refuse before starting (a
    plan that does not fit, a layout it cannot execute, an unknown attention); make
    paths absolute."""
    from trainlab.config import load_config, to_yaml
    from trainlab.config.loader import require_record
    from trainlab.location import locate
    from trainlab.plan import plan, require_fit

    # Paths come back absolute (against the config's repository root), and --set
    # changes to what is trained name the run (config.loader).
    cfg = load_config(config, overrides, name_from_overrides=True)
    require_record(cfg, config, "trainlab submit")
    require_fit(plan(cfg))  # before importing torch below: a plan error is instant
    from trainlab.train.driver.launcher import prepare_layout

    prepare_layout(cfg)  # the trainer's own pre-launch checks, here before any upload
    # Every node must share the runs root (run directories and checkpoints live there)
    # (in object storage, or a filesystem every node mounts).
    shared = [cfg.train.runs_root]
    return Prepared(
        cfg=cfg,
        plan=plan(cfg),
        config_yaml=to_yaml(_code_dir_in_copy(cfg, repo, config)),
        repo=repo,
        storage_uris=[locate(loc, what="train.runs_root").uri for loc in shared],
    )


def _code_dir_in_copy(cfg: Any, repo: Path, config: str) -> Any:
    """The config as the job reads it from the working_dir: a user architecture's
    `model.code_dir` relative to the staged config's folder, so it names the
    job's copy of the repository on whichever node reads it. A folder outside the
    repository does not travel with the job: refused in one line."""
    code_dir = cfg.model.code_dir
    if code_dir is None:
        return cfg
    folder = Path(code_dir).resolve()
    root = repo.resolve()
    if not folder.is_relative_to(root):
        raise UserError(
            f"{config}: model.code_dir = {code_dir!r} is outside the repository {root}: a "
            "submitted job ships the repository only; put the architecture's module in it"
        )
    rel = os.path.relpath(folder, root / SUBMITTED_DIR)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"code_dir": rel})})


def stage_working_dir(prep: Prepared, dest: Path) -> str:
    """Stage the repo (checked against Ray's size limit) plus the resolved config
    into `dest`; return the config's path relative to the working_dir."""
    patterns = renv.exclude_patterns(prep.repo, [prep.cfg.data.path, prep.cfg.train.runs_root])
    pkg = renv.collect(prep.repo, patterns)
    renv.check_size(pkg)
    renv.stage(pkg, dest)
    rel = f"{SUBMITTED_DIR}/{prep.name}.yaml"
    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
    (dest / rel).write_text(prep.config_yaml, encoding="utf-8")
    return rel


def job_runtime_env(repo: Path, working_dir: Path, *, ship_library: bool = True) -> dict[str, Any]:
    """The runtime env of a job from `repo` staged at `working_dir`: the library, the
    forwarded settings, and the repo's git commit and dirty flag (the staged copy has
    no .git, so the job could not tell which code it runs and its MLflow run would
    record the commit as "unknown")."""
    from trainlab.track import git_env

    env = renv.forwarded_env(git_env(repo))
    return renv.build_runtime_env(working_dir, ship_library=ship_library, env_vars=env)


def train_entrypoint(
    config_rel: str, *, run_dir: str | None = None, smoke: bool = False, retries: int = 0
) -> str:
    cmd = ["python", TRAIN_SCRIPT, config_rel]
    cmd += ["--smoke"] if smoke else []
    # The job's own run directory, new: --create (a retry of the job, the same
    # command, continues the run in it; trainlab.run.dir).
    cmd += ["--run-dir", run_dir, "--create"] if run_dir else []
    if retries:
        cmd = ["python", "-m", "trainlab.rayjobs.retry", f"--retries={retries}", "--", *cmd]
    return shlex.join(cmd)


def _job_id(name: str, kind: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    suffix = "" if kind == "train" else f"-{kind}"
    return f"trainlab-{name}{suffix}-{stamp}-{secrets.token_hex(2)}"


@dataclass
class Submission:
    job_id: str
    address: str
    run_dir: str
    status: str | None = None
    exit_code: int = 0

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "job_id": self.job_id,
            "address": self.address,
            "run_dir": self.run_dir,
        }
        if self.status is not None:
            d["status"] = self.status
        return d


class Submitter:
    """One submission to one cluster; keeps the staged working_dir for resubmits."""

    def __init__(
        self,
        prep: Prepared,
        client: Any,
        address: str,
        runtime_env: dict[str, Any],
        config_rel: str,
        say: Say,
    ):
        self.prep, self.client, self.address = prep, client, address
        self.runtime_env, self.config_rel, self.say = runtime_env, config_rel, say

    def _submit(self, entrypoint: str, kind: str) -> str:
        metadata = {
            "trainlab_name": self.prep.name,
            "trainlab_kind": kind,
            "trainlab_run_dir": self.prep.run_dir,
        }
        try:
            return self.client.submit_job(
                entrypoint=entrypoint,
                submission_id=_job_id(self.prep.name, kind),
                runtime_env=self.runtime_env,
                metadata=metadata,
                **renv.entrypoint_options(),
            )
        except RuntimeError as e:  # the job server refused it (bad runtime env, ...)
            raise UserError(
                f"the cluster at {self.address} refused the {kind} job: "
                f"{str(e).strip().splitlines()[0]}"
            ) from None

    def probe(self) -> None:
        """Every node reaches the prepared data and the storage, or UserError."""
        from trainlab.rayjobs.probe import PROBLEM_PREFIX

        cmd = ["python", "-m", "trainlab.rayjobs.probe", "--data", self.prep.cfg.data.path]
        for uri in self.prep.storage_uris:
            cmd += ["--storage", uri]
        job_id = self._submit(shlex.join(cmd), "probe")
        info = jobclient.wait_for(self.client, job_id, timeout_s=PROBE_TIMEOUT_S)
        if _status(info) == "SUCCEEDED":
            return
        logs = self.client.get_job_logs(job_id)
        problems = [
            ln.split(PROBLEM_PREFIX, 1)[1] for ln in logs.splitlines() if PROBLEM_PREFIX in ln
        ]
        if problems:
            raise UserError([f"cluster {self.address}: {p}" for p in problems])
        raise UserError(
            f"cluster {self.address}: the reachability check (job {job_id}) "
            f"failed: {_last_error(info, logs)}"
        )

    def smoke(self) -> None:
        """The config's rehearsal (`--smoke`) as a job on this cluster, or UserError."""
        entry = train_entrypoint(self.config_rel, smoke=True)
        job_id = self._submit(entry, "smoke")
        self.say(f"smoke rehearsal: job {job_id} ...")
        start = time.monotonic()
        info = jobclient.wait_for(self.client, job_id)
        if _status(info) != "SUCCEEDED":
            logs = self.client.get_job_logs(job_id)
            raise UserError(
                f"smoke rehearsal failed (job {job_id}, {_status(info)}): "
                f"{_last_error(info, logs)}; the real job was not submitted"
            )
        self.say(f"smoke rehearsal passed in {time.monotonic() - start:.0f} s")

    def train(self, retries: int) -> str:
        entry = train_entrypoint(self.config_rel, run_dir=self.prep.run_dir, retries=retries)
        return self._submit(entry, "train")

    def follow(self, job_id: str, retries: int, write: Say) -> tuple[str, Any]:
        """Stream the job's logs until it ends; resubmit it when Ray lost its supervisor
        (the in-job retry cannot see that). Returns the last job id and its info."""
        resubmits = 0
        while True:
            info = jobclient.follow(self.client, job_id, write)
            failed_infra = (
                _status(info) == "FAILED" and _error_type(info) in INFRASTRUCTURE_JOB_ERRORS
            )
            if not failed_infra or resubmits >= retries:
                return job_id, info
            resubmits += 1
            self.say(
                f"job {job_id} failed for infrastructure reasons ({info.message}); "
                f"resubmitting ({resubmits}/{retries}), resuming from its checkpoints"
            )
            job_id = self.train(retries - resubmits)
            self.say(f"resubmitted as job {job_id}")


def _status(info: Any) -> str:
    return str(getattr(info.status, "value", info.status))


def _error_type(info: Any) -> str | None:
    et = getattr(info, "error_type", None)
    return str(getattr(et, "value", et)) if et else None


def _last_error(info: Any, logs: str) -> str:
    lines = [ln.strip() for ln in logs.splitlines() if ln.strip()]
    tail = next((ln for ln in reversed(lines) if ln.startswith("error:")), None)
    tail = tail or (lines[-1] if lines else "")
    message = (info.message or "").strip().splitlines()
    return "; ".join(x for x in (message[0] if message else "", tail) if x)[:500]


def exit_code_of(info: Any) -> int:
    """The process exit code for a followed job: 0 when it SUCCEEDED, the driver's
    own exit code when it had one, else 1."""
    status = _status(info)
    if status == "SUCCEEDED":
        return 0
    code = info.driver_exit_code
    if status == "FAILED" and isinstance(code, int) and 0 < code < 256:
        return code
    return EXIT_INFRASTRUCTURE if is_infrastructure_job_failure(_error_type(info), code) else 1


def submit(
    config: str,
    overrides: tuple[str, ...] | list[str] = (),
    *,
    address: str | None = None,
    smoke_first: bool = False,
    follow: bool = False,
    ship_library: bool = True,
    allow_plain_http: bool = False,
    say: Say = print,
    write_logs: Say = print,
) -> Submission:
    """The whole flow; returns the submission (with status when followed).
    `allow_plain_http`: send the token over plain HTTP to another machine
    (trainlab.rayjobs.client.connect)."""
    repo = repo_root()
    url = jobclient.resolve_address(address)  # no network yet: only which cluster
    prep = prepare(config, overrides, repo)
    say(
        f"config ok: {prep.name} ({prep.plan.num_params:,} parameters, "
        f"{prep.plan.strategy} x{prep.plan.world_size}, fits)"
    )
    with tempfile.TemporaryDirectory(prefix="trainlab-submit-") as tmp:
        wd = Path(tmp) / "working_dir"
        config_rel = stage_working_dir(prep, wd)
        carried = hooksecrets.stage_for_job(
            wd, prep.cfg.tracking.alerts.secret_env_names(), auth_token()
        )
        if carried:
            say(f"alert hook variables carried to the job, encrypted: {', '.join(carried)}")
        runtime_env = job_runtime_env(repo, wd, ship_library=ship_library)
        client = jobclient.connect(url, allow_plain_http=allow_plain_http)
        sub = Submitter(prep, client, url, runtime_env, config_rel, say)
        say(
            f"checking that every node of {url} reaches {prep.cfg.data.path} "
            f"and shares {', '.join(prep.storage_uris)} ..."
        )
        sub.probe()
        if smoke_first:
            sub.smoke()
        retries = prep.cfg.resource.job_retries
        job_id = sub.train(retries)
        result = Submission(job_id=job_id, address=url, run_dir=prep.run_dir)
        say(f"submitted job {job_id} to {url}; run directory {prep.run_dir}")
        if follow:
            job_id, info = sub.follow(job_id, retries, write_logs)
            result.job_id, result.status = job_id, _status(info)
            result.exit_code = exit_code_of(info)
            say(f"job {job_id} {result.status}")
        for line in next_steps(result, prep):
            say(line)
        return result


def next_steps(result: Submission, prep: Prepared) -> list[str]:
    """What to run next, as commands that work from here: watch or stop a job not
    followed; look at the record of one that ran."""
    from trainlab.rayjobs.localcluster import trainlab_command

    tl = trainlab_command()
    at = "" if _default_address() == result.address else f" --address {result.address}"
    runs_root = prep.cfg.train.runs_root
    at_runs = "" if Path(runs_root) == prep.repo / "runs" else f" --runs-root {runs_root}"
    experiment = prep.cfg.tracking.experiment or prep.name
    record = f"{tl} runs{at_runs}   |   {tl} compare{at_runs} --experiment {experiment}"
    if result.status is None:
        ray = trainlab_command("ray")
        return [
            f"  status:  {tl} jobs{at}",
            f"  logs:    RAY_AUTH_MODE=token {ray} job logs --follow "
            f"--address {result.address} {result.job_id}",
            f"  stop:    {tl} stop {result.job_id}{at}",
            f"  record:  {record}",
        ]
    if result.status == "SUCCEEDED":
        return [f"  record:  {record}", f"  run:     {result.run_dir}"]
    return [
        f"  run:     {result.run_dir} (logs/, failures in logs/failures.jsonl)",
        f"  jobs:    {tl} jobs{at}",
    ]


def _default_address() -> str | None:
    try:
        return jobclient.resolve_address(None)
    except UserError:
        return None
