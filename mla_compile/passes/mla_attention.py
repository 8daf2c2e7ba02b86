"""Rewrite HF MLA decode attention into absorbed `mla.decode` / `mla.dcp_decode` over the latent cache.

Where it runs: on the Dynamo graph (torch IR, before AOTAutograd), through `backend.rewrite_graph`. There
attention has ONE form on every device (`F.scaled_dot_product_attention`, or HF's eager
matmul/softmax/matmul), while by Inductor's post-grad passes CPU has decomposed SDPA and CUDA has not.
The FX graph cache keeps working: Inductor keys on the graph it receives, which is the rewritten one.

What it matches (HF `DeepseekV3Attention` / `DeepseekV32Attention` / `GlmMoeDsaAttention`, transformers
5.17 - 5.2x), one site per layer::

    X   = linear(c, W_kv_b).view(B, L, H, nope + v).transpose(1, 2)      # c: latent [B,1,L,R]
    k_nope, V = split(X, [nope, v], -1)
    K   = new_empty(B, H, L, nope + P); K[..., :nope] = k_nope; K[..., nope:] = kpe.expand(-1, H, -1, -1)
          (or K = cat([k_nope, kpe.expand(...)], -1))                     # kpe: rope latent [B,1,L,P]
    out = sdpa(Q, K, V, attn_mask=M, scale=s)                            # or eager:
    out = matmul(dropout(softmax(matmul(Q, K.transpose(2, 3)) * s + M, -1)), V)

with Q [B, H, 1, nope + P] (decode: one query token). It is replaced by (W = W_kv_b.view(H, nope + v, R))::

    q_abs    = Q[:, :, 0, :nope] @ W[:, :nope]                            # [B, H, R]  (W_UK absorbed)
    lat, _   = mla.decode(q_abs, Q[:, :, 0, nope:], c, kpe, block_table, seq_lens, s)
    out      = (lat @ W[:, nope:].T).unsqueeze(2)                         # [B, H, 1, v] (W_UV)

so the per-step `kv_b_proj` over the whole cache disappears. Exact algebra: q.(W_UK c) = (W_UK^T q).c and
softmax.(W_UV c) = W_UV (softmax.c).

Masks: HF builds, for decode with a static cache, a boolean [B, 1, 1, L] mask (SDPA) or
`where(mask, 0, finfo.min)` (eager), possibly `& ~index_mask` / `masked_fill(index_mask, min)` (DSA).
`attention_mask.prove_mask` recovers the boolean `valid[B, L]` from that expression (anything it cannot prove
to be a hard mask is left alone: an arbitrary bias, a bool tensor ADDED to eager scores, a graph-input float
mask) and the pass turns it into a token-granular (page size 1) block table listing each row's valid tokens
(cumsum + scatter: static shapes, no host sync, CUDA-graph safe) and `seq_lens` = their count. This is exact
for any boolean mask: causal, left padding, and the DSA top-k mask. A row with no valid token gets what HF's
softmax gives it: 0 (SDPA, bool mask), NaN (eager, -inf mask), or, with one finite constant such as
finfo.min, a flat softmax over all L positions of the static cache; the rewrite gets that row the same by
listing all L slots and zeroing its query (scores 0 -> uniform weights), on device, no host sync.

Batch: the batch may be symbolic (Dynamo's automatic dynamic shapes after a batch-size change): the emitted
ops take it from `q.size(0)`. Any other symbolic dimension leaves the site alone, with a WARNING naming the
fix (`dynamic=False`).

Reads: the rewrite reads the latent, the rope latent, kv_b_proj's weight, q and the mask's inputs at the
attention, where HF read them earlier (its expansion, its mask expression). Any write in between to memory
any of them lives in (through views, slices, reshapes, aliased inputs: `_fx.first_write`) leaves the site alone.

Latent sources: a plain latent tensor (HF `StaticCache` [B, 1, L, R] buffers: flat token slots b*L + t), or
the gather op of our caches in `mla_compile.integrations.hf`: the single-rank paged cache (slots through
its block table) and the DCP-sharded cache (-> `mla.dcp_decode` over this rank's shard).

DSA dense graphs: before matching, `passes.dsa_indexer.drop_dense_indexer` replaces HF's index-masked mask by
the plain one behind the cache's `mla_hf::all_selected` marker (the graph is guarded by kv_len <= topk), so the
indexer's logits and top-k are dead and removed.

DSA sparse graphs (single rank: HF `StaticCache` / `DSAStaticCache` latent or `MLAPagedCache`): when the mask is
`A & ~I` / `A.masked_fill(I, min)` with I = ones.scatter(-1, topk(score masked by A[:, 0], k).indices, False)
and score = weights . relu(matmul(q.float(), keys^T.float()) * s) (HF's indexer, matched node by node by
`dsa_indexer.match_sparse_indexer`), the indexer's logits / top-k / scatter become one
`dsa.indexer_topk(q, weights, keys as [B*L, 1, Di], token table of A (+ b*L), count of A, k, s)` and the
attention `mla.sparse_decode` over the returned slots (translated through the block table for the paged cache).
Same selected set: HF's top-k over the L static positions ranks the invalid ones (-inf, or + finfo.min) last and
A removes them again, so it attends the top-min(k, count) valid tokens, which is what the op returns. Ties
(equal scores at the k-th place) may be broken differently (any choice is a valid top-k; HF's torch.topk
defines none). A GLM-DSA "shared" layer reuses the previous layer's selection (one op call). Counted in
`counters["mla_compile"]["dsa_sparse_rewritten"]`; anything else in the mask keeps the token-table path (logged).
DCP sparse graphs keep HF's indexer and attend through `mla.dcp_decode` over the token table of its mask.

Unmatched sites are left unchanged and logged (logger `mla_compile.passes.mla_attention`; enable with
`TORCH_LOGS="+mla_compile.passes"`; INFO, or a WARNING once per reason a user can fix: dynamic shapes, and
generate()'s precomputed eager mask). Rewrites are counted in
`torch._dynamo.utils.counters["mla_compile"]["mla_attention_rewritten"]`, skips in `..._not_rewritten`.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import attention_mask as masks
from ._fx import (Builder, DynamicShape, NoMatch, arg, batch_shape, erase_dead, fake_mode_of, finish_edits,
                  first_write, graph_of, is_fn as _is_fn, is_op as _is_op, same, val as _val)

log = logging.getLogger(__name__)

COUNTER = "mla_attention_rewritten"
SKIP_COUNTER = "mla_attention_not_rewritten"
SPARSE_COUNTER = "dsa_sparse_rewritten"

aten = torch.ops.aten

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
_MATMUL = {torch.matmul, operator.matmul, torch.Tensor.matmul}
_CAT = {torch.cat, torch.concat, torch.concatenate}
_DROPOUT = {torch.nn.functional.dropout}


# ------------------------------------------------------------------------------------------- node helpers
_arg, _shape = arg, batch_shape  # shapes: ints, with a possibly symbolic batch (dim 0)


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _shape_args(node: fx.Node, start: int = 1) -> tuple:
    args = node.args[start:]
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    return tuple(args)


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


@dataclasses.dataclass
class Site:
    out: fx.Node  # attention output [B, H, 1, v]
    q: fx.Node  # [B, H, 1, nope + P]
    weight: fx.Node  # kv_b_proj weight [H * (nope + v), R]
    latent: fx.Node  # input of kv_b_proj
    kpe: fx.Node  # rope latent before expand
    mask: Any  # fx.Node or None
    proof: masks.MaskProof  # what the mask means (valid tokens, what an empty row gives)
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
    sparse: Any = None  # dsa_indexer.SparseIndexer: DSA sparse graph -> dsa.indexer_topk + mla.sparse_decode


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
        tensors = K.args[0]
        dim = _arg(K, 1, "dim", 0)
        if _dim(dim, len(ks)) != len(ks) - 1 or len(tensors) != 2:
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
    return q, k, v, mask, float(scale), set(), {node}, (_val(q).dtype,)


def _match_eager(node: fx.Node):
    """out = matmul(dropout(softmax(matmul(Q, K.transpose(2, 3)) * s [+ M], -1).to(dt)), V)."""
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
    if not _is_op(p, "softmax"):
        if _is_fn(p, {operator.getitem}) and _is_op(p.args[0], "softmax"):
            # softmax over [scores | per-head sink], the sink column dropped (hy_v4's attention sinks): attention,
            # but not the form the rewrite proves, so it is counted and logged rather than skipped silently
            raise NoMatch("the probabilities are a slice of a wider softmax (attention sinks?): not supported")
        return None
    sm_dim = _arg(p, 1, "dim")
    if sm_dim not in (-1, 3):
        raise NoMatch(f"softmax over dim {sm_dim}")
    chain.add(p)
    s = p.args[0]
    mask = None
    dtypes = (_val(s).dtype, _val(p).dtype)  # the masked scores', then the softmax's (HF: float32)
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
    return q, kt.args[0], v, mask, scale, {kt}, chain, dtypes


def match_site(node: fx.Node) -> Site | None:
    """Return a Site if `node` is an attention output; None if it is not attention at all; NoMatch if it is
    attention that cannot be rewritten."""
    if _is_fn(node, _SDPA):
        impl = "sdpa"
        q, K, V, mask, scale, k_users, chain, dtypes = _match_sdpa(node)
    elif _is_fn(node, _MATMUL) or _is_op(node, "matmul"):
        impl = "eager"
        m = _match_eager(node)
        if m is None:
            return None
        q, K, V, mask, scale, k_users, chain, dtypes = m
    else:
        return None
    qv = _val(q)
    if not (isinstance(qv, torch.Tensor) and qv.dim() == 4):
        raise NoMatch(f"query {q.name} is not a [B, H, 1, D] tensor")
    if not (isinstance(qv.shape[2], int) and qv.shape[2] == 1):  # symbolic: Dynamo specializes a length of 1
        raise NoMatch(f"query length {qv.shape[2]} != 1 (prefill / multi-token steps are left to HF attention)")
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
        if not (len(ms) == 4 and (same(ms[0], 1) or same(ms[0], B)) and ms[1] == 1 and ms[2] == 1 and ms[3] == L):
            raise NoMatch(f"mask shape {ms} is not [B|1, 1, 1, L={L}] (per-head masks are not supported)")
    # NoMatch for a mask it cannot prove to be a hard mask (before anything is emitted)
    proof = masks.prove_mask(mask, additive=impl == "eager", dtypes=dtypes)
    # every intermediate must die with the site: no other user outside it
    for n in nodes:
        if n is node:
            continue
        extra = [u for u in n.users if u not in nodes]
        if extra:
            raise NoMatch(f"intermediate {n.name} is also used by {', '.join(u.name for u in extra)}")
    return Site(out=node, q=q, weight=weight, latent=latent, kpe=kpe, mask=mask, proof=proof, scale=scale,
                nope=nope, v_dim=v_dim, rope=P, nope_offset=nope_off, rope_offset=rope_off, heads=H, nodes=nodes,
                impl=impl, dtypes=dtypes)


# ------------------------------------------------------------------------------------------ the emission
class Memo:
    """Nodes one site emits that later sites reuse (a mask's token table, the indexer's top-k, ...).

    A reuse must see what the reusing site's HF code sees: what those nodes read must not be written between
    where they were emitted and the reusing site. Each entry keeps the graph nodes it read and where it was
    emitted (`commit`: the first node of its site's emission); `Builder.memo_hits` lists the entries a site
    reused, for `_check_reads`."""

    def __init__(self):
        self._values, self._reads, self._anchor = {}, {}, {}

    def get(self, b: Builder, key, build: Callable):
        if key in self._values:
            b.memo_hits.append(key)
            return self._values[key]
        mark, hits = len(b.created), len(b.memo_hits)
        value = build()
        new = set(b.created[mark:])
        reads = {a for n in b.created[mark:] for a in n.all_input_nodes if a not in new}
        reads |= {v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, fx.Node) and v not in new}
        for k in b.memo_hits[hits:]:
            reads |= self._reads[k]
        self._values[key], self._reads[key], self._anchor[key] = value, reads, None
        return value

    def reads_of(self, key) -> tuple:
        return self._anchor[key], self._reads[key]

    def commit(self, first: fx.Node) -> None:
        for k, a in self._anchor.items():
            if a is None:
                self._anchor[k] = first

    def snapshot(self):
        return dict(self._values), dict(self._reads), dict(self._anchor)

    def restore(self, snap) -> None:
        self._values, self._reads, self._anchor = (dict(x) for x in snap)


def _batch(b: Builder, site: Site, memo: Memo):
    """The batch size for emitted shape arguments: an int, or (symbolic batch) a node of q.size(0)."""
    B = _shape(site.q)[0]
    if isinstance(B, int):
        return B
    return memo.get(b, ("batch", str(B)), lambda: b.call(aten.sym_size.int, site.q, 0))


def _times(b: Builder, B, n: int):
    return B * n if isinstance(B, int) else b.call(operator.mul, B, n)


def _lead(B, n: int = 1) -> int:
    """B * n as a reshape size: -1 (inferred) for a symbolic batch."""
    return B * n if isinstance(B, int) else -1


def _valid_of(b: Builder, mask, proof: masks.MaskProof, B, L: int, memo: Memo):
    """bool [B, L] valid-token mask of an attention mask [B|1, 1, 1, L] (None: every token valid)."""

    def build():
        m = proof.build(b)
        if m is not None:
            m = b.call(aten.expand.default, m, [B, 1, 1, L])
            m = b.call(aten.reshape.default, m, [_lead(B), L])
        return m

    return memo.get(b, ("valid", mask), build)


def token_table(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compaction of a boolean [B, L] mask: (table int32 [B, L], counts int32 [B]) where table[b, :count]
    lists the positions t with valid[b, t] (ascending). Static shapes, no host sync. Entries past the count
    are 0 (never read)."""
    B, L = valid.shape
    counts = valid.sum(-1, dtype=torch.int32)
    dest = torch.where(valid, valid.long().cumsum(-1) - 1, L)
    src = torch.arange(L, device=valid.device, dtype=torch.int32).expand(B, L)
    table = torch.zeros(B, L + 1, device=valid.device, dtype=torch.int32).scatter(1, dest, src)
    return table[:, :L], counts


_SCAN_CHUNK = 1024


def _emit_row_cumsum(b: Builder, valid: fx.Node, B, L: int, device) -> fx.Node:
    """int64 [B, L] inclusive cumsum of valid along rows. A long row is scanned in chunks (local scans, then
    the chunk totals), so the scan runs on B * L / chunk programs instead of B (one program per 32K row
    took 37 us of a 1.2 ms HF decode step on the H200)."""
    if L <= _SCAN_CHUNK:
        return b.call(aten.cumsum.default, valid, -1, dtype=torch.int64)
    n = -(-L // _SCAN_CHUNK)
    v = b.call(aten._to_copy.default, valid, dtype=torch.int32)
    if n * _SCAN_CHUNK > L:
        pad = b.call(aten.zeros.default, [B, n * _SCAN_CHUNK - L], dtype=torch.int32, device=device)
        v = b.call(aten.cat.default, [v, pad], 1)
    local = b.call(aten.cumsum.default, b.call(aten.reshape.default, v, [_lead(B), n, _SCAN_CHUNK]), -1,
                   dtype=torch.int32)
    totals = b.call(aten.select.int, local, 2, _SCAN_CHUNK - 1)  # [B, n]
    before = b.call(aten.sub.Tensor, b.call(aten.cumsum.default, totals, -1, dtype=torch.int32), totals)
    cum = b.call(aten.add.Tensor, local, b.call(aten.unsqueeze.default, before, 2))
    cum = b.call(aten.slice.Tensor, b.call(aten.reshape.default, cum, [_lead(B), n * _SCAN_CHUNK]), 1, 0, L)
    return b.call(aten._to_copy.default, cum, dtype=torch.int64)


def _emit_token_table(b: Builder, valid: fx.Node, B, L: int, device):
    """(table int32 [B, L] of valid LOGICAL positions, counts int32 [B]) as aten nodes. The counts are the scan's
    last column, not a row sum: Inductor fused a [B, L] sum with the scatter into one reduction kernel of B
    programs (17.7 us of an 0.85 ms H=16 32K HF step on the H200)."""
    cum = _emit_row_cumsum(b, valid, B, L, device)
    counts = b.call(aten._to_copy.default, b.call(aten.select.int, cum, 1, L - 1), dtype=torch.int32)
    pos = b.call(aten.sub.Tensor, cum, 1)
    dest = b.call(aten.where.ScalarOther, valid, pos, L)
    src = _all_positions(b, B, L, device)
    zeros = b.call(aten.zeros.default, [B, L + 1], dtype=torch.int32, device=device)
    table = b.call(aten.scatter.src, zeros, 1, dest, src)
    table = b.call(aten.slice.Tensor, table, 1, 0, L)
    return table, counts


def _all_positions(b: Builder, B, L: int, device) -> fx.Node:
    """int32 [B, L]: every row lists positions 0 .. L-1."""
    return b.call(aten.expand.default, b.call(aten.arange.default, L, dtype=torch.int32, device=device), [B, L])


def _emit_slots(b: Builder, site: Site, src: LatentSource, B, L: int, memo: Memo):
    """(ckv [N, 1, R], kpe [N, 1, P], table int32 [B, T], seq_lens int32 [B], empty) for mla.decode: a page
    size 1 view of the latent where table rows list the physical slots of each row's valid tokens. empty:
    bool [B], the rows with no valid token (None where the mask's empty rows need nothing: no mask, or 0 as
    mla.decode gives). With "uniform" empty rows (HF's flat softmax over the whole cache) those rows list all L
    tokens; their query is zeroed by the caller."""
    device = _val(site.q).device
    R, P = _shape(site.latent)[-1], site.rope
    empty_rows = site.proof.empty_rows

    def build():
        valid = _valid_of(b, site.mask, site.proof, B, L, memo)
        if valid is None:  # every token valid: no row is ever empty
            if src.kind != "dcp":
                table = _all_positions(b, B, L, device)
                seq_lens = b.call(aten.full.default, [B], L, dtype=torch.int32, device=device)
                return _physical(b, table, src, B, L, device, memo), seq_lens, None
            valid = b.call(aten.full.default, [B, L], True, dtype=torch.bool, device=device)
            empty_rows_here = masks.EMPTY_ZERO
        else:
            empty_rows_here = empty_rows
        empty = None
        if src.kind == "dcp":
            if empty_rows_here != masks.EMPTY_ZERO:  # emptiness is global: from the whole row, before sharding
                empty = b.call(aten.logical_not.default, b.call(aten.any.dim, valid, -1))
                if empty_rows_here == masks.EMPTY_UNIFORM:
                    valid = b.call(aten.bitwise_or.Tensor, valid, b.call(aten.unsqueeze.default, empty, 1))
            # this rank's local position j holds global token j * n + r; valid restricted to those
            n, r = src.dcp_size, src.dcp_rank
            cap = _shape(src.block_table)[1] * _shape(src.ckv)[1]  # local token capacity
            need = cap * n
            if need > L:  # pad to a multiple of n (positions >= L are never valid)
                pad = b.call(aten.full.default, [B, need - L], False, dtype=torch.bool, device=device)
                valid = b.call(aten.cat.default, [valid, pad], 1)
            else:
                valid = b.call(aten.slice.Tensor, valid, 1, 0, need)
            valid = b.call(aten.reshape.default, valid, [_lead(B), cap, n])
            valid = b.call(aten.select.int, valid, 2, r)  # [B, cap] local validity
            table, seq_lens = _emit_token_table(b, valid, B, cap, device)
            # dcp_decode derives local lengths from "global" ones: c * n has local length c
            seq_lens = b.call(aten.mul.Tensor, seq_lens, src.dcp_size)
        else:
            table, seq_lens = _emit_token_table(b, valid, B, L, device)
            if empty_rows_here != masks.EMPTY_ZERO:
                empty = b.call(aten.eq.Scalar, seq_lens, 0)
                if empty_rows_here == masks.EMPTY_UNIFORM:  # an empty row lists every position
                    table = b.call(aten.where.self, b.call(aten.unsqueeze.default, empty, 1),
                                   _all_positions(b, B, L, device), table)
                    seq_lens = b.call(aten.where.ScalarSelf, empty, L, seq_lens)
        return _physical(b, table, src, B, L, device, memo), seq_lens, empty

    table, seq_lens, empty = memo.get(b, ("slots", src.kind, src.block_table, site.mask, src.dcp_rank), build)
    ckv, kpe = _flat_latent(b, src, B, L, R, P)
    return ckv, kpe, table, seq_lens, empty


def _physical(b: Builder, table: fx.Node, src: LatentSource, B, L: int, device, memo: Memo) -> fx.Node:
    """Logical positions -> physical slots of the flat (page size 1) latent view."""
    if src.kind == "tensor":
        return b.call(aten.add.Tensor, table, _row_base(b, B, L, device, memo))
    return _paged_slots(b, table, src)


def _flat_latent(b: Builder, src: LatentSource, B, L: int, R: int, P: int):
    """The latent as a page size 1 cache (ckv [N, 1, R], kpe [N, 1, P]); slot = the physical slot."""
    n = _lead(B, L) if src.kind == "tensor" else -1
    ckv = b.call(aten.reshape.default, src.ckv, [n, 1, R])
    kpe = b.call(aten.reshape.default, src.kpe, [n, 1, P])
    return ckv, kpe


def _row_base(b: Builder, B, L: int, device, memo: Memo) -> fx.Node:
    """int32 [B, 1]: b * L, the first flat slot of row b in a [B, L, ...] buffer."""

    def build():
        base = b.call(aten.arange.start_step, 0, _times(b, B, L), L, dtype=torch.int32, device=device)
        return b.call(aten.unsqueeze.default, base, 1)

    return memo.get(b, ("row_base", str(B), L), build)


def _emit_sparse_indices(b: Builder, site: Site, src: LatentSource, B, L: int, memo: Memo):
    """(int32 [B, k]: the latent's physical slots of the tokens HF's indexer selects, -1 padded; counts int32 [B]
    of the attention mask A's valid tokens).

    HF: topk(score masked by A, k).indices over the static cache's L positions (invalid ones at -inf or
    + finfo.min), index_mask keeps them, A & ~index_mask drops the invalid ones again: the attended set is
    the top-min(k, count) valid tokens by score. `dsa.indexer_topk` over a page size 1 view of the indexer
    key cache [B, L, Di] -> [B*L, 1, Di], whose block table lists each row's valid tokens (the token table of
    A, slots b*L + t) and seq_lens = their count, returns exactly that set (same score formula: weights are
    HF's weights_proj(x)*Hi^-0.5 in float32, sm_scale HF's softmax_scale). Ties: any choice among equal
    scores (HF's torch.topk does not define one either). Rows with count <= k skip the logits (identity)."""
    sp = site.sparse
    device = _val(site.q).device
    proof = masks.prove_mask(sp.A, additive=site.impl == "eager", dtypes=site.dtypes)
    valid = _valid_of(b, sp.A, proof, B, L, memo)
    if valid is None:
        raise NoMatch("DSA indexer without an attention mask")
    table, counts = memo.get(b, ("table", sp.A), lambda: _emit_token_table(b, valid, B, L, device))

    def indexer():  # a GLM-DSA "shared" layer reuses the previous layer's top-k: one indexer call
        ktable = b.call(aten.add.Tensor, table, _row_base(b, B, L, device, memo))  # indexer slots b*L + t
        _, _, Hi, Di = _shape(sp.q)
        kc = b.call(aten.reshape.default, sp.keys, [_lead(B, L), 1, Di])
        qi = b.call(aten.reshape.default, sp.q, [_lead(B), Hi, Di])
        w = b.call(aten.reshape.default, sp.weights, [_lead(B), Hi])
        return b.call(torch.ops.dsa.indexer_topk.default, qi, w, kc, ktable, counts, sp.k, sp.scale)

    idx = memo.get(b, ("indexer", sp.topk), indexer)
    if src.kind == "tensor":  # the latent [B, 1, L, R] has the same flat slots b*L + t
        return idx, counts

    def paged():  # indexer slot b*L + t -> token t -> block_table[b, t // PS] * PS + t % PS
        keep = b.call(aten.ge.Scalar, idx, 0)
        t = b.call(aten.sub.Tensor, idx, _row_base(b, B, L, device, memo))
        t = b.call(aten.where.ScalarOther, keep, t, 0)
        return b.call(aten.where.ScalarOther, keep, _paged_slots(b, t, src), -1)

    return memo.get(b, ("indexer_paged", sp.topk, src.block_table), paged), counts


def _paged_slots(b: Builder, t: fx.Node, src: LatentSource) -> fx.Node:
    """int32 physical slots of logical token positions t [B, K] of a paged latent:
    block_table[b, t // PS] * PS + t % PS."""
    PS = _shape(src.ckv)[1]
    page = b.call(aten.div.Tensor_mode, t, PS, rounding_mode="floor")
    page = b.call(aten.gather.default, src.block_table, 1, b.call(aten._to_copy.default, page, dtype=torch.int64))
    slot = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, page, PS), b.call(aten.remainder.Scalar, t, PS))
    return b.call(aten._to_copy.default, slot, dtype=torch.int32)


