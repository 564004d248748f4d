"""Reading experiment configs: `extends` chains, `--set` overrides, error reporting.

Nothing else in trainlab reads raw YAML for an experiment: every command goes
through `load_config`, which either returns a fully validated
`ExperimentConfig` or raises `ConfigError` listing every problem, one per line.
"""

from __future__ import annotations

import copy
import difflib
import errno
import hashlib
import json
import logging
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainlab import boundedyaml
from trainlab.config.jobcopy import is_relative, relative_in_copy, uploaded_copy
from trainlab.config.rules import Problem, check_rules, resolve_parallel_defaults
from trainlab.config.schema import SECTIONS, UNION_TAGS, ExperimentConfig
from trainlab.errors import ConfigError, clip, field_errors, quote, read_yaml
from trainlab.redact import redact

log = logging.getLogger("trainlab.config")

EXTENDS_KEY = "extends"
# What an experiment is and why: each file says it for itself, never inherited.
NOT_INHERITED = ("name", "purpose", "expectation")


# --------------------------------------------------------------------------- YAML + extends


NOT_A_CONFIG = "not a trainlab config"
# What a config file's top level may hold: the schema's sections and fields, and extends.
TOP_KEYS = frozenset({*ExperimentConfig.model_fields, EXTENDS_KEY})
# A key a person could have meant as one of them (a typo), not a line of another file.
_KEY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,99}\Z")


