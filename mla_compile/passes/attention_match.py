"""The attention rewrite's matcher: find HF MLA decode attention in a Dynamo graph and describe it.

`match_site(node)` walks back from an attention output (SDPA, or HF eager's matmul / softmax / matmul) through the
K assembly, the kv_b_proj expansion of the latent and the rope latent's expand, and returns a `Site` (or None: not
attention; `NoMatch`: attention it cannot rewrite, saying why). `latent_source(site)` says where the latent comes
from: a plain tensor (HF StaticCache) or our caches' gather op (paged, DCP-sharded). The forms matched are drawn in
`passes.mla_attention`'s docstring.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from ..ops.hf_cache import GATHER_OPS
from . import attention_mask as masks, attention_rows, dsa_indexer
from .attention_checks import check_private
from ._fx import (DynamicShape, NoMatch, arg as _arg, as_int, batch_shape as _shape, is_fn as _is_fn, is_op as _is_op,
                  same, val as _val)

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
_MATMUL = {torch.matmul, operator.matmul, torch.Tensor.matmul}
_CAT = {torch.cat, torch.concat, torch.concatenate}
_DROPOUT = {torch.nn.functional.dropout}


# ------------------------------------------------------------------------------------------- node helpers
# shapes (`_shape`): ints, with a possibly symbolic batch (dim 0)
def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _shape_args(node: fx.Node, start: int = 1) -> tuple:
    args = node.args[start:]
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    return tuple(args)


def is_attention(node) -> bool:
    """A node `match_site` looks at: an SDPA call or a matmul (HF eager's probabilities @ V)."""
    return _is_fn(node, _SDPA) or _is_fn(node, _MATMUL) or _is_op(node, "matmul")


def last_dim_cat_parts(node) -> list | None:
    """The parts of `node` if it is a cat on its last dim (HF: cat(q_pass, q_rot), cat(k_nope, kpe)), else None."""
    if not _is_fn(node, _CAT):
        return None
    ndim = len(_shape(node))
    return list(node.args[0]) if _dim(_arg(node, 1, "dim", 0), ndim) == ndim - 1 else None


# ------------------------------------------------------------------------------------------ match records
@dataclasses.dataclass
class LatentSource:
    """Where the latent cache of a site comes from (how to hand it to mla.decode)."""

    kind: str  # "tensor" | "paged" | "dcp"
    ckv: fx.Node  # "tensor": [B,1,L,R] / [B,L,R]; "paged"/"dcp": [NP,PS,R] page pool
    kpe: fx.Node
    block_table: fx.Node | None = None  # "paged"/"dcp": int32 [B, MP]
    dcp_size: int = 1
    dcp_rank: int = 0
    group_name: str = ""
    ckv_scale: fx.Node | None = None  # an FP8 ckv's scales [NP, PS, R / 128] (mla_compile/fp8.py), else None
    heads_sharded: bool = False  # "dcp": the heads are split across the group (TP x DCP) -> mla.tp_dcp_decode


class KVInput(NoMatch):
    """K arrives as a graph input: Dynamo broke the graph between HF's expand_kv and its attention, or the model
    caches per-head K / V (no latent to attend over; e.g. transformers 5.17's glm5_next)."""


@dataclasses.dataclass
class Site:
    out: fx.Node  # attention output [B, H, 1, v]
    q: fx.Node  # [B, H, 1, nope + P]
    weight: fx.Node  # kv_b_proj weight [H * (nope + v), R]
    latent: fx.Node  # input of kv_b_proj
    kpe: fx.Node  # rope latent before expand
    mask: Any  # fx.Node or None
    proof: masks.MaskProof | None  # what the mask means (valid tokens, what an empty row gives); None: unproven
    scale: float
    nope: int
    v_dim: int
    rope: int
    nope_offset: int  # where the nope part sits in Q / K's last dim (rope is the other part)
    rope_offset: int
    heads: int
    nodes: set  # nodes that die with the rewrite
    impl: str  # "sdpa" | "eager"
    dtypes: tuple  # what the masked scores are cast to through the softmax (attention_mask.prove_mask)
    sinks: Any = None  # per-head sink logits [H] (eager softmax over [scores | sink], sink dropped), or None
    sparse: Any = None  # dsa_indexer.SparseIndexer: DSA sparse graph -> dsa.indexer_topk + mla.sparse_decode
    tokens: int = 1  # query tokens per request S (> 1: attention_tokens' multi-token rewrite)
    rows: Any = None  # S > 1, a DSA index mask: why its rows are not prefixes (only dsa_tokens can emit it); or None


# ----------------------------------------------------------------------------------------- the matcher
def _match_expansion(k_nope: fx.Node, v: fx.Node, nodes: set):
    """k_nope, V = split(linear(c, W).view(B, L, H, d).transpose(1, 2), [nope, v], -1)."""
    for n, idx in ((k_nope, 0), (v, 1)):
        if not (_is_fn(n, {operator.getitem}) and n.args[1] == idx):
            raise NoMatch(f"{'K nope part' if idx == 0 else 'V'} ({n.name}) is not item {idx} of a split")
    split = v.args[0]
    if k_nope.args[0] is not split or not _is_op(split, "split"):
        raise NoMatch("K nope part and V do not come from the same split")
    sizes = _arg(split, 1, "split_size_or_sections")
    if sizes is None:
        sizes = _arg(split, 1, "split_size")
    dim = _arg(split, 2, "dim", 0)
    X = split.args[0]
    xs = _shape(X)
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2 and _dim(dim, len(xs)) == len(xs) - 1):
        raise NoMatch(f"split {split.name} is not a 2-way split of the last dim (sizes={sizes}, dim={dim})")
    nope, v_dim = int(sizes[0]), int(sizes[1])
    if not (_is_op(X, "transpose") and len(xs) == 4
            and sorted(_dim(d, 4) for d in _shape_args(X)) == [1, 2]):
        raise NoMatch(f"{X.name}: expected .transpose(1, 2) of the expanded kv")
    view = X.args[0]
    if not _is_op(view, "view", "reshape"):
        raise NoMatch(f"{view.name}: expected a view of kv_b_proj's output")
    lin = view.args[0]
    if not _is_fn(lin, _LINEAR):
        raise NoMatch(f"{lin.name}: expected kv_b_proj (linear) over the latent, got {lin.target}")
    latent, weight = lin.args[0], _arg(lin, 1, "weight")
    bias = _arg(lin, 2, "bias")
    if bias is not None:
        raise NoMatch("kv_b_proj has a bias")
    ls, ws, vs, lins = _shape(latent), _shape(weight), _shape(view), _shape(lin)
    B, H, L, d = xs
    if not (len(ls) in (3, 4) and (len(ls) == 3 or ls[1] == 1) and same(ls[0], B) and ls[-2] == L):
        raise NoMatch(f"latent {latent.name} has shape {ls}, expected [B, 1, L, R] with B={B}, L={L}")
    R = ls[-1]
    if not same(vs, (B, L, H, d)) or ws != (H * d, R) or d != nope + v_dim or lins[-1] != H * d:
        raise NoMatch(f"kv_b_proj expansion shapes do not line up: view {vs}, weight {ws}, split {sizes}")
    nodes.update({split, X, view, lin, k_nope, v})
    return latent, weight, nope, v_dim, X


