"""The work directory of an unfinished prep: `DIR/.prep-work/`.

    units/KEY.keys.parquet   a unit's dedup keys          (recorded, reusable)
    units/KEY.docs.arrow     its documents, tokenized     (written last: marks it done)
    run/losers-J.parquet     dedup partition J's losers   (this run only)
    run/kept-I.parquet       unit I's kept rows           (this run only)
    run/sample-I.parquet     unit I's tokenizer sample    (this run only)
    run/tokenizer.json       the tokenizer trained on them (this run only)

KEY is a hash of the unit's inputs (files by location, size and mtime, format,
cleaning) and of every setting its result depends on (tokenizer, EOS, dtype,
dedup settings, library versions). A re-run after a kill reuses a unit whose
KEY it finds done; a changed file or setting changes the KEYs of exactly the
units it touches. `run/` is cleared at the start of every run; the whole
directory is removed when the dataset is finished.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainlab.data.prep.units import WorkUnit

WORK_DIR = ".prep-work"
WORK_FORMAT_VERSION = 2  # 2: documents as Arrow IPC (were Parquet)


class WorkDir:
    def __init__(self, out_dir: Path):
        self.root = (out_dir / WORK_DIR).resolve()
        self.units_dir = self.root / "units"
        self.run_dir = self.root / "run"

    def start_run(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.units_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def unit_key_fn(self, **settings: Any) -> Callable[[WorkUnit], str]:
        """KEY of a unit under these settings."""
        import datasketch
        import pyarrow
        import tokenizers

        base = json.dumps(
            {
                "work_format": WORK_FORMAT_VERSION,
                "settings": settings,
                "versions": [tokenizers.__version__, pyarrow.__version__, datasketch.__version__],
            },
            sort_keys=True,
        )

        def key(unit: WorkUnit) -> str:
            own = [unit.source, unit.format, unit.text_field, unit.min_chars, unit.max_chars]
            blob = f"{base}\x1f{json.dumps(own)}\x1f{unit.inputs}"
            return hashlib.sha256(blob.encode()).hexdigest()[:32]

        return key

    def docs(self, key: str) -> Path:
        return self.units_dir / f"{key}.docs.arrow"

    def keys(self, key: str) -> Path:
        return self.units_dir / f"{key}.keys.parquet"

    def unit_done(self, key: str) -> bool:
        return self.docs(key).is_file() and self.keys(key).is_file()

    def losers(self, partition: int) -> Path:
        return self.run_dir / f"losers-{partition}.parquet"

    def kept(self, unit_index: int) -> Path:
        return self.run_dir / f"kept-{unit_index}.parquet"

    def sample(self, unit_index: int) -> Path:
        return self.run_dir / f"sample-{unit_index}.parquet"

    def tokenizer(self) -> Path:
        return self.run_dir / "tokenizer.json"
