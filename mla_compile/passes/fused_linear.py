"""Bias-free linears that read the same x -> one `mla.fused_linear` (the fused qkv_a / gate_up projections);
a lone bias-free linear (q_b_proj, o_proj, down_proj) -> the same op, for its (split-K) few-token kernel.

An MLA layer's q_a_proj and kv_a_proj_with_mqa (q_proj and kv_a_proj_with_mqa without q_lora), and an MLP's
gate_proj and up_proj, multiply the same activations. vLLM and SGLang fuse them by concatenating the weights
at load time; this pass fuses them in the graph with no copy of the weights: the linears become one op whose
CUDA impl is one kernel launch per pair (ops/linear.py); alone, a linear goes there when K >= 1024 and
N <= 8192 (q_b_proj, o_proj, down_proj): alone on the H200 ours and cuBLAS were close at K <= 2048 (6.0-6.8 vs
5.7-6.0 us), but in the step ours chain with their neighbours by programmatic dependent launch and cuBLAS's do not
(`tuning.Tuning.lone_linear_min_k`). The op computes exactly what the linears did, so
the rewrite is semantics-preserving wherever it fires; `where` decides only where it is worth firing:

  auto:   CUDA, fp16/bf16, x with at most 16 rows (decode batches), where the H200 sweep measured it faster, in
          graphs that replay as CUDA graphs (without them the host cost of a call outweighs the GPU time won)
  always: every group (CPU tests, snapshots)
  never:  off

Where the kernel's policy splits K (few rows, long K: q_a + kv_a, down_proj), the group becomes
`mla.linear_partials` and the sum over splits is written as adds in the graph, for Inductor to fuse into the
output's consumers instead of a second launch (ops/linear.py).

Runs on the Dynamo graph (torch IR), after the attention rewrite. Counted in
`counters["mla_compile"]["fused_linear_groups"]` (of which `fused_linear_split_k_groups` as partials).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import math

import torch
import torch.fx as fx
from torch.ops import aten

from .. import tuning
from ..ops.linear import FEW_TOKEN_ROWS, few_token_rows
from ._fx import Builder, arg, fake_mode_of, finish_edits, graph_of, meta_val

log = logging.getLogger(__name__)

COUNTER = "fused_linear_groups"
SPLIT_COUNTER = "fused_linear_split_k_groups"  # of those, written as linear_partials + adds
WHERE = ("auto", "always", "never")
_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}


# Whether the graph being compiled will replay as CUDA graphs (the backend sets it from the Inductor config). The
# few-token kernels win a few microseconds of GPU time per linear, measured in captured steps; without CUDA graphs
# each call of ours costs ~60-160 us of host time on the H200's host against ~10-15 us for the cuBLAS call Inductor
# makes, and a default-mode decode step is host-bound (4-layer DeepseekV3 generate(), batch 8, 4K, profiled: GPU ~0.6 ms
# of a ~6.5 ms step, 19 linear_partials + 8 per_head_linear calls a step; benchmarks/RESULTS.md).
_CUDA_GRAPHS: contextvars.ContextVar[bool] = contextvars.ContextVar("mla_compile_cuda_graphs", default=True)


@contextlib.contextmanager
def compiling_for_cuda_graphs(on: bool):
    """Rewrites inside see whether the compiled graph will replay as CUDA graphs (`few_token_worth_it`)."""
    token = _CUDA_GRAPHS.set(bool(on))
    try:
        yield
    finally:
        _CUDA_GRAPHS.reset(token)


def few_token_worth_it(x: torch.Tensor, rows=None) -> bool:
    """Where the few-token kernels were measured faster: CUDA, half precision, a decode batch of rows (default:
    all of x's leading dims), in a graph that replays as CUDA graphs (`compiling_for_cuda_graphs`)."""
    rows = math.prod(x.shape[:-1]) if rows is None else rows
    return x.device.type == "cuda" and few_token_rows(rows, x.dtype) and _CUDA_GRAPHS.get()


def _lone_worth_it(w: torch.Tensor) -> bool:
    """A linear without a partner goes to the few-token kernel with K >= lone_linear_min_k and N <=
    lone_linear_max_n (mla_compile/tuning.py says why those)."""
    t = tuning.current()
    return w.shape[1] >= t.lone_linear_min_k and w.shape[0] <= t.lone_linear_max_n


def _candidate(node: fx.Node, where: str):
    """(x, weight) of a bias-free linear the pass may fuse, else None."""
    if node.op != "call_function" or node.target not in _LINEAR or arg(node, 2, "bias") is not None:
        return None
    x, w = arg(node, 0, "input"), arg(node, 1, "weight")
    xv, wv = meta_val(x), meta_val(w)
    if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and wv.dim() == 2
            and xv.dtype == wv.dtype and xv.device == wv.device):
        return None
    if where == "auto" and not few_token_worth_it(xv):
        return None
    return x, w