def _match_rope_expand(n: fx.Node, B: int, H: int, L: int, nodes: set) -> fx.Node:
    if not _is_op(n, "expand"):
        raise NoMatch(f"{n.name}: expected the rope latent .expand(-1, H, -1, -1)")
    src = n.args[0]
    ss = _shape(src)
    es = _shape(n)
    if not (len(ss) == 4 and same(ss[0], B) and ss[1] == 1 and ss[2] == L and same(es, (B, H, L, ss[3]))):
        raise NoMatch(f"rope latent {src.name} {ss} expanded to {es}: expected [B, 1, L, P] -> [B, H, L, P]")
    nodes.add(n)
    return src


def _match_key(K: fx.Node, attn_users: set, nodes: set):
    """K = [k_nope | kpe.expand] (new_empty + two slice copies, or cat). Returns (k_nope, kpe_expand,
    nope_offset, rope_offset)."""
    parts = {}  # offset -> source node
    ks = _shape(K)
    if _is_fn(K, _CAT):
        tensors = last_dim_cat_parts(K)
        if tensors is None or len(tensors) != 2:
            raise NoMatch(f"{K.name}: K is a cat that is not 2 parts on the last dim")
        off = 0
        for t in tensors:
            parts[off] = t
            off += _shape(t)[-1]
        nodes.add(K)
    elif _is_op(K, "new_empty", "empty_like", "empty"):
        for user in K.users:
            if user in attn_users:
                continue
            if not (_is_fn(user, {operator.getitem}) and isinstance(user.args[1], tuple)
                    and len(user.args[1]) == 2 and user.args[1][0] is Ellipsis
                    and isinstance(user.args[1][1], slice) and user.args[1][1].step in (None, 1)):
                raise NoMatch(f"K buffer {K.name} has an unexpected user {user.name} ({user.target})")
            sl = user.args[1][1]
            start = sl.start or 0
            copies = list(user.users)
            if len(copies) != 1 or not _is_op(copies[0], "copy_") or copies[0].args[0] is not user:
                raise NoMatch(f"K slice {user.name} is not written by exactly one copy_")
            src = copies[0].args[1]
            stop = ks[-1] if sl.stop is None else sl.stop
            if _shape(user)[-1] != stop - start or not same(_shape(src), _shape(user)):
                raise NoMatch(f"K slice {user.name} is written with a broadcast / mismatched copy")
            if start in parts:
                raise NoMatch(f"K buffer {K.name} written twice at offset {start}")
            parts[start] = src
            nodes.update({user, copies[0]})
        nodes.add(K)
    elif K.op == "placeholder":
        raise KVInput(f"K ({K.name}) is a graph input, not expanded from a latent in this graph: a graph break "
                      f"between HF's kv_b_proj expansion and the attention, or a cache holding per-head keys")
    else:
        raise NoMatch(f"K ({K.name}, {K.target}) is neither HF's new_empty+copy_ nor a cat")
    if len(parts) != 2:
        raise NoMatch(f"K is assembled from {len(parts)} parts, expected 2")
    (o1, p1), (o2, p2) = sorted(parts.items(), key=lambda kv: kv[0])
    if o1 != 0 or o2 != _shape(p1)[-1] or o2 + _shape(p2)[-1] != ks[-1]:
        raise NoMatch("K parts do not tile its last dim")
    if _is_op(p1, "expand"):
        return p2, p1, o2, o1
    return p1, p2, o1, o2