def latent_source(site: Site) -> LatentSource:
    """Identify where the latent comes from: our caches' gather op, or a plain tensor."""
    from ..integrations import hf as hf_int

    lat, kpe = site.latent, site.kpe
    if (_is_fn(lat, {operator.getitem}) and _is_fn(kpe, {operator.getitem}) and lat.args[0] is kpe.args[0]
            and lat.args[1] == 0 and kpe.args[1] == 1):
        g = lat.args[0]
        if _is_fn(g, hf_int.GATHER_OPS):
            return hf_int.describe_gather(g, LatentSource)
    if _is_fn(lat, {operator.getitem}) and _is_fn(lat.args[0], getattr(hf_int, "GATHER_OPS", set())):
        raise NoMatch("latent and rope latent come from different cache gathers")
    return LatentSource("tensor", lat, kpe)


def _q_part(b: Builder, q: fx.Node, start: int, width: int) -> fx.Node:
    """q[:, :, 0, start:start + width] as [B, H, width]. When q is a cat on its last dim (HF: cat(q_pass, q_rot))
    and one of its parts is exactly that range, the part itself: nothing then reads the cat, so Inductor need not
    materialize q (a copy kernel per layer) and computes the roped part straight into the decode's input."""
    if _is_fn(q, _CAT) and _dim(_arg(q, 1, "dim", 0), len(_shape(q))) == len(_shape(q)) - 1:
        off = 0
        for part in q.args[0]:
            w = _shape(part)[-1]
            if off == start and w == width and same(_shape(part)[:-1], _shape(q)[:-1]):
                return b.call(aten.select.int, part, 2, 0)
            off += w
    return b.call(aten.slice.Tensor, b.call(aten.select.int, q, 2, 0), 2, start, start + width)


