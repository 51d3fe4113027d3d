"""YAML whose aliases cannot expand it: counted when it is parsed, before anything is built.

A YAML alias (``*name``) repeats an anchored node (``&name``) without writing it again, so a
600-byte file of nine levels of nine aliases ("billion laughs") stands for 9**9 nodes. PyYAML
keeps the repetitions shared, but OmegaConf builds every one of them: `launch.py render` on such
a job file, or `train.py +experiment=` on such a config, ran for minutes and gigabytes before the
first check of a key. Here the node graph PyYAML composes (the parse, before any Python object is
built) is counted with each alias expanded, in time linear in the file, and a document whose
aliases add more than `MAX_ALIAS_NODES` nodes to what is written is refused: a `UserError`
naming the file, the count and the limit. An alias inside its own anchor is refused too (nothing
can build it). The few aliases a config uses to share a block load as before.

Every YAML the project reads goes through here: `safe_load` for plain YAML, and
`guard_omegaconf` (run when llmfoundry is imported) adds the check to the loader OmegaConf
makes for `OmegaConf.load`, `OmegaConf.create` of text and dotlists, which is also the one
Hydra's config sources (conf/, ``--config-dir``, ``+experiment=``) read their files with.
"""

from __future__ import annotations

from typing import IO, Any

import yaml

from llmfoundry.utils.errors import UserError

__all__ = ["MAX_ALIAS_NODES", "BoundedAliases", "check_aliases", "guard_omegaconf", "safe_load"]

# Nodes aliases may add to a document: a config sharing a few blocks adds tens to hundreds.
MAX_ALIAS_NODES = 10_000


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_aliases(root: yaml.Node, where: str) -> None:
    """Raise a UserError when the aliases of the document `root` add more than
    `MAX_ALIAS_NODES` nodes, or one refers to a node it is inside of. Each distinct node is
    counted once (its expanded size is kept), so a file of any size is checked in linear time."""
    expanded: dict[int, int] = {}  # id of a node -> its nodes with aliases expanded
    open_nodes: set[int] = set()  # nodes whose children are still being counted
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        key = id(node)
        if counted:
            open_nodes.discard(key)
            expanded[key] = 1 + sum(expanded[id(child)] for child in _children(node))
            continue
        if key in expanded:
            continue
        if key in open_nodes:
            raise UserError(
                f"{where}: the node at line {node.start_mark.line + 1} holds an alias to itself, "
                "which nothing can build; write the value out"
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node))
    added = expanded[id(root)] - len(expanded)
    if added > MAX_ALIAS_NODES:
        raise UserError(
            f"{where}: its YAML aliases (*name) expand it by {added:,} nodes, past the limit of "
            f"{MAX_ALIAS_NODES:,}; write the repeated part out, or refer to it with ${{...}} "
            "interpolation"
        )


class BoundedAliases:
    """A PyYAML loader mixin: `check_aliases` on each document as it is composed, before the
    loader constructs it (``class Loader(BoundedAliases, yaml.SafeLoader)``)."""

    name: str  # the stream's: a file's path, or "<unicode string>"

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()  # type: ignore[misc]
        where = "YAML text" if self.name.startswith("<") else self.name
        check_aliases(node, where)
        return node


class _SafeLoader(BoundedAliases, yaml.SafeLoader):
    pass


def safe_load(stream: str | IO[str], where: str | None = None) -> Any:
    """`yaml.safe_load`, with aliases bounded; `where` names the text in errors (a file's
    name by default)."""
    loader = _SafeLoader(stream)
    if where is not None:
        loader.name = where
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def guard_omegaconf() -> None:
    """Make OmegaConf's YAML loader (and so Hydra's) bound aliases: OmegaConf asks
    `omegaconf._utils.get_yaml_loader` for its loader class at each load (`basecontainer`
    holds its own reference, for dotlists). Idempotent."""
    from omegaconf import _utils, basecontainer

    original = _utils.get_yaml_loader
    if getattr(original, "bounds_aliases", False):
        return

    def get_yaml_loader() -> type:
        return type("AliasBoundedOmegaConfLoader", (BoundedAliases, original()), {})

    get_yaml_loader.bounds_aliases = True  # type: ignore[attr-defined]
    _utils.get_yaml_loader = basecontainer.get_yaml_loader = get_yaml_loader
