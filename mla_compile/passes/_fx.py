"""FX node helpers shared by the passes: argument lookup, example values, static shapes, the "no match" error,
the `Builder` that inserts nodes with their example values, and the end of an edit (`finish_edits`)."""

from __future__ import annotations

import operator

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


def val(node):
    """meta_val that must exist."""
    v = meta_val(node)
    if v is None:
        raise NoMatch(f"node {node.name} has no example_value metadata")
    return v


class Builder:
    """Inserts call_function nodes before an anchor and fills their `example_value` under the graph's fake
    mode (Inductor's pre-grad passes and our own matcher read it)."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode, meta_from: fx.Node):
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode
        self.created: list[fx.Node] = []
        self.meta = {k: meta_from.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack")
                     if k in meta_from.meta}

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, tuple(args), dict(kwargs))
        self.created.append(node)
        node.meta.update(self.meta)

        def fake(a):
            return val(a) if isinstance(a, fx.Node) else a

        fargs = fx.node.map_aggregate(args, fake)
        fkwargs = fx.node.map_aggregate(kwargs, fake)
        modes = [t.fake_mode for t in _flatten(fargs) + _flatten(fkwargs) if hasattr(t, "fake_mode")]
        mode = modes[0] if modes else self.fake_mode
        with mode:
            node.meta["example_value"] = target(*fargs, **fkwargs)
        return node

    def item(self, node, i) -> fx.Node:
        return self.call(operator.getitem, node, i)

    def rollback(self) -> None:
        """Erase every node this builder inserted (the site is then exactly as before)."""
        for n in reversed(self.created):
            if not getattr(n, "_erased", False):
                self.graph.erase_node(n)
        self.created.clear()


def _flatten(x) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def graph_of(gm: fx.GraphModule | fx.Graph) -> fx.Graph:
    return gm if isinstance(gm, fx.Graph) else gm.graph


def finish_edits(graph: fx.Graph) -> None:
    """After a pass changed `graph`: check it, and regenerate its module's code (when it has one)."""
    graph.lint()
    if graph.owning_module is not None:
        graph.owning_module.recompile()


def replace_each(gm, rewrite, counter: str) -> int:
    """Node-local rewrites: for every node, `rewrite(graph, node)` inserts a replacement before it and returns it
    (None: the node stays); the node's uses move to the replacement and the node goes. Counted in
    `counters["mla_compile"][counter]`; returns the count."""
    graph = graph_of(gm)
    rewritten = 0
    for node in list(graph.nodes):
        new = rewrite(graph, node)
        if new is None:
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        torch._dynamo.utils.counters["mla_compile"][counter] += rewritten
        finish_edits(graph)
    return rewritten


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's `example_value`s (Dynamo's; not necessarily the ambient one)."""
    for n in graph.nodes:
        v = n.meta.get("example_value")
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
