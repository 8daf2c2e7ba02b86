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

Sparse graphs: `match_sparse_indexer` proves an index-masked mask is HF's indexer (top-k of the masked score
formula above over the indexer key cache) and returns its pieces; `passes.mla_attention` then emits
`dsa.indexer_topk` + `mla.sparse_decode` and removes HF's logits / top-k / scatter.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from ..ops.hf_cache import ALL_SELECTED_OPS
from ._fx import BIG_NEGATIVE, NoMatch, arg, batch_shape, erase_dead, is_call as _is_call, is_fn, meta_val, same

log = logging.getLogger(__name__)

COUNTER = "dsa_index_mask_dropped"

_INVERT = {operator.invert, torch.bitwise_not, torch.logical_not}
_AND = {operator.and_, torch.bitwise_and, torch.logical_and}


def _marker_ops():
    return ALL_SELECTED_OPS


_val, _arg = meta_val, arg


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
        if isinstance(v, (int, float)) and v <= BIG_NEGATIVE:
            return a, i
    return None


def index_masked(mask):
    """(A, I) if mask is an index-masked attention mask `A & ~I` / `A.masked_fill(I, min)` whose I is a top-k
    scatter (HF's indexer form; what the top-k ranks is `match_sparse_indexer`'s to prove), else None."""
    combo = _combination(mask) if isinstance(mask, fx.Node) else None
    if combo is None or _index_mask_topk(combo[1]) is None:
        return None
    return combo


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
    return _is_call(a0, {operator.getitem}) and a0.args[0] is A and _head_row(a0.args[1], A)


def _head_row(index, A) -> bool:
    """index is [:, 0] (trailing [:]s allowed) of A [B|1, 1, S, L]: every query row of A's one head. With S query
    tokens the indexer masks each row's scores by that row's mask; another index would mask them by another row."""
    if not isinstance(index, tuple) or not 2 <= len(index) <= 4:
        return False
    whole = slice(None)
    av = _val(A)
    return (index[0] == whole and index[1] == 0 and all(i == whole for i in index[2:])
            and isinstance(av, torch.Tensor) and av.dim() == 4 and av.shape[1] == 1)


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


def _symbolic(*sizes) -> bool:
    return any(isinstance(s, (fx.Node, torch.SymInt)) for s in sizes)


def drop_dense_indexer(graph: fx.Graph, specialize=None) -> int:
    """Replace each index-masked attention mask behind an `all_selected` marker by the plain mask; returns
    the number of masks replaced (counted in counters["mla_compile"]["dsa_index_mask_dropped"]).
    `specialize(mask_node)`: where the top-k size or the key length is symbolic (Dynamo's automatic dynamic shapes
    after the cache length changed), makes the mask's sizes static if the step is a decode step (returns whether it
    did; `mla_attention` passes its own), so "top-k size == min(index_topk, L)" can be read off as under a static
    trace; without it, or where it declines, the site keeps its indexer (the sparse graph's rewrite takes it)."""
    ops = _marker_ops()
    markers = {n for n in graph.nodes if is_fn(n, ops)}
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
        if _symbolic(k, L) and specialize is not None and specialize(n):
            k = _arg(topk, 1, "k")
            L = _val(topk.args[0]).shape[-1]
        av, nv = _val(A), _val(n)
        if not _masked_by(topk, A):
            log.info("dsa_indexer: %s kept: the top-k scores are not masked by the same attention mask", n.name)
            continue
        if k != min(marker.args[1], L):
            log.info("dsa_indexer: %s kept: top-k size %s != min(topk %s, %s)", n.name, k, marker.args[1], L)
            continue
        if not (isinstance(av, torch.Tensor) and same(tuple(av.shape), tuple(nv.shape)) and av.dtype == nv.dtype):
            log.info("dsa_indexer: %s kept: the attention mask would broadcast", n.name)
            continue
        n.replace_all_uses_with(A)
        dead.append(n)
        replaced += 1
    erase_dead(graph, dead)
    for m in markers:  # the marker is a copy of its input: dead now, or still correct where kept
        if not getattr(m, "_erased", False) and not m.users:
            erase_dead(graph, [m])  # and what only fed it (a DCP cache's gather of the key shard: a collective)
    if replaced:
        torch._dynamo.utils.counters["mla_compile"][COUNTER] += replaced
        log.info("dsa_indexer: dense graph: %d index mask(s) dropped (indexer logits / top-k removed)", replaced)
    return replaced


# ------------------------------------------------------------------------------------ DSA sparse graph
class NotSparse(NoMatch):
    """HF's index mask could not be proven to be the indexer's top-k (the message says why)."""


_RELU = {torch.relu, torch.nn.functional.relu}
_MATMUL = {torch.matmul, operator.matmul}
_MUL = {operator.mul, torch.mul}


class SparseIndexer:
    """HF's indexer behind an index-masked attention mask `A & ~I` / `A.masked_fill(I, min)`, where
    I = ones.scatter(-1, topk(score masked by A[:, 0], k).indices, False) and
    score[b, t] = weights[b] . relu(matmul(q.float(), keys[b, t].float()) * scale) (HF's formula; scale 1 where
    the model folds it into the weights)."""

    def __init__(self, A, topk, k, q, weights, keys, scale, nodes, tokens: int = 1):
        self.A, self.topk, self.k, self.q, self.weights, self.keys = A, topk, k, q, weights, keys
        self.scale = scale
        self.tokens = tokens  # query tokens per request S (> 1: `passes.dsa_tokens`)
        self.nodes = nodes  # the score / top-k nodes: where HF reads q, weights and the keys


def _shape_of(n) -> tuple:
    return batch_shape(n, NotSparse)