def _read_yaml_mapping(path: Path, extended: bool = False) -> dict[str, Any]:
    """The mapping in the config file `path`. A file that is not one, does not parse
    or holds no config sections (/etc/shadow: every line a key) is one line saying it
    is not a trainlab config, quoting nothing of it. An extended file with a typo in
    a key is named here with the key (never a value): validation would report it
    under the top file's name."""
    data = read_yaml(path, ConfigError, what="a trainlab config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: {NOT_A_CONFIG} (top level must be a mapping of config sections, "
            f"got {type(data).__name__})"
        )
    unknown = [k for k in data if k not in TOP_KEYS]
    if not unknown:
        return data
    if len(unknown) == len(data) or not all(
        isinstance(k, str) and _KEY_NAME.match(k) for k in unknown
    ):
        raise ConfigError(f"{path}: {NOT_A_CONFIG} (its top-level keys are not config sections)")
    if extended:
        lines = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(TOP_KEYS), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"{path}: {key!r}: unknown key{hint}")
        raise ConfigError(lines)
    return data  # the top file's typos: validation names each


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge `override` into `base` key by key. Mappings merge recursively, other
    values replace; a `null` in the override removes the key (back to its default)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_raw(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The merged raw mapping of `path` and everything it extends (regular files
    only: `trainlab.errors.read_user_file`)."""
    path = Path(path)
    source = f" (extended from {_chain[-1]})" if _chain else ""
    try:
        resolved = path.resolve(strict=True)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found{source}") from None
    except RuntimeError:  # pathlib's word for ELOOP before Python 3.13
        raise ConfigError(f"{path}: symlink loop{source}") from None
    except OSError as e:
        why = "symlink loop" if e.errno == errno.ELOOP else f"cannot read ({e.strerror or e})"
        raise ConfigError(f"{path}: {why}{source}") from None
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise ConfigError(f"{path}: extends cycle: {cycle}")
    data = _read_yaml_mapping(path, extended=bool(_chain))
    parent = data.pop(EXTENDS_KEY, None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{path}: extends = {quote(parent)}: must be a path to a YAML file")
    parent_path = resolved.parent / parent
    base = load_raw(parent_path, (*_chain, resolved))
    for key in NOT_INHERITED:
        base.pop(key, None)
    # A relative path means the same in the file that wrote it and in every file
    # extending it: a personal config outside the repository that extends a recipe
    # gets the recipe's data.path and runs_root of the recipe's repository, not of
    # its own folder. (Within one repository every file has the same anchor: the
    # paths stay relative here and `load_config` anchors them.)
    with_parent = _existing(parent_path)
    if with_parent is not None and config_anchor(with_parent) != config_anchor(resolved):
        _anchor_given(base, config_anchor(with_parent))
    return deep_merge(base, data)


def _existing(path: Path) -> Path | None:
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError):
        return None


def _anchor_given(raw: dict[str, Any], anchor: Path) -> None:
    """The relative local paths `raw` gives (PATH_KEYS), made absolute against
    `anchor`, in place; keys it leaves out stay out (their defaults are anchored
    at the top file's)."""
    for section, key in PATH_KEYS:
        node = raw.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key]:
            raw[section] = {**node, key: anchor_path(node[key], anchor)}


# --------------------------------------------------------------------------- --set


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.lr=1e-4` -> (["train", "lr"], 0.0001). The value is parsed as YAML,
    within the bounds of a config file (`trainlab.boundedyaml`)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {quote(item)}: expected KEY=VALUE, e.g. --set train.lr=1e-4")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"--set {quote(item)}: empty part in key {quote(key)}")
    if len(raw) > boundedyaml.MAX_BYTES:  # the bound of a config file, text or YAML
        raise ConfigError(
            f"--set {quote(item)}: value refused: {len(raw)} characters, more than the "
            f"limit of {boundedyaml.MAX_BYTES}"
        )
    if _text_field(parts) and raw.strip() != "null":  # `null`: back to the default
        # A string field takes the text as written (YAML would read "loss goes down:
        # below 8.5" as a mapping).
        return parts, raw
    try:
        value = boundedyaml.load(raw) if raw.strip() else ""
    except boundedyaml.YamlLimitError as e:
        raise ConfigError(f"--set {quote(item)}: value refused: {e}") from None
    except yaml.YAMLError as e:
        problem = clip(getattr(e, "problem", None) or str(e).splitlines()[0])
        raise ConfigError(f"--set {quote(item)}: value is not valid YAML ({problem})") from None
    return parts, value


def _text_field(parts: list[str]) -> bool:
    """Whether the schema's field at `parts` is a string (or a string or null);
    other fields (lists, numbers, sections) take their value as YAML."""
    try:
        annotation = _annotation(tuple(parts))
    except (KeyError, AttributeError, IndexError):
        return False
    return annotation is str or set(typing.get_args(annotation)) == {str, type(None)}


# Fields that take an int or a {min, max} range (trainlab.config.schema.WorkerRange).
RANGE_FIELDS = {("resource", "num_workers")}


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if tuple(parts[: i + 1]) in RANGE_FIELDS and isinstance(child, int):
                # `--set resource.num_workers.min=2` over `num_workers: 3`: the range
                # {min: 2, max: 3}, the other bound kept at the fixed size.
                child = node[part] = {"min": child, "max": child}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"--set {quote(item)}: {where} is {quote(child)}, not a section")
            node = child
        if value is None:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
    return out


# --------------------------------------------------------------------------- validation


def _tagged_classes(annotation: Any) -> dict[str, type[BaseModel]]:
    """{tag: class} of a discriminated union of sections chosen by `name`
    (train.optimizer), else {}."""
    out = {}
    for arg in typing.get_args(annotation):
        for cls in typing.get_args(arg) or (arg,):
            if isinstance(cls, type) and issubclass(cls, BaseModel) and "name" in cls.model_fields:
                out[cls.model_fields["name"].default] = cls
    return out


def _walk(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], type[BaseModel] | None]:
    """`loc` as the user writes it (pydantic puts a union member's tag in the path:
    train.optimizer.muon.momentum is train.optimizer.momentum), and the section
    class it ends in (None: not a section, or not known)."""
    model: type[BaseModel] | None = ExperimentConfig
    out: list[Any] = []
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        out.append(part)
        field = model.model_fields.get(str(part)) if model is not None else None
        if field is None:
            out += parts
            return tuple(out), None
        ann = field.annotation
        if parts and parts[0] in UNION_TAGS:  # pydantic's label of a union member
            parts.pop(0)
        tagged = _tagged_classes(ann)
        if tagged:
            model = tagged[parts.pop(0)] if parts and parts[0] in tagged else None
            continue
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return tuple(out), model


def _field_names(loc: tuple[Any, ...]) -> list[str]:
    """Known keys at `loc` in the schema, for "did you mean"."""
    model = _walk(loc)[1]
    return list(model.model_fields) if model is not None else []


def suggest(name: str, known: list[str]) -> str | None:
    """The known key a mistyped `name` most likely means: one that `name` extends
    by a word (`lr_rate` -> `lr`, the longest such), else the closest spelling."""
    words = [k for k in known if name.startswith(k + "_") or name.endswith("_" + k)]
    if words:
        return max(words, key=len)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return close[0] if close else None


def _problems_from(err: ValidationError, prefix: tuple[Any, ...] = ()) -> list[Problem]:
    problems = []
    for e in field_errors(err, prefix):
        loc, _ = _walk(e.loc)
        where = ".".join(map(str, loc))
        if e.kind == "extra_forbidden":
            close = suggest(str(loc[-1]), _field_names(e.loc[:-1]))
            hint = f"; did you mean {'.'.join(map(str, (*loc[:-1], close)))!r}?" if close else ""
            problems.append(Problem(where, e.value, f"unknown key{hint}"))
        elif e.kind == "union_tag_invalid":
            tags = sorted(_tagged_classes(_annotation(loc)))
            tag = e.value.get("name") if isinstance(e.value, dict) else None
            close = difflib.get_close_matches(str(tag), tags, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                Problem(f"{where}.name", tag, f"unknown name; {hint}known: {', '.join(tags)}")
            )
        elif e.kind == "missing":
            problems.append(Problem(where, None, "required"))
        elif e.kind == "value_error" and len(loc) == len(prefix):
            continue  # a cross-field ValueError: reported by check_rules instead
        else:
            problems.append(Problem(where, e.value, e.rule))
    return problems


def _annotation(loc: tuple[Any, ...]) -> Any:
    """The schema's annotation of the field at `loc` (a user's path)."""
    parent = _walk(loc[:-1])[1]
    field = parent.model_fields.get(str(loc[-1])) if parent is not None else None
    return field.annotation if field is not None else None


def _line(p: Problem) -> str:
    """`Problem.format` with the value quoted short and the rule clipped (a rule's
    message may embed the value): a 10 MB value never becomes a 10 MB line."""
    return f"{clip(p.path, 200)} = {quote(p.value)}: {clip(p.rule)}"


def validate_raw(raw: dict[str, Any], source: str | None = None) -> ExperimentConfig:
    """Validate a merged raw mapping; raise ConfigError listing every problem,
    each line prefixed with `source` (the config file) when given."""
    prefix = f"{source}: " if source else ""
    raw = fold_storage(raw, prefix)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        problems = _problems_from(err)
    # Cross-field rules over the sections that are valid on their own, so one broken
    # section does not hide the rule violations of the others.
    typed: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        section = raw.get(name, {})
        if not isinstance(section, dict):
            continue
        try:
            typed[name] = cls.model_validate(section)
        except ValidationError:
            continue
    if "parallel" in typed and "resource" in typed:
        resolve_parallel_defaults(typed["parallel"], typed["resource"])
    problems += check_rules({k: v.model_dump() for k, v in typed.items()})
    unique = dict.fromkeys(_line(p) for p in problems)
    raise ConfigError([prefix + line for line in unique])


STORAGE_FOLDED = (
    "resource.storage is folded into train.runs_root: a run and its checkpoints live "
    "there (a path every node sees, or s3://bucket/prefix), each node's disk is only a "
    "cache (resource.scratch_dir)"
)


def fold_storage(raw: dict[str, Any], prefix: str = "", runs_root_given: bool = True) -> dict:
    """`resource.storage` (a copy target for checkpoints, before runs could live in
    object storage) is read as `train.runs_root` when that is not given; both
    given and different is an error saying which one to keep."""
    resource = raw.get("resource")
    if not isinstance(resource, dict) or "storage" not in resource:
        return raw
    storage = resource["storage"]
    rest = {k: v for k, v in resource.items() if k != "storage"}
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    if storage is None:
        return {**raw, "resource": rest}
    if runs_root_given and "runs_root" in train and train["runs_root"] != storage:
        raise ConfigError(
            f"{prefix}resource.storage = {redact(str(storage))!r} and train.runs_root = "
            f"{train['runs_root']!r}: {STORAGE_FOLDED}; keep only train.runs_root"
        )
    log.warning("%s%s; reading resource.storage as train.runs_root", prefix, STORAGE_FOLDED)
    return {**raw, "resource": rest, "train": {**train, "runs_root": storage}}


def load_config(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    name_from_overrides: bool = False,
) -> ExperimentConfig:
    """Read `path` (following `extends`), apply `--set` overrides, validate.

    `name` defaults to the file's stem and `tracking.experiment` to the recipe
    family (the top-level file's stem), so variants made with `--set` stay in
    their family's MLflow experiment. With `name_from_overrides` (a new run, not
    a resume), overrides of what is trained rename the run to say so
    (`override_name`). Relative paths become absolute against the config's
    anchor (`config_anchor`), so no path depends on the current directory.
    """
    path = Path(path)
    raw = load_raw(path)
    raw.setdefault("name", path.stem)
    tracking = raw.setdefault("tracking", {})
    if isinstance(tracking, dict):
        tracking.setdefault("experiment", path.stem)
    raw = apply_overrides(raw, overrides)
    train = raw.get("train")
    raw = fold_storage(raw, f"{path}: ", runs_root_given=isinstance(train, dict) and "runs_root" in train)
    if name_from_overrides and isinstance(raw.get("name"), str):
        raw["name"] = override_name(raw["name"], overrides)
    anchor_paths(raw, config_anchor(path))
    anchor_code_dir(raw, path)
    return validate_raw(raw, source=str(path))


def anchor_code_dir(raw: dict[str, Any], config_file: Path) -> None:
    """Where `model.arch: MODULE:NAME` is imported from, made absolute in place:
    a relative `model.code_dir` is relative to the config file's folder; without
    one, that folder, or the repository root when MODULE is there and not beside
    the config (trainlab.models.user)."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("arch"), str):
        return
    arch = model["arch"]
    if ":" not in arch or arch.startswith("hf:"):
        return
    folder = config_file.resolve().parent
    given = model.get("code_dir")
    if isinstance(given, str) and given:
        model["code_dir"] = os.path.normpath(folder / Path(given).expanduser())
        return
    if given is not None:
        return  # a wrong type: validation reports it
    first = arch.partition(":")[0].split(".")[0]
    root = config_anchor(config_file)
    beside = any((folder / name).exists() for name in (first, f"{first}.py"))
    in_root = any((root / name).exists() for name in (first, f"{first}.py"))
    model["code_dir"] = str(root if in_root and not beside else folder)


RECORD_REQUIRED = ("purpose", "expectation")


def require_record(cfg: ExperimentConfig, source: str, command: str) -> None:
    """Refuse a real run (`trainlab train` without --smoke, `trainlab submit`) whose
    config does not say why it runs and what it should show: the record a run
    leaves is only comparable with both. validate, plan and --smoke do not ask."""
    missing = [k for k in RECORD_REQUIRED if not str(getattr(cfg, k)).strip()]
    if missing:
        raise ConfigError(
            f"{source}: {' and '.join(missing)}: required for {command} (say why the run "
            "exists and what result you expect, in the config or with --set "
            f"{missing[0]}=...); optional for validate, plan and train --smoke"
        )


# --------------------------------------------------------------------------- paths

# The config keys holding a local path (or a URL, left as it is).
PATH_KEYS = (("data", "path"), ("train", "runs_root"))
ANCHOR_MARKERS = (".git", "pyproject.toml")


def config_anchor(config_file: str | Path) -> Path:
    """What relative paths in a config file are relative to: the repository root of
    the file (the nearest directory at or above it holding .git or pyproject.toml),
    or, outside any repository, the file's own directory. Never the current
    directory: the same config means the same paths wherever it is run from."""
    start = Path(config_file).resolve().parent
    return project_root(start) or start


def project_root(start: str | Path | None = None) -> Path | None:
    """The project (repository) at or above `start` (default: the current
    directory): the nearest directory holding .git or pyproject.toml; None outside
    any. What a command without a config (`trainlab runs` from notebooks/) takes
    its default paths from, as a config's paths are anchored (`config_anchor`)."""
    here = Path(start if start is not None else Path.cwd()).resolve()
    for d in (here, *here.parents):
        if any((d / marker).exists() for marker in ANCHOR_MARKERS):
            return d
    return None


def anchor_path(value: str, anchor: Path) -> str:
    """`value` as an absolute local path (`~` expanded, relative to `anchor`); a URL
    (`s3://...`) as it is (trainlab.location.anchored)."""
    from trainlab.location import anchored

    return anchored(value, anchor)


def anchor_paths(raw: dict[str, Any], anchor: Path) -> None:
    """Make every local path of a raw config absolute against `anchor`, in place;
    a key left out gets its schema default anchored too (the record shows where).
    Inside a Ray job's uploaded working dir a relative path is refused (jobcopy)."""
    copy, problems = uploaded_copy(anchor), []
    for section, key in PATH_KEYS:
        node = raw.get(section, {})
        if not isinstance(node, dict):
            continue  # a wrong type: validation reports it
        value = node.get(key, _default(section, key))
        if isinstance(value, str) and value:
            if copy is not None and is_relative(value):
                problems.append(relative_in_copy(f"{section}.{key}", value, copy))
            raw[section] = {**node, key: anchor_path(value, anchor)}
    if problems:
        raise ConfigError(problems)


def _default(section: str, key: str) -> Any:
    return SECTIONS[section].model_fields[key].default


# --------------------------------------------------------------------------- run names

NAME_MAX = 80  # under the schema's 100, leaving room for suffixes such as `-smoke`
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")
# Short labels of the keys people set most, so names fit a table's column:
# `tiny --set train.total_steps=20 --set train.eval_interval=10` is
# `tiny_steps-20_eval-10`, not `tiny_total_steps-20_eval_interval-10`.
LABELS = {
    "total_steps": "steps",
    "eval_interval": "eval",
    "log_interval": "log",
    "warmup_steps": "warmup",
    "micro_batch_size": "mbs",
    "global_batch_size": "gbs",
    "grad_accum_steps": "accum",
    "hidden_size": "d",
    "num_layers": "layers",
    "num_heads": "heads",
    "num_kv_heads": "kv_heads",
    "ffn_hidden_size": "ffn",
    "expert_ffn_hidden_size": "expert_ffn",
    "num_experts": "experts",
    "seq_len": "seq",
    "weight_decay": "wd",
    "min_lr_ratio": "min_lr",
    "vocab_size": "vocab",
}


def abbreviated(name: str) -> str:
    """A run name of an earlier version (`tiny_total_steps-20`) as this version
    names it (`tiny_steps-20`), so `--resume` with the same flags finds it."""
    for long, short in LABELS.items():
        name = re.sub(rf"_{long}(?=-|_|$)", f"_{short}", name)
    return name


def override_name(name: str, overrides: list[str] | tuple[str, ...]) -> str:
    """The name of a run that changes its config with `--set`: `tiny` with
    `--set train.lr=1e-3` is `tiny_lr-1e-3`. Each override of what is trained adds
    `_{last key part}-{value as typed}` in the order given, filesystem-safe, with
    the short labels of LABELS (`train.total_steps=20`: `_steps-20`); an
    explicit `--set name=...`, and overrides that do not change what is trained
    (layout, resources, paths, record, tracking), leave the name alone. Too long
    a name keeps its head and ends in a hash of the whole, so it stays unique
    and deterministic."""
    parts = []
    for item in overrides:
        keys, _ = parse_override(item)
        if keys == ["name"]:
            return name
        if not _is_identity_key(keys) or tuple(keys) in PATH_KEYS:
            continue  # not what is trained, or where (a path says nothing about it)
        value = _UNSAFE.sub("-", item.partition("=")[2]).strip("-.")
        # A section chosen by name (train.optimizer.name=muon) reads as the section.
        label = keys[-2] if keys[-1] == "name" and len(keys) > 1 else keys[-1]
        label = LABELS.get(label, label)
        parts.append(f"{label}-{value}" if value else label)
    if not parts:
        return name
    full = "_".join([name, *parts])
    if len(full) <= NAME_MAX:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:8]
    return f"{full[: NAME_MAX - 9].rstrip('-._')}-{digest}"


