"""Bias-free linears that read the same x -> one `mla.fused_linear` (the fused qkv_a / gate_up projections);
a lone bias-free linear with a long K (o_proj, down_proj) -> the same op, for its split-K few-token kernel.

An MLA layer's q_a_proj and kv_a_proj_with_mqa (q_proj and kv_a_proj_with_mqa without q_lora), and an MLP's
gate_proj and up_proj, multiply the same activations. vLLM and SGLang fuse them by concatenating the weights
at load time; this pass fuses them in the graph with no copy of the weights: the linears become one op whose
CUDA impl is one kernel launch per pair (ops/linear.py); alone, a linear goes there only when K >= 8192,
where splitting K beat cuBLAS on the H200 (down 12.2 vs 13.8 us, o_proj K=16384 20.9 vs 22.7; with K <= 2048
cuBLAS stays ahead). The op computes exactly what the linears did, so
the rewrite is semantics-preserving wherever it fires; `where` decides only where it is worth firing:

  auto:   CUDA, fp16/bf16, x with at most 16 rows (decode batches), where the H200 sweep measured it faster
  always: every group (CPU tests, snapshots)
  never:  off

Runs on the Dynamo graph (torch IR), after the attention rewrite. Counted in
`counters["mla_compile"]["fused_linear_groups"]`.
"""

from __future__ import annotations

import collections
import logging
import math

import torch
import torch.fx as fx

from ._fx import Builder, arg, fake_mode_of, meta_val

log = logging.getLogger(__name__)

COUNTER = "fused_linear_groups"
WHERE = ("auto", "always", "never")
_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
_MAX_ROWS = 16  # kernels/linear.py MAX_M
_MIN_K_ALONE = 8192  # a linear without a partner is only worth it with a long K


def _worth_it(x: torch.Tensor) -> bool:
    """Where the few-token kernel was measured faster: CUDA, half precision, a decode batch of rows."""
    rows = math.prod(x.shape[:-1])
    return (x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16) and isinstance(rows, int)
            and rows <= _MAX_ROWS)


def _candidate(node: fx.Node, where: str):
    """(x, weight) of a bias-free linear the pass may fuse, else None."""
    if node.op != "call_function" or node.target not in _LINEAR or arg(node, 2, "bias") is not None:
        return None
    x, w = arg(node, 0, "input"), arg(node, 1, "weight")
    xv, wv = meta_val(x), meta_val(w)
    if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and wv.dim() == 2
            and xv.dtype == wv.dtype and xv.device == wv.device):
        return None
    if where == "auto" and not _worth_it(xv):
        return None
    return x, w


def fuse_shared_input_linears(gm: fx.GraphModule | fx.Graph, where: str = "auto") -> int:
    """Fuse every group of >= 2 bias-free linears over the same x node (and route lone ones with K >= 8192);
    returns the number of groups rewritten."""
    if where not in WHERE:
        raise ValueError(f"fuse_linears: expected one of {WHERE}, got {where!r}")
    graph = gm if isinstance(gm, fx.Graph) else gm.graph
    if where == "never":
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = collections.defaultdict(list)
    for node in graph.nodes:
        c = _candidate(node, where)
        if c is not None:
            groups[c[0]].append((node, c[1]))
    fake_mode = None
    fused = 0
    for members in groups.values():
        first = members[0][0]
        x = arg(first, 0, "input")  # not the group's key: an earlier rewrite may have replaced that node
        # the op goes where the first linear was: every weight must already exist there
        members = [(n, w) for n, w in members if n is first or order[w] < order[first]]
        if len(members) < 2 and meta_val(members[0][1]).shape[1] < _MIN_K_ALONE:
            continue
        fake_mode = fake_mode or fake_mode_of(graph)
        b = Builder(graph, first, fake_mode, first)
        op = b.call(torch.ops.mla.fused_linear.default, x, [w for _, w in members])
        outs = [b.item(op, i) for i in range(len(members))]  # all inserted before `first` is erased
        for (n, _), out in zip(members, outs):
            n.replace_all_uses_with(out)
            graph.erase_node(n)
        fused += 1
        log.info("fused_linear: %d linear(s) over %s -> mla.fused_linear (%s)", len(members), x.name,
                 ", ".join(w.name for _, w in members))
    if fused:
        graph.lint()
        if graph.owning_module is not None:
            graph.owning_module.recompile()
        torch._dynamo.utils.counters["mla_compile"][COUNTER] += fused
    return fused
