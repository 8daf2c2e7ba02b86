"""DSA dense graph: drop the HF indexer's logits and top-k where the cache promises "every token selected".

HF `DeepseekV32Attention` / `GlmMoeDsaAttention` (eager / sdpa) run the indexer every step::

    keys   = past_key_values.update_indexer(k, layer)             # indexer key cache [B, L, Di]
    score  = (weights @ relu(q @ keys^T * s)).masked_fill(~A[:, 0], -inf)   (or + A[:, 0], float masks)
    idx    = score.topk(min(index_topk, L)).indices
    I      = ones(bool).scatter(-1, idx, False).unsqueeze(1)     # True = not selected
    A'     = A & ~I          (or A.masked_fill(I, finfo.min))     -> attention

On the dense graph the cache (`integrations.hf.DSADenseMixin`) returns `keys` through `mla_hf::all_selected`,
which holds only under the Dynamo guard "every request's kv_len <= index_topk". Then every token A allows
(at most kv_len of them, each with a finite score) is in the top-k, so A' == A. This pass replaces A' by A
for each such site (the top-k must come from scores over keys behind the marker, masked by the same A),
removes what is then dead (logits GEMMs, weights_proj, relu, top-k, scatter) and the marker. The indexer
key-cache write is a mutation and stays. Runs before the attention rewrite, which then sees A alone.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

COUNTER = "dsa_index_mask_dropped"

_INVERT = {operator.invert, torch.bitwise_not, torch.logical_not}
_AND = {operator.and_, torch.bitwise_and, torch.logical_and}


def _marker_ops():
    from ..integrations import hf

    return hf.ALL_SELECTED_OPS


def _is_call(n, fns=(), methods=()) -> bool:
    if not isinstance(n, fx.Node):
        return False
    if n.op == "call_function":
        return n.target in fns
    if n.op == "call_method":
        return n.target in methods
    return False


def _val(n):
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else n


def _arg(n: fx.Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _inverted(n):
    """x if n is ~x."""
    if _is_call(n, _INVERT, ("__invert__", "logical_not", "bitwise_not")):
        return n.args[0]
    return None


def _combination(n: fx.Node):
    """(A, I) if n is `A & ~I` or `A.masked_fill(I, big negative)`."""
    if _is_call(n, _AND, ("__and__", "bitwise_and", "logical_and")) and len(n.args) == 2:
        a, b = n.args
        if _inverted(b) is not None:
            return a, _inverted(b)
        if _inverted(a) is not None:
            return b, _inverted(a)
    if _is_call(n, {torch.masked_fill}, ("masked_fill",)) and len(n.args) >= 3:
        a, i, v = n.args[0], n.args[1], n.args[2]
        if isinstance(v, (int, float)) and v <= -1e30:
            return a, i
    return None


def _index_mask_topk(i: fx.Node):
    """The topk node if i == ones(bool).scatter(-1, topk(...).indices[.to/.long], False).unsqueeze(1)."""
    while _is_call(i, (), ("unsqueeze", "view", "reshape")):
        i = i.args[0]
    if not _is_call(i, {torch.scatter}, ("scatter",)) or len(i.args) < 4:
        return None
    base, dim, idx, value = i.args[:4]
    if value is not False and value != 0:
        return None
    bv = _val(base)
    if not (_is_call(base, {torch.ones}, ("new_ones",)) and isinstance(bv, torch.Tensor) and bv.dtype == torch.bool):
        return None
    if dim != -1 and dim != bv.dim() - 1:
        return None
    while _is_call(idx, (), ("long", "to", "int")):
        idx = idx.args[0]
    if not (_is_call(idx, {operator.getitem}) and idx.args[1] == 1):
        return None
    topk = idx.args[0]
    if not _is_call(topk, {torch.topk}, ("topk",)):
        return None
    if _arg(topk, 2, "dim", -1) not in (-1, _val(topk.args[0]).dim() - 1):
        return None
    return topk


def _masked_by(topk: fx.Node, A: fx.Node) -> bool:
    """topk's scores are masked with A[:, 0] (masked_fill(~A0, -inf) for bool A, + A0 for float A)."""
    s = topk.args[0]
    if _is_call(s, {torch.masked_fill}, ("masked_fill",)):
        m, v = s.args[1], s.args[2]
        a0 = _inverted(m)
        if not (isinstance(v, float) and v == float("-inf")) or a0 is None:
            return False
    elif _is_call(s, {operator.add, torch.add}, ("add", "__add__")) and len(s.args) == 2:
        a0 = s.args[1]
    else:
        return False
    if a0 is A:
        return True
    return _is_call(a0, {operator.getitem}) and a0.args[0] is A