def _is_identity_key(keys: list[str]) -> bool:
    """Whether the config key `keys` is part of the experiment's identity."""
    if keys[0] not in _NOT_IDENTITY:
        return True
    skip = _NOT_IDENTITY[keys[0]]
    return skip is not None and len(keys) > 1 and keys[1] not in skip


# --------------------------------------------------------------------------- identity

def _marked(field: Any) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("identity") is False


def _not_identity() -> dict[str, set[str] | None]:
    """{section: None (the whole section) | its fields} that are not part of the
    experiment's identity: the fields the schema marks NOT_IDENTITY. The parallel
    layout and the resources are not either: a run resumes at another layout (the
    checkpoint reshards) as long as each step still sees the same global batch,
    which identity_dict states explicitly in place of how it is split."""
    out: dict[str, set[str] | None] = {}
    for name, field in ExperimentConfig.model_fields.items():
        if _marked(field):
            out[name] = None
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sub = {n for n, f in ann.model_fields.items() if _marked(f)}
            if sub:
                out[name] = sub
    return out


_NOT_IDENTITY = _not_identity()


# model.attention names that compute the same causal, document-masked attention
# with different kernels (a registered attention of another name may not).
SAME_MATH_ATTENTION = frozenset({"auto", "sdpa", "flex", "eager"})