def _peel_float(n):
    """x if n is x.float() / x.to(torch.float32) (the exact upcast HF applies before the logits GEMM)."""
    if _is_call(n, (), ("float",)) and len(n.args) == 1 and not n.kwargs:
        return n.args[0]
    if _is_call(n, (), ("to",)) and len(n.args) == 2 and n.args[1] is torch.float32 and not n.kwargs:
        return n.args[0]
    return n


def match_sparse_indexer(mask) -> SparseIndexer | None:
    """The indexer behind an attention mask node (None: not an index-masked mask at all; NotSparse: an index
    mask whose top-k cannot be proven to be HF's indexer formula)."""
    if not isinstance(mask, fx.Node):
        return None
    combo = _combination(mask)
    if combo is None:
        return None
    A, I = combo
    topk = _index_mask_topk(I)
    if topk is None:
        raise NotSparse(f"index mask {I.name} is not ones.scatter(-1, topk(...).indices, False)")
    if not _masked_by(topk, A):
        raise NotSparse("the top-k scores are not masked by the attention mask the index mask is applied to")
    if _arg(topk, 3, "largest", True) is not True:
        raise NotSparse("top-k with largest=False")
    k = _arg(topk, 1, "k")
    if not isinstance(k, int) or k <= 0:
        raise NotSparse(f"top-k size {k!r} is not a positive constant")
    masked = topk.args[0]
    score = masked.args[0]
    # score = matmul(weights.unsqueeze(-2), relu(matmul(q.float(), keys.transpose(-1, -2).float()
    #                                                  .unsqueeze(1)) * scale)).squeeze(-2)
    if not (_is_call(score, (), ("squeeze",)) and len(score.args) == 2):
        raise NotSparse(f"index scores {score.name} are not matmul(...).squeeze(-2)")
    mm = score.args[0]
    if not (_is_call(mm, _MATMUL, ("matmul",)) and _shape_of(mm)[-2] == 1
            and score.args[1] in (-2, len(_shape_of(mm)) - 2)):
        raise NotSparse(f"index scores {score.name} are not a head-weighted matmul(...).squeeze(-2)")
    wu, relu = mm.args[0], mm.args[1]
    if not (_is_call(wu, (), ("unsqueeze",)) and len(wu.args) == 2 and wu.args[1] in (-2, 2)):
        raise NotSparse(f"{wu.name}: expected weights.unsqueeze(-2)")
    weights = wu.args[0]
    if not (_is_call(relu, _RELU, ("relu",)) and len(relu.args) == 1 and not relu.kwargs.get("inplace", False)):
        raise NotSparse(f"{relu.name}: expected relu(logits * scale)")
    scaled = relu.args[0]
    if _is_call(scaled, _MUL, ("mul", "__mul__")) and len(scaled.args) == 2:
        a, b = scaled.args
        if isinstance(b, float) and isinstance(a, fx.Node):
            logits, scale = a, b
        elif isinstance(a, float) and isinstance(b, fx.Node):
            logits, scale = b, a
        else:
            raise NotSparse(f"{scaled.name}: logits scaled by a non-constant")
    else:  # the scale folded into the weights (hy_v4): weights . relu(logits), the formula with scale 1
        logits, scale = scaled, 1.0
    if not (_is_call(logits, _MATMUL, ("matmul",)) and len(logits.args) == 2):
        raise NotSparse(f"{logits.name}: expected matmul(q.float(), keys^T)")
    qf, kt = logits.args
    q = _peel_float(qf)
    if not (_is_call(kt, (), ("unsqueeze",)) and len(kt.args) == 2 and kt.args[1] == 1):
        raise NotSparse(f"{kt.name}: expected keys.transpose(-1, -2).float().unsqueeze(1)")
    ktf = _peel_float(kt.args[0])
    if not (_is_call(ktf, (), ("transpose",)) and len(ktf.args) == 3
            and sorted(d % 3 for d in ktf.args[1:]) == [1, 2]):
        raise NotSparse(f"{ktf.name}: expected keys.transpose(-1, -2)")
    keys = ktf.args[0]
    qs, ks, ws, ss = _shape_of(q), _shape_of(keys), _shape_of(weights), _shape_of(masked)
    if len(qs) != 4 or len(ks) != 3 or not isinstance(qs[1], int):
        raise NotSparse(f"indexer q {qs} / keys {ks}: expected [B, S, Hi, Di] / [B, L, Di]")
    B, S, Hi, Di = qs  # S query tokens: score row j is query token j's (HF: [B, S, L], each row its own top-k)
    L = ks[1]
    if not (same(ks, (B, L, Di)) and same(ws, (B, S, Hi)) and same(ss, (B, S, L))):
        raise NotSparse(f"indexer shapes do not line up: q {qs}, keys {ks}, weights {ws}, scores {ss}")
    qv, kv, wv = _val(q), _val(keys), _val(weights)
    if wv.dtype != torch.float32 or _val(qf).dtype != torch.float32 or _val(kt).dtype != torch.float32:
        raise NotSparse("the indexer logits are not computed in float32")
    if qv.dtype != kv.dtype:
        raise NotSparse(f"indexer q ({qv.dtype}) and keys ({kv.dtype}) differ in dtype")
    if not same(_shape_of(I), (B, 1, S, L)):
        raise NotSparse(f"index mask {I.name} has shape {_shape_of(I)}, expected [B, 1, S={S}, L={L}]")
    if k > L:
        raise NotSparse(f"top-k size {k} > cache length {L}")
    nodes = {topk, masked, score, mm, wu, relu, scaled, logits, qf, kt, kt.args[0], ktf}
    return SparseIndexer(A, topk, k, q, weights, keys, float(scale), nodes, S)
