"""`make demo`: the main job on the embedded default (local Ray, local MLflow).

build the demo corpus -> prepare it (Ray Data) -> train the tiny recipe with
2 DDP workers (Ray Train) -> print where the run, its checkpoints and its
MLflow record are, and how to compare it with other runs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

RECIPE = Path("trainers/recipes/tiny.yaml")


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def main() -> int:
    from devtools.demo_corpus import prepare_demo
    from trainlab.config import load_config
    from trainlab.errors import UserError
    from trainlab.plan import plan
    from trainlab.track import tracking_uri
    from trainlab.train import TrainingFailed, run

    t0 = time.time()
    cfg = load_config(RECIPE)
    p = plan(cfg)
    say(
        f"config {RECIPE}: {cfg.name}, {p.num_params:,} parameters, {p.strategy} over "
        f"{p.parallel['dp']} workers, {p.tokens_per_step:,} tokens/step, fits={p.fits}"
    )

    say("building the demo corpus (stdlib code, Python docs, package READMEs) and preparing it")
    prep = prepare_demo(".")
    m = prep.manifest
    sizes = ", ".join(f"{n} {s['tokens']:,} tokens" for n, s in m["sources"].items())
    say(f"prepared {prep.out_dir} ({'up to date' if prep.up_to_date else 'built'}): {sizes}")

    say(f"training {cfg.name} on the local Ray cluster ({cfg.train.total_steps} steps)")
    try:
        summary = run(cfg)
    except TrainingFailed as e:
        say(f"training failed: {e.summary.get('error')}")
        return 1
    except UserError as e:
        for line in e.lines:
            say(f"error: {line}")
        return 2
    run_dir = Path(summary["run_dir"])
    val = summary["val_loss"]
    say(
        f"done in {time.time() - t0:.0f} s: status {summary['status']}, step "
        f"{summary['final_step']}, loss {summary['final_loss']:.3f}, val loss "
        f"{'-' if val is None else f'{val:.3f}'}, {summary['tokens_seen']:,} tokens, "
        f"{summary['restarts']} restart(s)"
    )
    say(f"run directory:  {run_dir}")
    say(f"checkpoints:    {run_dir / 'checkpoints'} (last {summary['last_checkpoint']})")
    say(f"MLflow store:   {tracking_uri(str(Path(cfg.train.runs_root).resolve()))}")
    say("compare runs:   .venv/bin/trainlab compare --experiment tiny")
    say("MLflow UI:      .venv/bin/trainlab ui   (then open http://127.0.0.1:5000)")
    return 0 if summary["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