def identity_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    d = cfg.model_dump(mode="json")
    for key, sub in _NOT_IDENTITY.items():
        if sub is None:
            d.pop(key, None)
        else:
            for k in sub:
                d[key].pop(k, None)
    d["data"]["global_batch_size"] = cfg.global_batch_size  # however it is split
    if d["model"].get("attention") in SAME_MATH_ATTENTION:
        # Kernels of the same attention (docs/gpu.md): how it runs, not what is
        # trained; recorded as sdpa, the default before `auto`, so runs started
        # before it keep their hash and resume.
        d["model"]["attention"] = "sdpa"
    if d["model"].get("moe") is None:
        d["model"].pop("moe", None)  # dense: the hash of before model.moe existed
    if not d["train"].get("components"):
        d["train"].pop("components", None)  # none: the hash of before they existed
    optimizer = d["train"].pop("optimizer")
    if optimizer["name"] == "adamw":
        # AdamW's fields where they were before train.optimizer existed: the same
        # experiment keeps its hash, so its runs and checkpoints still resume.
        optimizer.pop("name")
        d["train"].update(optimizer)
    else:
        d["train"]["optimizer"] = optimizer
    return d


def config_hash(cfg: ExperimentConfig) -> str:
    """Stable hash of what the experiment trains (not of its name or run settings)."""
    blob = json.dumps(identity_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def identity_diff(old: ExperimentConfig, new: ExperimentConfig) -> dict[str, tuple[Any, Any]]:
    """The flattened identity keys on which two configs differ: {key: (old, new)}
    (a key one of them lacks reads as None), sorted by key."""
    a, b = flatten(identity_dict(old)), flatten(identity_dict(new))
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def to_yaml(cfg: ExperimentConfig) -> str:
    """The fully resolved config as YAML; loading it back gives the same config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"data": {"mix": {"code": 0.3}}} -> {"data.mix.code": 0.3}; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