def _match_sdpa(node: fx.Node):
    q, k, v = (_arg(node, i, nm) for i, nm in enumerate(("query", "key", "value")))
    mask = _arg(node, 3, "attn_mask")
    dropout = _arg(node, 4, "dropout_p", 0.0)
    is_causal = _arg(node, 5, "is_causal", False)
    scale = _arg(node, 6, "scale", None)
    if node.kwargs.get("enable_gqa", False):
        raise NoMatch("sdpa with enable_gqa")
    if dropout != 0.0:
        raise NoMatch(f"sdpa with dropout_p={dropout}")
    if is_causal is not False:
        raise NoMatch(f"sdpa with is_causal={is_causal} (HF passes an explicit mask for decode)")
    if scale is None:
        scale = _shape(q)[-1] ** -0.5
    if not isinstance(scale, (int, float)):
        raise NoMatch(f"sdpa scale is not a constant ({scale})")
    return q, k, v, mask, float(scale), set(), {node}, (_val(q).dtype,), None


def _match_eager(node: fx.Node):
    """out = matmul(dropout(softmax(matmul(Q, K.transpose(2, 3)) * s [+ M], -1).to(dt)), V), or with attention
    sinks softmax(cat([.. [+ M], sinks], -1))[..., :-1] in its place (`_match_sinks`)."""
    p, v = node.args[0], node.args[1]
    chain = {node}
    while True:
        if _is_op(p, "to", "type", "float"):
            pass
        elif _is_fn(p, _DROPOUT):
            if _arg(p, 1, "p", 0.5) != 0.0 and _arg(p, 2, "training", True) is not False:
                raise NoMatch("eager attention with active dropout")
        else:
            break
        chain.add(p)
        p = p.args[0]
    sliced = None
    if _is_fn(p, {operator.getitem}) and _is_op(p.args[0], "softmax"):  # attention sinks: probs[..., :-1]
        chain.add(p)
        sliced, p = p, p.args[0]
    if not _is_op(p, "softmax"):
        return None
    sm_dim = _arg(p, 1, "dim")
    if sm_dim not in (-1, 3):
        raise NoMatch(f"softmax over dim {sm_dim}")
    chain.add(p)
    s = p.args[0]
    sinks, dtypes = None, (_val(p).dtype,)
    if sliced is not None:
        s, sinks = _match_sinks(sliced, s, chain)
        dtypes = (_val(p.args[0]).dtype,) + dtypes
    mask = None
    dtypes = (_val(s).dtype,) + dtypes  # the masked scores', then what the softmax runs in (HF: float32)
    if _is_op(s, "add", "__add__") or _is_fn(s, {operator.add}):
        chain.add(s)
        s, mask = s.args[0], s.args[1]
    scale = 1.0
    if _is_op(s, "mul", "__mul__") or _is_fn(s, {operator.mul}):
        chain.add(s)
        a, b = s.args
        if isinstance(b, (int, float)):
            scale, s = float(b), a
        elif isinstance(a, (int, float)):
            scale, s = float(a), b
        else:
            raise NoMatch("attention scores scaled by a tensor")
    if not (_is_op(s, "matmul") or _is_fn(s, _MATMUL)):
        raise NoMatch("softmax input is not (Q @ K^T) * scale [+ mask]")
    chain.add(s)
    q, kt = s.args[0], s.args[1]
    if not (_is_op(kt, "transpose") and sorted(_dim(d, 4) for d in _shape_args(kt)) == [2, 3]):
        raise NoMatch("scores are not Q @ K.transpose(2, 3)")
    chain.add(kt)
    return q, kt.args[0], v, mask, scale, {kt}, chain, dtypes, sinks