def _marker_behind(topk: fx.Node, markers: set, depth: int = 16):
    """The all_selected marker the top-k's scores read (a short walk back from the top-k)."""
    frontier, seen = [topk], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in markers:
                    return a
                if a not in seen and a.op != "placeholder":
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    return None


def _pure(n: fx.Node) -> bool:
    if n.op == "call_method":
        return not (n.target.endswith("_") and not n.target.startswith("__"))
    if n.op == "call_function":
        if isinstance(n.target, torch._ops.OpOverload):
            return not n.target._schema.is_mutable
        if getattr(n.target, "__module__", None) == "_operator":  # operator.and_ is pure; iand / setitem are not
            return n.target not in _OPERATOR_INPLACE
        name = getattr(n.target, "__name__", "")
        return not (name.endswith("_") and not name.startswith("__"))
    return False


_OPERATOR_INPLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                     operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                     operator.irshift, operator.imatmul, operator.setitem, operator.delitem}


def _erase_dead(graph: fx.Graph, roots: list) -> int:
    work, erased = list(roots), 0
    while work:
        n = work.pop()
        if getattr(n, "_erased", False) or n.users or not _pure(n):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased += 1
        work.extend(inputs)
    return erased


def drop_dense_indexer(graph: fx.Graph) -> int:
    """Replace each index-masked attention mask behind an `all_selected` marker by the plain mask; returns
    the number of masks replaced (counted in counters["mla_compile"]["dsa_index_mask_dropped"])."""
    ops = _marker_ops()
    markers = {n for n in graph.nodes if n.op == "call_function" and n.target in ops}
    if not markers:
        return 0
    replaced, dead = 0, []
    for n in list(graph.nodes):
        combo = _combination(n)
        if combo is None:
            continue
        A, I = combo
        topk = _index_mask_topk(I)
        if topk is None:
            continue
        marker = _marker_behind(topk, markers)
        if marker is None:
            continue
        k = _arg(topk, 1, "k")
        L = _val(topk.args[0]).shape[-1]
        av, nv = _val(A), _val(n)
        if not _masked_by(topk, A):
            log.info("dsa_indexer: %s kept: the top-k scores are not masked by the same attention mask", n.name)
            continue
        if k != min(marker.args[1], L):
            log.info("dsa_indexer: %s kept: top-k size %s != min(topk %s, %s)", n.name, k, marker.args[1], L)
            continue
        if not (isinstance(av, torch.Tensor) and tuple(av.shape) == tuple(nv.shape) and av.dtype == nv.dtype):
            log.info("dsa_indexer: %s kept: the attention mask would broadcast", n.name)
            continue
        n.replace_all_uses_with(A)
        dead.append(n)
        replaced += 1
    _erase_dead(graph, dead)
    for m in markers:  # the marker is a copy of its input: dead now, or still correct where kept
        if not getattr(m, "_erased", False) and not m.users:
            graph.erase_node(m)
    if replaced:
        torch._dynamo.utils.counters["mla_compile"][COUNTER] += replaced
        log.info("dsa_indexer: dense graph: %d index mask(s) dropped (indexer logits / top-k removed)", replaced)
    return replaced
