"""Move host-int bookkeeping out of a Dynamo graph, so no Python int becomes an Inductor graph input.

A compiled region that advances a Python int (e.g. `MLAPagedCache.max_kv_len += 1`, the DSA dense / sparse
switch) makes Dynamo return the new value as a SymInt graph output, computed from the old value, which is
then a SymInt graph input. Inductor would take it as an input and CUDA-graph trees re-record per distinct
int value. These outputs depend only on host ints (no tensor data), so `split_host_outputs` computes them in
plain Python next to the compiled graph instead: the tensor graph handed to Inductor loses those outputs and
the int placeholders nothing else uses.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

_HOST = (int, bool, float, torch.SymInt, torch.SymBool, torch.SymFloat)


def _val(n: fx.Node):
    return n.meta.get("example_value", n.meta.get("val"))


def _host_only(n: fx.Node, memo: dict) -> bool:
    """n (and everything it is computed from) is host scalar arithmetic over placeholders."""
    if n in memo:
        return memo[n]
    v = _val(n)
    ok = isinstance(v, _HOST)
    if ok and n.op == "placeholder":
        pass
    elif ok and n.op == "call_function" and not isinstance(n.target, (torch._ops.OpOverload,
                                                                        torch._ops.OpOverloadPacket)):
        ok = all(_host_only(a, memo) for a in n.all_input_nodes)
    else:
        ok = False
    memo[n] = ok
    return ok


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    val_map: dict = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    for old, new in val_map.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source  # AOTAutograd reads it (static inputs for cudagraphs)
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta = dict(gm.meta)
    for k, v in gm.__dict__.items():
        if k not in new_gm.__dict__:
            new_gm.__dict__[k] = v
    return new_gm


def split_host_outputs(gm: fx.GraphModule, example_inputs: list) -> tuple[fx.GraphModule, list, Callable | None]:
    """Split SymInt outputs computed only from host ints off `gm` (in place).

    Returns (gm, example_inputs for it, wrap) where `wrap(compiled)` gives the callable Dynamo expects (same
    arguments and outputs as the original graph); wrap is None when there was nothing to split.
    """
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (tuple, list)):
        return gm, example_inputs, None
    memo: dict = {}
    host_pos = [i for i, o in enumerate(outs)
                if isinstance(o, fx.Node) and o.op != "placeholder" and _host_only(o, memo)]
    if not host_pos:
        return gm, example_inputs, None

    gm = _copy_graph_module(gm)  # Dynamo reads the placeholders of the graph it handed over: leave it alone
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # the host part, as its own small graph over the same arguments
    host_graph = fx.Graph()
    env: dict = {}
    for p in placeholders:
        env[p] = host_graph.placeholder(p.target)
    needed: list[fx.Node] = []
    seen: set = set()

    def visit(n):
        if n in seen or n.op == "placeholder":
            return
        seen.add(n)
        for a in n.all_input_nodes:
            visit(a)
        needed.append(n)

    for i in host_pos:
        visit(outs[i])
    for n in needed:
        env[n] = host_graph.node_copy(n, lambda a: env[a])
    host_graph.output(tuple(env[outs[i]] for i in host_pos))
    host_fn = fx.GraphModule(gm, host_graph)

    # the tensor part: same graph without those outputs and without int inputs nothing else reads
    keep_out = [o for i, o in enumerate(outs) if i not in host_pos]
    out_node.args = (type(outs)(keep_out),)
    for n in reversed(needed):
        if not n.users:
            gm.graph.erase_node(n)
    keep_in = []
    for i, p in enumerate(placeholders):
        if not p.users and isinstance(_val(p), _HOST):
            gm.graph.erase_node(p)
        else:
            keep_in.append(i)
    gm.graph.lint()
    gm.recompile()
    n_out = len(outs)
    log.info("host_ints: %d host-int output(s) computed outside the graph; %d int input(s) dropped",
             len(host_pos), len(placeholders) - len(keep_in))

    def wrap(compiled: Callable) -> Callable:
        host_set = set(host_pos)

        def run(*args: Any):
            host = host_fn(*args)
            inner = [args[i] for i in keep_in]
            res = list(compiled(*inner))  # Dynamo's convention: positional args
            it_host, it_res = iter(host), iter(res)
            full = [next(it_host) if i in host_set else next(it_res) for i in range(n_out)]
            return tuple(full) if isinstance(outs, tuple) else full

        return run

    return gm, [example_inputs[i] for i in keep_in], wrap

