"""YAML from a user, read with `yaml.safe_load` semantics and bounded.

safe_load runs no code, but a few hundred bytes can still take the machine: nested
anchors (`a: &a [x, x, ...]`, `b: &b [*a, *a, ...]`, ...) compose into a small
graph of shared nodes that everything downstream (merging, validation, printing)
walks as a tree of 9^9 nodes, and a mapping nested 10,000 deep ends in a
RecursionError. The loader here refuses both while composing, before any Python
object is built: too deep a nesting, too many alias uses, too many nodes once
every alias is expanded. The caller turns `YamlLimitError` into a one-line user
error naming the file or flag.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_BYTES = 1 << 20  # a config or sources file: a few KiB in practice
MAX_DEPTH = 64  # nesting of mappings and sequences; real configs use 3-4
MAX_ALIASES = 1_000  # uses of `*anchor`
MAX_NODES = 100_000  # nodes with every alias expanded (what validation walks)


class YamlLimitError(ValueError):
    """The text exceeds one of the bounds; the message says which, without the text."""


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        # (expanded size, height) of each composed node, by id: an alias counts its
        # anchor's whole subtree without walking it again. The nodes stay alive in
        # the tree, so the ids stay theirs.
        self._shape: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        is_alias = self.check_event(AliasEvent)
        if is_alias:
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise YamlLimitError(f"more than {MAX_ALIASES} alias uses (*anchor)")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise YamlLimitError(f"nested deeper than {MAX_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
            if is_alias:
                shape = self._shape.get(id(node))
                if shape is None:  # the anchor is still being composed: `&a [*a]`
                    raise YamlLimitError("an alias inside its own anchor (a cycle)")
            else:
                kids = [self._shape[id(c)] for c in _children(node)]
                shape = (1 + sum(k[0] for k in kids), 1 + max((k[1] for k in kids), default=0))
                self._shape[id(node)] = shape
            # An alias places its anchor's whole subtree here: bound what it expands to.
            if self._depth - 1 + shape[1] > MAX_DEPTH:
                raise YamlLimitError(
                    f"nested deeper than {MAX_DEPTH} levels with its aliases expanded"
                )
            if shape[0] > MAX_NODES:
                raise YamlLimitError(f"more than {MAX_NODES} nodes with its aliases expanded")
        finally:
            self._depth -= 1
        return node


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return node.value
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def load(text: str) -> Any:
    """`yaml.safe_load(text)` within the bounds above; `YamlLimitError` past one,
    `yaml.YAMLError` for a syntax error."""
    if len(text) > MAX_BYTES:
        raise YamlLimitError(f"{len(text)} characters, more than the limit of {MAX_BYTES}")
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
