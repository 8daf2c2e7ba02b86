"""What kind of model step a Dynamo graph is: a decode step (one query token per request) or a prefill.

The backend CUDA-graphs decode steps only, as serving engines do. A prefill is compute-bound (graphs buy it
nothing) and, under HF, is where a lazily allocated cache is created: HF's `StaticCache` allocates its buffers
at the first `update`, so when the prefill itself runs as a CUDA graph the cache tensors are outputs of that
graph, owned by the CUDA-graph trees' memory pool. The next graph's replay frees or overwrites them and the
decode step then reads a dead cache (on the H200: `TypeError: Pointer argument must be either uint64 or have
data_ptr method` in an Inductor launcher, or a segfault, with Inductor alone as with `mla_dcp`).

A verification step (MTP, HF's assisted generation and prompt lookup: 2 .. MAX_QUERY_TOKENS query tokens over
an existing cache) is a decode step: CUDA-graphed like one, rewritten like one. What tells it from a prefill of
as few tokens is the trap itself: a prefill that allocates the cache hands the fresh buffers out of the graph
(Dynamo returns the tensors it stored on the cache object), a verification step only reads and writes
buffers it was given. So a step with more than one query token counts as a prefill when it has more than
MAX_QUERY_TOKENS of them or when one of its outputs is a tensor the graph itself allocated (a factory call:
zeros / empty / full / ones, `new_*`, `*_like`).
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from .attention_rows import MAX_QUERY_TOKENS

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}
_FACTORIES = {torch.zeros, torch.empty, torch.ones, torch.full, torch.zeros_like, torch.empty_like, torch.ones_like,
              torch.full_like}
_FACTORY_METHODS = {"new_zeros", "new_empty", "new_ones", "new_full", "zeros_like", "empty_like"}


# Dynamo sources (regexes over their names) of Python ints that advance on every decode step: HF's sliding-window
# cache layers (StaticSlidingWindowLayer) count their tokens in `cumulative_length_int`, and the window's mask reads
# it (the query and key offsets into the padding mask). Specialized (generate()'s dynamic=False), each value would be
# a graph of its own: a recompile per step, up to the recompile limit, then HF's attention eagerly; so
# integrations/generate.compile_config makes them symbolic. Symbolic, such an int is still an input of the step's
# graph, and CUDA-graph trees record one graph per distinct int input: a recording every step, each kept for the
# process. Such a step compiles without CUDA graphs instead (backend.py).
STEP_COUNTER_SOURCES = (r".*\.cumulative_length_int$",)


# Dynamo sources of a cache layer's tensors (HF's `Cache.layers[i].keys / values / cumulative_length`, ...). HF marks
# them static addresses (`mark_static_address`) when it allocates them, but not while Dynamo traces: a cache whose
# first `update` runs inside a compiled call (a compiled prefill: `model.forward = torch.compile(...)`) keeps them
# unmarked, and Inductor then runs every later graph that writes them in place without CUDA graphs ("mutated
# inputs"). They are the cache's own state, written in place each step at one address: the backend marks them
# static for the graphs it CUDA-graphs (backend.py), what HF's mark would have done.
CACHE_STATE_SOURCES = (r".*\.layers\[\d+\]\.[A-Za-z_]\w*$",)
# ops through which a placeholder's storage is still written by an in-place op on the result
_VIEW_METHODS = {"view", "reshape", "select", "narrow", "transpose", "permute", "unsqueeze", "squeeze", "expand",
                 "flatten", "unflatten", "__getitem__", "as_strided", "view_as"}


def _val(n):
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def _query_len(t) -> int | None:
    """Query rows of an attention input / score tensor [..., Sq, D]; None when symbolic."""
    if not isinstance(t, torch.Tensor) or t.dim() < 3:
        return None
    s = t.shape[-2]
    return s if isinstance(s, int) else None


def allocated_output(gm: fx.GraphModule) -> str | None:
    """The name of a graph output that the graph allocated itself (a factory call), or None."""
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if out is None:
        return None
    for n in torch.utils._pytree.tree_leaves(out.args):
        if not isinstance(n, fx.Node):
            continue
        if (n.op == "call_function" and n.target in _FACTORIES) or (n.op == "call_method"
                                                                     and n.target in _FACTORY_METHODS):
            return n.name
    return None


def multi_token_attention(gm: fx.GraphModule) -> str | None:
    """The name of an attention node of a prefill step: one that attends with more than one query token per
    request (SDPA with a query of Sq != 1, or a softmax over 4-D scores [B, H, Sq, L] with Sq != 1; a symbolic Sq
    counts as more than one), unless the step is a verification step (2 <= Sq <= MAX_QUERY_TOKENS everywhere and
    no output the graph allocated: the module docstring). None for decode and verification steps."""
    lens = _query_lens(gm)
    if not lens:
        return None
    if all(isinstance(s, int) and 2 <= s <= MAX_QUERY_TOKENS for _, s in lens) and allocated_output(gm) is None:
        return None
    return lens[0][0]


def _query_lens(gm: fx.GraphModule) -> list:
    """(attention node name, Sq) of every attention whose query length is not 1."""
    found = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _SDPA and n.args:
            q = _val(n.args[0])
        elif (n.op == "call_function" and n.target in _SOFTMAX) or (n.op == "call_method" and n.target == "softmax"):
            q = _val(n.args[0]) if n.args else None
            if not (isinstance(q, torch.Tensor) and q.dim() == 4):
                continue  # not attention scores (e.g. a MoE router's softmax over [T, E])
        else:
            continue
        if isinstance(q, torch.Tensor) and _query_len(q) != 1:
            found.append((n.name, _query_len(q)))
    return found


def step_counter_input(gm: fx.GraphModule) -> str | None:
    """The Dynamo source name of an int graph input that advances on every decode step (`STEP_COUNTER_SOURCES`),
    or None. Only placeholders something in the graph reads count (host-int bookkeeping is split off first:
    passes/host_ints.py)."""
    for p in gm.graph.find_nodes(op="placeholder"):
        if getattr(p, "_dynamo_source", None) is None or not p.users or not isinstance(_val(p), (int, torch.SymInt)):
            continue
        name = _source_name(p)
        if any(re.match(pattern, name) for pattern in STEP_COUNTER_SOURCES):
            return name
    return None


def _source_name(node: fx.Node) -> str:
    source = getattr(node, "_dynamo_source", None)
    name = getattr(source, "name", "") if source is not None else ""
    return name() if callable(name) else name  # a method in older torch, a property in newer


def _written_in_place(node: fx.Node) -> bool:
    """Whether the graph writes `node`'s storage in place: an in-place method (`index_copy_`, `add_`, `copy_`, ...)
    or `operator.setitem` on it or on a view of it."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or not u.args or u.args[0] is not n:
                continue
            seen.add(u)
            name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "")
            if u.op == "call_function" and u.target is operator.setitem:
                return True
            if u.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__"):
                return True
            if (u.op == "call_method" and name in _VIEW_METHODS) or (u.op == "call_function"
                                                                       and u.target is operator.getitem):
                todo.append(u)
    return False


def unmarked_cache_state(gm: fx.GraphModule) -> list:
    """(placeholder, source name) of each cache-layer tensor (`CACHE_STATE_SOURCES`) the graph writes in place that
    is not a static address (no `_dynamo_static_input_type`): what a CUDA-graphed step needs marked."""
    found = []
    for p in gm.graph.find_nodes(op="placeholder"):
        if not isinstance(_val(p), torch.Tensor) or p.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"):
            continue
        name = _source_name(p)
        if any(re.match(pattern, name) for pattern in CACHE_STATE_SOURCES) and _written_in_place(p):
            found.append((p, name))
    return found