def _match_sinks(sliced: fx.Node, c: fx.Node, chain: set):
    """HF's attention sinks (hy_v4): probabilities sliced[..., :-1] of a softmax over
    c = cat([S, sinks.reshape(1, -1, 1, 1).expand(B, -1, 1, -1)], -1) (optionally minus its row max): returns
    (S, sinks [H])."""
    idx = sliced.args[1]
    if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and idx[1] == slice(None, -1, None)):
        raise NoMatch(f"the probabilities are a slice {idx} of a wider softmax, not [..., :-1] (attention sinks)")
    if _is_op(c, "sub", "__sub__") or _is_fn(c, {operator.sub}):  # a shift per row: the softmax is the same
        x, shift = c.args
        peak = shift.args[0] if _is_fn(shift, {operator.getitem}) and shift.args[1] == 0 else None
        if not (_is_op(peak, "max") and peak.args[0] is x and _arg(peak, 1, "dim") in (-1, 3)
                and _arg(peak, 2, "keepdim", False) is True):
            raise NoMatch(f"the sink logits are shifted by {getattr(shift, 'name', shift)}, not by their row max")
        chain.update({c, shift, peak})
        c = x
    parts = last_dim_cat_parts(c)
    if parts is None or len(parts) != 2:
        raise NoMatch(f"{c.name}: the softmax over [scores | sinks] is not a 2-part cat on the last dim")
    S, e = parts
    if len(_shape(S)) != 4:
        raise NoMatch(f"{S.name}: scores of shape {_shape(S)} beside the sinks, expected [B, H, 1, L]")
    B, H, Sq, _ = _shape(S)
    r = e.args[0] if _is_op(e, "expand") else None
    if not (_is_op(r, "reshape", "view") and same(_shape(e), (B, H, Sq, 1)) and _shape(r) == (1, H, 1, 1)
            and _shape(r.args[0]) == (H,)):
        raise NoMatch(f"{e.name}: the sink column is not a per-head [H] tensor .reshape(1, -1, 1, 1).expand(...)")
    chain.update({c, e, r})
    return S, r.args[0]


