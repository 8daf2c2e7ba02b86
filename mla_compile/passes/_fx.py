"""FX node helpers shared by the passes: argument lookup, example values, static shapes, the "no match" error."""

from __future__ import annotations

import torch
import torch.fx as fx


class NoMatch(Exception):
    """A site that looks like the pattern but cannot be rewritten; the message says why."""


def arg(node: fx.Node, i: int, name: str, default=None):
    """Argument `i` (positional) or `name` (keyword) of a call node."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def meta_val(node):
    """The example value Dynamo recorded for a node (None if it has none); non-nodes are returned as they are."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def static_shape(node, error: type[Exception] = NoMatch) -> tuple:
    """The node's tensor shape as ints; raises `error` for a non-tensor or a symbolic shape."""
    v = meta_val(node)
    name = getattr(node, "name", node)
    if not isinstance(v, torch.Tensor):
        raise error(f"node {name} is not a tensor")
    shape = tuple(v.shape)
    if not all(isinstance(s, int) for s in shape):
        raise error(f"node {name} has symbolic shape {shape} (dynamic shapes are not rewritten)")
    return shape
