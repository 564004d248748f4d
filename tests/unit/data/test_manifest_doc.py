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


def test_a_swapped_shard_with_an_edited_manifest_does_not_keep_the_fingerprint(dataset, tmp_path):
    """A shard replaced by other data, with its manifest entry (sha256, rows, tokens)
    edited to match, used to pass: the fingerprint was read from the manifest. It
    is recomputed from what the manifest lists, so the manifest is refused; and
    rewriting the fingerprint too gives another dataset, which a resume refuses."""
    from trainlab.data import check_resume
    from trainlab.data.manifest import doc_fingerprint, sha256_of, verify_shards

    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    raw = json.loads((copy / MANIFEST).read_text())
    code, docs = raw["sources"]["code"]["shards"][0], raw["sources"]["docs"]["shards"][0]
    shutil.copy(copy / docs["file"], copy / code["file"])  # foreign data in its place
    code.update(sha256=docs["sha256"], rows=docs["rows"], tokens=docs["tokens"])
    src = raw["sources"]["code"]
    src["tokens"] = sum(s["tokens"] for s in src["shards"])
    src["docs_out"] = sum(s["rows"] for s in src["shards"])
    original = raw["fingerprint"]
    (copy / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(UserError) as e:
        load_manifest(copy)
    assert "fingerprint does not match" in str(e.value) and "\n" not in str(e.value)

    raw["fingerprint"] = doc_fingerprint(ManifestDoc.model_validate(raw))
    (copy / MANIFEST).write_text(json.dumps(raw))
    edited = load_manifest(copy)
    assert edited.fingerprint != original
    with pytest.raises(UserError, match="fingerprint"):
        check_resume(_spec_of(edited), {"fingerprint": original, "step": 3})

    # A tokenizer swapped under an unchanged manifest is caught by the checksums.
    fresh = tmp_path / "ds2"
    shutil.copytree(dataset, fresh)
    (fresh / "tokenizer.json").write_text('{"model": "another"}')
    manifest = load_manifest(fresh)
    assert sha256_of(manifest.location, "tokenizer.json") != manifest.tokenizer_sha256
    with pytest.raises(UserError, match="tokenizer.json: sha256 differs"):
        verify_shards(manifest)


def _spec_of(manifest):
    """The data spec a run reads `manifest` with (its fingerprint is the manifest's)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        fingerprint=manifest.fingerprint, path=str(manifest.root), allow_fingerprint_change=False
    )