# how the absorbed projections are written: "auto" (default): `mla.per_head_linear` (one few-token Triton launch
# writing [B, H, N], PDL-chained with its neighbours) for CUDA half-precision decode batches, else "bmm" (over
# heads, then a transpose copy). Measured (H200, HF H=16 32K greedy step, side by side): with q_b / o_proj also
# on the few-token kernel (passes/fused_linear.py) 679.5 vs 689.0 us a step. An Inductor-generated multiply + sum
# was measured slower (747 vs 736 us) and removed.
_ABSORB = "auto"


def _absorb_with_kernel(x: torch.Tensor) -> bool:
    """x [B, H, K]: per head, B rows (a symbolic B: never, the kernels' range is a static row count)."""
    if _ABSORB != "auto":
        return _ABSORB == "per_head_linear"
    from .fused_linear import few_token_worth_it

    return few_token_worth_it(x, rows=x.shape[0])


def _per_head_matmul(b: Builder, x: fx.Node, w: fx.Node, contract_last: bool) -> fx.Node:
    """y[b, h] = x[b, h] @ w[h] (w [H, K, N]), or x[b, h] @ w[h]^T with contract_last (w [H, N, K]): [B, H, N]."""
    if _absorb_with_kernel(_val(x)):
        weight = w if contract_last else b.call(aten.transpose.int, w, 1, 2)  # [H, N, K]
        return b.call(torch.ops.mla.per_head_linear.default, x, weight)
    xt = b.call(aten.transpose.int, x, 0, 1)
    y = b.call(aten.bmm.default, xt, b.call(aten.transpose.int, w, 1, 2) if contract_last else w)  # [H, B, N]
    return b.call(aten.transpose.int, y, 0, 1)