def _attention(node: fx.Node):
    """(impl, q, K, V, mask, scale, K's users in the site, the chain, dtypes, sinks) of an attention output; None if
    `node` is not attention at all."""
    if _is_fn(node, _SDPA):
        return ("sdpa", *_match_sdpa(node))
    if _is_fn(node, _MATMUL) or _is_op(node, "matmul"):
        m = _match_eager(node)
        return None if m is None else ("eager", *m)
    return None


def match_structure(node: fx.Node, attention=None) -> Site | None:
    """The site at an attention output as far as its shape of computation goes: K / V are kv_b_proj's expansion of a
    latent beside the expanded rope latent, any query length, and a mask broadcastable to the scores [B, H, S, L],
    unproven (`Site.proof` None). What `attention_dense` needs; `match_site` adds what the decode ops need. None:
    not attention; NoMatch: attention of another shape. `attention`: `_attention(node)` where the caller has it."""
    m = _attention(node) if attention is None else attention
    if m is None:
        return None
    impl, q, K, V, mask, scale, k_users, chain, dtypes, sinks = m
    qv = _val(q)
    if not (isinstance(qv, torch.Tensor) and qv.dim() == 4):
        raise NoMatch(f"query {q.name} is not a [B, H, S, D] tensor")
    B, H, Sq, Dq = qs = _shape(q)
    nodes = set(chain)
    attn_users = {node} | k_users
    k_nope, kpe_e, nope_off, rope_off = _match_key(K, attn_users, nodes)
    latent, weight, nope, v_dim, X = _match_expansion(k_nope, V, nodes)
    _, H2, L, _ = _shape(X)
    if H2 != H:
        raise NoMatch(f"K has {H2} heads, Q has {H} (grouped heads are not supported)")
    kpe = _match_rope_expand(kpe_e, B, H, L, nodes)
    P = _shape(kpe)[-1]
    if Dq != nope + P or not same(_shape(K), (B, H, L, nope + P)) or _shape(V)[-1] != v_dim:
        raise NoMatch(f"head dims do not line up: Q {qs}, K {_shape(K)}, nope {nope}, rope {P}")
    lv = _val(latent)
    if lv.dtype != qv.dtype or _val(kpe).dtype != qv.dtype or _val(weight).dtype != qv.dtype:
        raise NoMatch(f"mixed dtypes: q {qv.dtype}, latent {lv.dtype}, kpe {_val(kpe).dtype}")
    if mask is not None:
        ms = _shape(mask)
        if not (len(ms) == 4 and all(same(m, 1) or same(m, n) for m, n in zip(ms, (B, H, Sq, L)))):
            raise NoMatch(f"mask shape {ms} does not broadcast to the scores [B, H, S, L] = {(B, H, Sq, L)}")
    check_private(node, nodes)  # every intermediate dies with the site
    return Site(out=node, q=q, weight=weight, latent=latent, kpe=kpe, mask=mask, proof=None, scale=scale,
                nope=nope, v_dim=v_dim, rope=P, nope_offset=nope_off, rope_offset=rope_off, heads=H, nodes=nodes,
                impl=impl, dtypes=dtypes, sinks=sinks, tokens=Sq)


