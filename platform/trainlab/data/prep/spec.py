"""The sources manifest: which raw files become which named source, and how.

A sources file (YAML, kept in data_prep/sources/) looks like:

    root: ../../data/demo/raw          # optional; relative paths start here
    train_tokenizer: {vocab_size: 8192}  # or `tokenizer: path/to/tokenizer.json`
    cleaning: {min_chars: 16}          # defaults for every source
    dedup: {exact: true, near: {enabled: false, threshold: 0.8, num_perm: 128, ngram: 5}}
    sources:
      - name: code
        paths: ["code/**/*.py"]        # files, directories or globs; s3:// and gs:// too
        format: text                   # one document per file
      - name: docs
        paths: [docs/]
        format: jsonl
        text_field: text
        cleaning: {max_chars: 200000}  # per-source override

Everything is checked here, before any work: a problem raises `UserError`
naming the file, the dotted field and the rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainlab.errors import UserError, clip, field_errors, quote, read_yaml

SOURCE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
DEFAULT_EOS_TOKEN = "<|endoftext|>"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CleaningSettings(_Strict):
    """How a document is cleaned and when it is dropped (lengths in characters,
    measured after cleaning)."""

    # Documents shorter than this (but not empty) are rejected as too_short.
    min_chars: int = Field(1, ge=1, le=1_000_000_000)
    # Documents longer than this are rejected as too_long (never truncated).
    max_chars: int = Field(2_000_000, ge=1, le=2_000_000_000)

    @model_validator(mode="after")
    def _bounds_ordered(self) -> CleaningSettings:
        if self.min_chars > self.max_chars:
            raise ValueError(
                f"min_chars ({self.min_chars}) must be <= max_chars ({self.max_chars})"
            )
        return self


class CleaningOverride(_Strict):
    """Per-source cleaning: any field left out falls back to the file's defaults."""

    min_chars: int | None = Field(None, ge=1, le=1_000_000_000)
    max_chars: int | None = Field(None, ge=1, le=2_000_000_000)


class TokenizerTraining(_Strict):
    """Train a byte-level BPE on the cleaned sources themselves."""

    # At least the 256 byte symbols plus the EOS token and a few merges.
    vocab_size: int = Field(..., ge=260, le=4_294_967_295)
    # Cleaned text the trainer sees, sampled by content hash across all sources
    # in proportion to their size (the whole corpus when it is smaller).
    sample_mb: float = Field(64.0, gt=0, le=100_000)
    # Pairs seen fewer times than this never merge.
    min_frequency: int = Field(2, ge=1, le=1_000_000)


class NearDedupSettings(_Strict):
    """Near-duplicate removal: MinHash signatures of each document's n-grams, LSH
    banding to find candidates, and the signatures' estimated Jaccard similarity
    to confirm them. A document goes when an earlier one (in dedup order) is at
    least `threshold` similar."""

    enabled: bool = False
    # Estimated Jaccard similarity of the two documents' n-gram sets.
    threshold: float = Field(0.8, gt=0, lt=1)
    num_perm: int = Field(128, ge=16, le=1024)
    ngram: int = Field(5, ge=1, le=100)
    # n-grams of words (whitespace-separated) or of characters.
    shingle: Literal["word", "char"] = "word"


class DedupSettings(_Strict):
    """`exact`: drop later copies of a cleaned text (first copy wins, by source order,
    then path, then position); `near`: drop near-copies the same way."""

    exact: bool = True
    near: NearDedupSettings = Field(default_factory=NearDedupSettings)


class SourceSpec(_Strict):
    name: str = Field(..., min_length=1, max_length=100, pattern=SOURCE_NAME_PATTERN)
    # Files, directories (every file below, recursively) or globs (`**` allowed).
    paths: list[Annotated[str, Field(min_length=1)]] = Field(..., min_length=1)
    format: Literal["text", "jsonl", "parquet"]
    # The field (jsonl) or column (parquet) holding the document text.
    text_field: str | None = Field(None, min_length=1)
    cleaning: CleaningOverride = Field(default_factory=CleaningOverride)

    @model_validator(mode="after")
    def _text_field_for_records(self) -> SourceSpec:
        if self.format in ("jsonl", "parquet") and not self.text_field:
            raise ValueError(f"format {self.format} needs text_field (the field holding the text)")
        if self.format == "text" and self.text_field:
            raise ValueError("format text takes no text_field (the whole file is the document)")
        return self