def _rows(b: Builder, empty: fx.Node) -> fx.Node:
    """bool [B] -> [B, 1, 1] (broadcast over heads and features)."""
    return b.call(aten.unsqueeze.default, b.call(aten.unsqueeze.default, empty, 1), 2)


def _emit(b: Builder, site: Site, src: LatentSource, memo: Memo) -> fx.Node:
    """The absorbed computation; returns the node replacing the attention output [B, H, 1, v]."""
    Bs, H, _, _ = _shape(site.q)  # Bs: int or SymInt
    B = _batch(b, site, memo)  # for shape arguments: int or a node
    L, R = _shape(site.latent)[-2:]
    nope, v_dim, P = site.nope, site.v_dim, site.rope
    empty_rows = site.proof.empty_rows
    # q_pe and q_abs stay strided views (last dim contiguous): the decode ops take any batch/head strides, so no
    # copy kernels before the attention
    q_nope = _q_part(b, site.q, site.nope_offset, nope)
    q_pe = _q_part(b, site.q, site.rope_offset, P)
    w = b.call(aten.reshape.default, site.weight, [H, nope + v_dim, R])
    w_uk = b.call(aten.slice.Tensor, w, 1, 0, nope)  # [H, nope, R]
    w_uv = b.call(aten.slice.Tensor, w, 1, nope, nope + v_dim)  # [H, v, R]
    q_abs = _per_head_matmul(b, q_nope, w_uk, contract_last=False)  # [B, H, R]
    if site.sparse is not None:  # DSA sparse graph: HF's indexer -> dsa.indexer_topk, attention over its slots
        idx, counts = _emit_sparse_indices(b, site, src, B, L, memo)
        ckv, kpe = _flat_latent(b, src, B, L, R, P)
        res = b.call(torch.ops.mla.sparse_decode.default, q_abs, q_pe, ckv, kpe, idx, site.scale)
        lat = b.item(res, 0)  # [B, H, R]
        empty = None if empty_rows == masks.EMPTY_ZERO else b.call(aten.eq.Scalar, counts, 0)
        if empty_rows == masks.EMPTY_UNIFORM:
            # HF: every score of an empty row rounds to the mask constant, so it attends all L positions alike;
            # the k-wide sparse op cannot list them: a second decode over every slot, with zero queries (scores 0)
            # and length L on the empty rows only (0 elsewhere: nothing to read)
            device = _val(site.q).device
            table = memo.get(b, ("all_slots", src.kind, src.block_table),
                             lambda: _physical(b, _all_positions(b, B, L, device), src, B, L, device, memo))
            lens = b.call(aten._to_copy.default, b.call(aten.where.Scalar, empty, L, 0), dtype=torch.int32)
            flat = b.call(torch.ops.mla.decode.default, b.call(aten.zeros_like.default, q_abs),
                          b.call(aten.zeros_like.default, q_pe), ckv, kpe, table, lens, site.scale)
            lat = b.call(aten.where.self, _rows(b, empty), b.item(flat, 0), lat)
    else:
        ckv, kpe, table, seq_lens, empty = _emit_slots(b, site, src, B, L, memo)
        if empty is not None and empty_rows == masks.EMPTY_UNIFORM:
            # an empty row lists every slot; a zero query gives each score 0: HF's flat softmax over the cache
            rows = _rows(b, empty)
            q_abs = b.call(aten.where.ScalarSelf, rows, 0.0, q_abs)
            q_pe = b.call(aten.where.ScalarSelf, rows, 0.0, q_pe)
        if src.kind == "dcp":
            # check_lens=False: these seq_lens are this rank's own token count times n, not lengths shared by
            # every rank, so dcp_decode must not compare them across ranks (shapes still are)
            res = b.call(torch.ops.mla.dcp_decode.default, q_abs, q_pe, ckv, kpe, table, seq_lens, site.scale,
                         src.dcp_size, src.dcp_rank, src.group_name, False)
        else:
            res = b.call(torch.ops.mla.decode.default, q_abs, q_pe, ckv, kpe, table, seq_lens, site.scale)
        lat = b.item(res, 0)  # [B, H, R]
    if empty is not None and empty_rows == masks.EMPTY_NAN:  # HF: softmax of a row of -inf
        lat = b.call(aten.where.ScalarSelf, _rows(b, empty), float("nan"), lat)
    out = _per_head_matmul(b, lat, w_uv, contract_last=True)  # [B, H, v]
    out = b.call(aten.unsqueeze.default, out, 2)  # [B, H, 1, v]
    ov = _val(site.out)
    if not same(tuple(ov.shape), (Bs, H, 1, v_dim)) or ov.dtype != _val(out).dtype:
        raise NoMatch(f"rewritten output {tuple(_val(out).shape)} differs from attention's {tuple(ov.shape)}")
    return out