def match_site(node: fx.Node) -> Site | None:
    """Return a Site if `node` is an attention output; None if it is not attention at all; NoMatch if it is
    attention that cannot be rewritten into the decode ops (`attention_dense` may still take it)."""
    m = _attention(node)
    if m is None:
        return None
    q = m[1]
    qv = _val(q)
    if not (isinstance(qv, torch.Tensor) and qv.dim() == 4):
        raise NoMatch(f"query {q.name} is not a [B, H, 1, D] tensor")
    Sq = as_int(qv.shape[2])  # Dynamo specializes a length of 1
    steps = attention_rows.MAX_QUERY_TOKENS
    if isinstance(Sq, torch.SymInt) and Sq.node.has_hint() and 1 <= Sq.node.hint <= steps:
        # another length was seen before (automatic dynamic shapes): the driver specializes it to this call's
        raise DynamicShape(f"query length {Sq} is symbolic")
    if not (isinstance(Sq, int) and 1 <= Sq <= steps):
        raise NoMatch(f"query length {Sq} is not 1 .. {attention_rows.MAX_QUERY_TOKENS} (prefill steps are left to "
                      f"HF attention)")
    site = match_structure(node, m)
    L = _shape(site.latent)[-2]
    mask = site.mask
    if mask is not None:
        ms = _shape(mask)
        if not (ms[1] == 1 and ms[2] in (1, Sq) and ms[3] == L):
            raise NoMatch(f"mask shape {ms} is not [B|1, 1, 1|S, L={L}] (per-head masks are not supported)")
    # NoMatch for a mask it cannot prove to be a hard mask (before anything is emitted)
    site.proof = masks.prove_mask(mask, additive=site.impl == "eager", dtypes=site.dtypes)
    if Sq > 1:  # NoMatch unless each query token's tokens are a prefix of the last one's (mla.decode's contract)
        try:
            attention_rows.prove_rows(mask, Sq, L)
        except NoMatch as e:  # each query token its own top-k: only the DSA emission fits (passes/dsa_tokens.py)
            if dsa_indexer.index_masked(mask) is None:
                raise
            site.rows = e
    return site


def latent_source(site: Site) -> LatentSource:
    """Identify where the latent comes from: our caches' gather op, or a plain tensor."""
    lat, kpe = site.latent, site.kpe
    if (_is_fn(lat, {operator.getitem}) and _is_fn(kpe, {operator.getitem}) and lat.args[0] is kpe.args[0]
            and lat.args[1] == 0 and kpe.args[1] == 1):
        g = lat.args[0]
        if _is_fn(g, GATHER_OPS):
            return _gather_source(g)
    if _is_fn(lat, {operator.getitem}) and _is_fn(lat.args[0], GATHER_OPS):
        raise NoMatch("latent and rope latent come from different cache gathers")
    return LatentSource("tensor", lat, kpe)


def _gather_source(node: fx.Node) -> LatentSource:
    """The pages, block table, DCP group and FP8 scales behind a `mla_hf::gather_latent` node."""
    args = list(node.args) + [None] * 9
    names = ("ckv_cache", "kpe_cache", "block_table", "max_len", "dcp_size", "dcp_rank", "group_name", "ckv_scale",
             "heads_sharded")
    a = {n: (node.kwargs[n] if n in node.kwargs else args[i]) for i, n in enumerate(names)}
    n = int(a["dcp_size"])
    return LatentSource("dcp" if n > 1 else "paged", a["ckv_cache"], a["kpe_cache"], a["block_table"],
                        dcp_size=n, dcp_rank=int(a["dcp_rank"]), group_name=a["group_name"] or "",
                        ckv_scale=a["ckv_scale"], heads_sharded=bool(a["heads_sharded"]) and n > 1)