def _split_k(xv: torch.Tensor, weights: list[fx.Node]) -> int:
    """How many K splits the few-token kernel's policy gives this group (kernels/linear.py
    `default_linear_config`, shape-only); 1 where it does not split or the shape is not static."""
    rows = math.prod(xv.shape[:-1])
    K = xv.shape[-1]
    N = sum(meta_val(w).shape[0] for w in weights)
    if not all(isinstance(d, int) for d in (rows, K, N)) or rows > FEW_TOKEN_ROWS:
        return 1
    from ..kernels.linear import default_linear_config  # Triton: imported only once a group is found

    return default_linear_config(rows, K, N).split_k


def _summed_partials(b: Builder, x: fx.Node, weights: list[fx.Node], splits: int) -> list[fx.Node]:
    """[x @ W_i^T] as `mla.linear_partials` + the sum over its splits written as pointwise adds (then the cast
    to x's dtype): Inductor inlines them into the kernels that read the outputs, where the op alone would need a
    second launch to add them up. fp32 adds in split order, one rounding: what the summing kernel computed."""
    xv = meta_val(x)
    lead, K = list(xv.shape[:-1]), xv.shape[-1]
    part = b.call(torch.ops.mla.linear_partials.default, b.call(aten.reshape.default, x, [math.prod(lead), K]),
                  weights, splits)
    outs, col = [], 0
    for w in weights:
        n = meta_val(w).shape[0]
        cols = b.call(aten.slice.Tensor, part, 2, col, col + n)
        acc = b.call(aten.select.int, cols, 0, 0)
        for s in range(1, splits):
            acc = b.call(aten.add.Tensor, acc, b.call(aten.select.int, cols, 0, s))
        y = b.call(aten._to_copy.default, acc, dtype=xv.dtype)
        outs.append(b.call(aten.reshape.default, y, lead + [n]))
        col += n
    return outs


def fuse_shared_input_linears(gm: fx.GraphModule | fx.Graph, where: str = "auto") -> int:
    """Fuse every group of >= 2 bias-free linears over the same x node (and route lone ones, `_lone_worth_it`);
    returns the number of groups rewritten."""
    if where not in WHERE:
        raise ValueError(f"fuse_linears: expected one of {WHERE}, got {where!r}")
    graph = graph_of(gm)
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
        if len(members) < 2 and not _lone_worth_it(meta_val(members[0][1])):
            continue
        fake_mode = fake_mode or fake_mode_of(graph)
        b = Builder(graph, first, fake_mode, first)
        weights = [w for _, w in members]
        splits = _split_k(meta_val(x), weights)
        if splits > 1:
            outs = _summed_partials(b, x, weights, splits)
            torch._dynamo.utils.counters["mla_compile"][SPLIT_COUNTER] += 1
        else:
            op = b.call(torch.ops.mla.fused_linear.default, x, weights)
            outs = [b.item(op, i) for i in range(len(members))]  # all inserted before `first` is erased
        for (n, _), out in zip(members, outs):
            n.replace_all_uses_with(out)
            graph.erase_node(n)
        fused += 1
        log.info("fused_linear: %d linear(s) over %s -> %s (%s)", len(members), x.name,
                 f"mla.linear_partials x{splits} + adds" if splits > 1 else "mla.fused_linear",
                 ", ".join(w.name for _, w in members))
    if fused:
        finish_edits(graph)
        torch._dynamo.utils.counters["mla_compile"][COUNTER] += fused
    return fused