def _check_reads(graph: fx.Graph, b: Builder, site: Site, src: LatentSource, memo: Memo) -> None:
    """The rewrite reads its inputs at the attention; HF read them earlier (kv_b_proj reads the latent and its
    weight, the K assembly the rope latent, the mask expression its inputs, a reused entry where it was emitted).
    No write in between may reach memory any of them lives in."""
    created = set(b.created)
    consumers = set(site.nodes) | site.proof.nodes | {site.q}
    if site.sparse is not None:
        consumers |= site.sparse.nodes
    if src.kind != "tensor":
        consumers.add(site.latent.args[0])  # the cache's gather reads the pages and the block table
    order = {n: i for i, n in enumerate(graph.nodes)}
    reads = {}
    for r in {a for n in b.created for a in n.all_input_nodes if a not in created}:
        seen = [u for u in r.users if u in consumers]
        reads[r] = min(seen, key=order.__getitem__) if seen else r
    for key in b.memo_hits:
        anchor, entry_reads = memo.reads_of(key)
        if anchor is None:  # emitted by this site (reused within it): its reads are this site's own
            continue
        for r in entry_reads:
            if r not in reads or order[anchor] < order[reads[r]]:
                reads[r] = anchor
    hit = first_write(graph, reads, b.created[0])
    if hit is not None:
        writer, r = hit
        raise NoMatch(f"{writer.name} writes memory that {r.name} lives in after HF read it and before the "
                      f"attention (what the rewrite would read there differs)")


