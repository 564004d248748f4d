"""manifest.json is one pydantic model (trainlab.data.manifest.ManifestDoc) for the
writer (prep) and the reader (the loader): what prep writes reads back as the
same document, and a broken one is refused in one line naming the key."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.train_helpers import dataset_dir
from trainlab.data.manifest import MANIFEST, ManifestDoc, load_manifest
from trainlab.errors import UserError


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return dataset_dir(tmp_path_factory)


def test_what_prep_wrote_is_the_document_the_loader_reads(dataset):
    raw = json.loads((dataset / MANIFEST).read_text())
    doc = ManifestDoc.model_validate(raw)
    assert doc.to_json() == raw  # nothing lost or added on the way through the model
    m = load_manifest(dataset)
    assert m.fingerprint == raw["fingerprint"] and set(m.sources) == set(raw["sources"])


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda r: r["sources"]["code"]["shards"][0].pop("sha256"),
         "sources.code.shards.0.sha256: Field required"),
        (lambda r: r["tokenizer"].update(dtype="int8"), "tokenizer.dtype = 'int8'"),
        (lambda r: r.update(format_version=2), "format_version = 2: this trainlab reads 1"),
        (lambda r: r["sources"]["code"].update(tokens=1),
         "sources.code: docs_out/tokens"),
    ],
)  # fmt: skip
def test_a_broken_manifest_is_refused_in_one_line(dataset, tmp_path, break_it, message):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    raw = json.loads((copy / MANIFEST).read_text())
    break_it(raw)
    (copy / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(UserError) as e:
        load_manifest(copy)
    assert message in str(e.value) and "\n" not in str(e.value)