class SourcesFile(_Strict):
    # Base directory for relative paths; itself relative to this file. Default: its folder.
    root: str | None = None
    # A Hugging Face tokenizers JSON file (relative to this file), or ...
    tokenizer: str | None = None
    # ... train one on the sources (exactly one of the two; CLI flags override both).
    train_tokenizer: TokenizerTraining | None = None
    # The token appended to every document; must exist in the tokenizer.
    eos_token: str = Field(DEFAULT_EOS_TOKEN, min_length=1)
    # Target size of one shard, in MB of token ids (uncompressed); cut at document boundaries.
    shard_target_mb: float = Field(64.0, gt=0, le=100_000)
    cleaning: CleaningSettings = Field(default_factory=CleaningSettings)
    dedup: DedupSettings = Field(default_factory=DedupSettings)
    sources: list[SourceSpec] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _unique_names_one_tokenizer(self) -> SourcesFile:
        seen: set[str] = set()
        for s in self.sources:
            if s.name in seen:
                raise ValueError(f"source name {s.name!r} is used twice")
            seen.add(s.name)
        if self.tokenizer and self.train_tokenizer:
            raise ValueError("give either tokenizer or train_tokenizer, not both")
        return self

    def cleaning_for(self, source: SourceSpec) -> CleaningSettings:
        """The effective cleaning settings of one source (its overrides on the defaults)."""
        merged = self.cleaning.model_dump() | source.cleaning.model_dump(exclude_none=True)
        try:
            return CleaningSettings.model_validate(merged)
        except ValidationError as e:
            raise UserError(f"sources[{source.name}].cleaning: {_first_message(e)}") from None


def _first_message(err: ValidationError) -> str:
    return field_errors(err)[0].message


def _format_errors(path: Path, err: ValidationError) -> list[str]:
    lines = []
    for e in field_errors(err):
        if e.kind == "extra_forbidden":
            lines.append(f"{path}: {e.where}: unknown key")
        elif e.kind == "missing":
            lines.append(f"{path}: {e.where}: required")
        else:
            lines.append(f"{path}: {e.where} = {quote(e.value)}: {clip(e.rule)}")
    return lines


def load_sources_file(path: str | Path) -> SourcesFile:
    """Read and validate a sources YAML; every problem raises UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: sources file not found")
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level must be a mapping with a `sources:` list")
    try:
        return SourcesFile.model_validate(data)
    except ValidationError as e:
        raise UserError(_format_errors(path, e)) from None


def resolve_root(sources_path: Path, spec: SourcesFile) -> Path:
    """The directory relative source paths start from."""
    base = sources_path.resolve().parent
    return (base / spec.root).resolve() if spec.root else base


TokenizerChoice = tuple[Literal["file"], Path] | tuple[Literal["train"], TokenizerTraining]


def choose_tokenizer(
    sources_path: Path, spec: SourcesFile, tokenizer: str | None, vocab_size: int | None
) -> TokenizerChoice:
    """CLI flags win over the sources file; exactly one way must be given."""
    if tokenizer and vocab_size:
        raise UserError("give either --tokenizer or --vocab-size, not both")
    if tokenizer:
        return "file", Path(tokenizer)
    if vocab_size:
        base = spec.train_tokenizer.model_dump() if spec.train_tokenizer else {}
        try:
            return "train", TokenizerTraining.model_validate(base | {"vocab_size": vocab_size})
        except ValidationError as e:
            raise UserError(f"--vocab-size {vocab_size}: {_first_message(e)}") from None
    if spec.tokenizer:
        return "file", (sources_path.resolve().parent / spec.tokenizer)
    if spec.train_tokenizer:
        return "train", spec.train_tokenizer
    raise UserError(
        f"{sources_path}: no tokenizer: give --tokenizer PATH or --vocab-size N, "
        "or `tokenizer:` / `train_tokenizer:` in the sources file"
    )