def rewrite_site(graph: fx.Graph, site: Site, src: LatentSource, fake_mode, memo: Memo) -> None:
    # insert right before the attention: every input (q, weight, latent, mask) is defined by then;
    # _check_reads proves they still hold what HF read
    b = Builder(graph, site.out, fake_mode, site.out)
    saved = memo.snapshot()
    try:
        out = _emit(b, site, src, memo)
        _check_reads(graph, b, site, src, memo)
    except BaseException:
        memo.restore(saved)
        b.rollback()
        raise
    memo.commit(b.created[0])
    site.out.replace_all_uses_with(out)
    for n in sorted(site.nodes, key=_order(graph), reverse=True):
        if not n.users:
            graph.erase_node(n)
    if src.kind != "tensor":  # the cache's gather (a collective for DCP) is dead now: drop it
        gather = site.latent.args[0]
        for n in (site.latent, site.kpe, gather):
            if not n.users:
                graph.erase_node(n)
    if site.sparse is not None:  # HF's index mask, top-k, logits and weights are dead now (pure nodes only)
        erase_dead(graph, [site.mask])


def _sparse_indexer(graph: fx.Graph, site: Site, src: LatentSource):
    """The DSA sparse-graph indexer behind the site's mask, or None (HF's top-k mask then becomes mla.decode's
    token table, which is exact too; the reason is logged)."""
    from .dsa_indexer import NotSparse, match_sparse_indexer

    try:
        sp = match_sparse_indexer(site.mask)
        if sp is None:
            return None
        if src.kind not in ("tensor", "paged"):
            raise NotSparse(f"{src.kind} latent (the DCP sparse graph keeps HF's indexer + mla.dcp_decode)")
        B, L = _shape(site.q)[0], _shape(site.latent)[-2]
        if not same(_shape(sp.keys)[:2], (B, L)):
            raise NotSparse(f"indexer keys {_shape(sp.keys)} do not cover the latent's [B={B}, L={L}] tokens")
        masks.prove_mask(sp.A, additive=site.impl == "eager", dtypes=site.dtypes)  # a hard mask (NoMatch otherwise)
        return sp
    except (NotSparse, NoMatch) as e:
        log.info("mla_attention: DSA indexer at %s kept (HF top-k mask -> token table): %s", site.out.name, e)
        return None


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]


# ----------------------------------------------------------------------------------------------- the pass
# reasons a user can do something about: a WARNING the first time (per process), naming the fix; INFO after
_FIXES = {
    DynamicShape: "compile with dynamic=False (one static graph per shape; a batch-size change alone keeps the "
                  "rewrite with a symbolic batch)",
    masks.InputMask: "use attn_implementation='sdpa' (generate() then hands over a bool mask), or let the forward "
                     "build the eager mask in the graph: a `create_masks_for_generate` on the model that returns "
                     "the 2-D attention_mask padded to the cache length (README, 'Compiling HF models')",
}
_warned: set = set()


def _log_skip(node: fx.Node, e: NoMatch) -> None:
    fix = next((f for kind, f in _FIXES.items() if isinstance(e, kind)), None)
    if fix is not None and fix not in _warned:
        _warned.add(fix)
        log.warning("mla_attention: not rewritten: attention at %s: %s. To rewrite it: %s", node.name, e, fix)
    else:
        log.info("mla_attention: not rewritten: attention at %s: %s", node.name, e)


def rewrite_mla_attention(gm: fx.GraphModule | fx.Graph, example_inputs=None) -> int:
    """Rewrite every matched decode site of `gm` (a Dynamo graph, or its fx.Graph) in place; returns the
    number rewritten. `example_inputs` is accepted for the backend-hook signature (metadata comes from the
    nodes' `example_value`)."""
    graph = graph_of(gm)
    from .dsa_indexer import drop_dense_indexer

    dropped = drop_dense_indexer(graph)  # DSA dense graph: HF's index mask is "all selected" -> A alone
    candidates = [n for n in graph.nodes if _is_fn(n, _SDPA) or _is_fn(n, _MATMUL) or _is_op(n, "matmul")]
    fake_mode = None
    memo = Memo()
    rewritten = sparse = 0
    counters = torch._dynamo.utils.counters["mla_compile"]
    for node in candidates:
        if getattr(node, "_erased", False):  # removed by an earlier rewrite
            continue
        try:
            site = match_site(node)
            if site is None:
                continue
            src = latent_source(site)
            if fake_mode is None:
                fake_mode = fake_mode_of(graph)
            site.sparse = _sparse_indexer(graph, site, src)
            if site.sparse is not None:
                try:
                    rewrite_site(graph, site, src, fake_mode, memo)
                except NoMatch as e:  # rolled back: fall back to HF's top-k mask as a token table
                    log.info("mla_attention: DSA indexer at %s kept: %s", node.name, e)
                    site.sparse = None
            if site.sparse is None:
                rewrite_site(graph, site, src, fake_mode, memo)
        except NoMatch as e:
            counters[SKIP_COUNTER] += 1
            _log_skip(node, e)
            continue
        except Exception as e:  # noqa: BLE001 - a bug in the pass must not break the user's model
            counters[SKIP_COUNTER] += 1
            log.warning("mla_attention: not rewritten: attention at %s: internal error %s: %s (site left "
                        "unchanged; please report)", node.name, type(e).__name__, e, exc_info=True)
            continue
        rewritten += 1
        if site.sparse is not None:
            sparse += 1
        log.info("mla_attention: rewrote %s attention at %s (H=%d, R=%d, rope=%d, %s latent) -> %s",
                 site.impl, node.name, site.heads, _shape(site.latent)[-1], site.rope, src.kind,
                 "dsa.indexer_topk + mla.sparse_decode" if site.sparse is not None
                 else "mla.dcp_decode" if src.kind == "dcp" else "mla.decode")
    if rewritten or dropped:
        finish_edits(graph)
        if rewritten:
            counters[COUNTER] += rewritten
        if sparse:
            counters[SPARSE_COUNTER] += sparse
    return rewritten


class MLAAttentionPass(CustomGraphPass):
    """The rewrite as a `CustomGraphPass` (uuid: hash of this file), for callers that hold a Dynamo-level
    (torch IR) graph; `backend.rewrite_graph` runs it on the Dynamo graph before AOTAutograd. It does not
    match ATen / post-grad graphs (there SDPA is decomposed on CPU and fused on CUDA)."""

    def __call__(self, graph: fx.Graph) -> None:
        rewrite_mla_attention(graph)

    def uuid(self) -> bytes:
        from . import _fx, dsa_indexer

        return get_hash_for_files((__file__, dsa_indexer.__file__, _fx.__file__, masks.__file__))
