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

Attention sinks (HF eager hy_v4 / hy_v4_vl): the probabilities are softmax(cat([scores + M, z_h], -1))[..., :-1],
a softmax over the scores and one sink logit z_h per head whose column is then dropped. That is
softmax(scores + M) * sigmoid(lse - z_h) per head (lse = logsumexp(scores + M), natural log): the rewrite scales
the decode op's output by that factor, from the lse the op returns (DCP: the merged one); a row with no valid
token attends only the sink, 0.

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
ops take it from `q.size(0)`. Any other size Dynamo made symbolic after it changed between calls (a new static
cache of another length, another number of query tokens up to MAX_QUERY_TOKENS) is specialized to the call's
(`_fx.specialize_site`: a guard, so each size compiles its own graph, as under dynamic=False; counted in
`mla_attention_sizes_specialized`). Left alone, with a WARNING naming the fix: a key length that grows by
concatenation (HF's DynamicCache: a new size every step, which would compile a graph per step).

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
defines none). A GLM-DSA "shared" layer reuses the previous layer's selection (one op call). S = 2-8 query
tokens (verification steps): HF gives each query token its own top-k over its own row of A; `dsa_tokens` emits
`dsa.indexer_topk` over one row per query token and `mla.sparse_decode` with indices [B, S, K]. Counted in
`counters["mla_compile"]["dsa_sparse_rewritten"]`; anything else in the mask keeps the token-table path (logged).
DCP sparse graphs (`MLAPagedCache(dcp=...)`, indexer keys sharded beside the latent): `dsa.dcp_indexer_topk` over
each rank's key shard (exact global top-k, one all-gather of candidates) and `mla.dcp_decode` over each rank's
selected slots (`passes.dsa_dcp`). TP x DCP (the cache's gather says the heads are split over the group): every DCP
site emits `mla.tp_dcp_decode` in place of `mla.dcp_decode` (same arguments).

Sites the decode ops cannot take (an unprovable mask: HF continuous batching's host-built 4-D mask, a user's
graph-input mask; more than MAX_QUERY_TOKENS query tokens; rows no prefix of each other) get the second form where
it costs no more than HF's own: HF's attention absorbed over the latent with HF's mask as it is
(`attention_dense`; counted in `mla_attention_dense_rewritten`).

Unmatched sites are left unchanged and logged (logger `mla_compile.passes.mla_attention`; enable with
`TORCH_LOGS="+mla_compile.passes"`; INFO, or a WARNING once per reason a user can fix: dynamic shapes, and
generate()'s precomputed eager mask). Rewrites are counted in
`torch._dynamo.utils.counters["mla_compile"]["mla_attention_rewritten"]`, skips in `..._not_rewritten`.

This module is the driver (which sites, in what order, fallbacks, logging); the jobs live beside it:
`attention_match` (the matcher: `Site`, `LatentSource`), `attention_mask` (what a mask means), `attention_emit`
(the replacement), `attention_checks` (what must hold before a site is replaced), `dsa_indexer` (HF's indexer).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .. import tuning
from . import (_fx, attention_checks, attention_dense, attention_emit, attention_mask as masks, attention_match,
               attention_rows, attention_tokens, dsa_dcp, dsa_indexer, dsa_tokens, dsa_tokens_dcp)
from ._fx import (Builder, DynamicShape, NoMatch, batch_shape as _shape, erase_dead, fake_mode_of, finish_edits,
                  graph_of, same)
from .attention_checks import check_output, check_reads
from .attention_emit import Memo, emit
from .attention_match import LatentSource, Site, is_attention, latent_source, match_site

log = logging.getLogger(__name__)

COUNTER = "mla_attention_rewritten"
SKIP_COUNTER = "mla_attention_not_rewritten"
SPARSE_COUNTER = "dsa_sparse_rewritten"
TOKENS_COUNTER = "mla_attention_multi_token_rewritten"  # sites with S > 1 query tokens (also in COUNTER)
SPECIALIZED_COUNTER = "mla_attention_sizes_specialized"  # sites whose symbolic sizes were made static first
DENSE_COUNTER = attention_dense.COUNTER  # sites taken as absorbed attention with HF's own mask (not in COUNTER)
# the files whose code decides what the rewrite emits (the pass manager's uuid hashes them)
SOURCES = (__file__,) + tuple(m.__file__ for m in (attention_match, masks, attention_emit, attention_checks,
                                                     attention_dense, attention_rows, attention_tokens, dsa_indexer,
                                                     dsa_dcp, dsa_tokens, dsa_tokens_dcp, _fx))



def rewrite_site(graph: fx.Graph, site: Site, src: LatentSource, fake_mode, memo: Memo) -> None:
    # insert right before the attention: every input (q, weight, latent, mask) is defined by then;
    # check_reads proves they still hold what HF read
    saved = memo.snapshot()
    try:
        with Builder(graph, site.out, fake_mode, site.out).all_or_nothing() as b:
            write = (emit if site.tokens == 1 else dsa_tokens.emit_sparse_tokens if site.sparse is not None
                     else attention_tokens.emit_tokens)  # S > 1: the multi-token contracts
            # how W_UK / W_UV are written: tuning.py says why
            out = write(b, site, src, memo, tuning.current().absorb)
            check_output(site, out)
            check_reads(graph, b, site, src, memo)
    except BaseException:
        memo.restore(saved)
        raise
    memo.commit(b.created[0])
    _replace(graph, site, out)
    if src.kind != "tensor":  # the cache's gather (a collective for DCP) is dead now: drop it
        gather = site.latent.args[0]
        for n in (site.latent, site.kpe, gather):
            if not n.users:
                graph.erase_node(n)
    if site.sparse is not None:  # HF's index mask, top-k, logits and weights are dead now (pure nodes only)
        erase_dead(graph, [site.mask])


def _replace(graph: fx.Graph, site: Site, out: fx.Node) -> None:
    site.out.replace_all_uses_with(out)
    for n in sorted(site.nodes, key=_order(graph), reverse=True):
        if not n.users:
            graph.erase_node(n)


def rewrite_dense(graph: fx.Graph, node: fx.Node, fake_mode, why: NoMatch) -> Site:
    """The absorbed form with HF's own mask (`attention_dense`) at a site the decode ops could not take (`why`);
    raises NoMatch (of why's kind, so a fix is still named) with both reasons where it cannot either."""
    try:
        site = attention_match.match_structure(node)
        if site is None:
            raise why
        attention_dense.check(site)
        with Builder(graph, site.out, fake_mode, site.out).all_or_nothing() as b:
            out = attention_dense.emit_dense(b, site)
            check_output(site, out)
            check_reads(graph, b, site, LatentSource("tensor", site.latent, site.kpe), Memo())
    except NoMatch as e:
        if e is why:
            raise
        raise type(why)(f"{why}; nor as absorbed attention with HF's mask: {e}") from None
    _replace(graph, site, out)
    return site


def _sparse_indexer(graph: fx.Graph, site: Site, src: LatentSource):
    """The DSA sparse-graph indexer behind the site's mask, or None (HF's top-k mask then becomes mla.decode's
    token table, which is exact too; the reason is logged)."""
    NotSparse = dsa_indexer.NotSparse
    try:
        sp = dsa_indexer.match_sparse_indexer(site.mask)
        if sp is None:
            return None
        if site.tokens > 1:
            dsa_tokens.check(site, sp, src)
        elif src.kind == "dcp":  # the indexer keys must be our cache's shard beside the latent's
            sp.shard = dsa_dcp.key_shard(sp.keys, src)
            sp.nodes |= sp.shard.nodes  # where HF reads the key pages (for check_reads)
        elif src.kind not in ("tensor", "paged"):
            raise NotSparse(f"{src.kind} latent")
        B, L = _shape(site.q)[0], _shape(site.latent)[-2]
        if not same(_shape(sp.keys)[:2], (B, L)):
            raise NotSparse(f"indexer keys {_shape(sp.keys)} do not cover the latent's [B={B}, L={L}] tokens")
        masks.prove_mask(sp.A, additive=site.impl == "eager", dtypes=site.dtypes)  # a hard mask (NoMatch otherwise)
        return sp
    except (NotSparse, NoMatch) as e:
        if site.rows is not None:  # no token-table fallback for a per-query-token top-k mask: the site stays HF's
            site.rows = NoMatch(f"{site.tokens}-token DSA step (each query token its own top-k, no shared token "
                                f"table): indexer not proven: {e}")
        log.info("mla_attention: DSA indexer at %s kept (HF top-k mask -> token table): %s", site.out.name, e)
        return None


def _emitted(site: Site, src: LatentSource) -> str:
    """What a rewritten site became (for the log)."""
    attention = ("mla.tp_dcp_decode" if src.heads_sharded else "mla.dcp_decode") if src.kind == "dcp" else "mla.decode"
    if site.sparse is None:
        return attention
    return f"dsa.dcp_indexer_topk + {attention}" if src.kind == "dcp" else "dsa.indexer_topk + mla.sparse_decode"


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]


# ----------------------------------------------------------------------------------------------- the pass
# reasons a user can do something about: a WARNING the first time (per process), naming the fix; INFO after
_FIXES = {
    DynamicShape: "use a static cache (StaticCache, DSAStaticCache, MLAPagedCache): HF's DynamicCache grows by "
                  "concatenation, a new key length every step, which a static graph per length would recompile "
                  "every step",
    masks.InputMask: "use attn_implementation='sdpa' (generate() then hands over a bool mask), or let the forward "
                     "build the eager mask in the graph: a `create_masks_for_generate` on the model that returns "
                     "the 2-D attention_mask padded to the cache length (README, 'HF generate()': eager attention; "
                     "optimize_generate(model) installs it)",
    attention_match.KVInput: "remove the graph break (TORCH_LOGS=graph_breaks names it); where it is a "
                             "data-dependent shape in the model's code (glm5_next's kpool indexer: "
                             "`pool_keys[:, keep]`), torch._dynamo.config.capture_dynamic_output_shape_ops = True "
                             "traces it into the attention's graph (optimize_generate(model) sets it for a "
                             "glm5_next model's generate()). A model whose cache holds per-head K / V "
                             "(transformers 5.17's glm5_next) has no latent to attend over: a newer transformers "
                             "caches the latent",
}
_warned: set = set()


def _new_fix(e: NoMatch) -> str | None:
    """The fix a user can apply for `e`, the first time it comes up in this process (a WARNING then); else None."""
    fix = next((f for kind, f in _FIXES.items() if isinstance(e, kind)), None)
    if fix is None or fix in _warned:
        return None
    _warned.add(fix)
    return fix


def _log_skip(node: fx.Node, e: NoMatch) -> None:
    fix = _new_fix(e)
    if fix is not None:
        log.warning("mla_attention: not rewritten: attention at %s: %s. To rewrite it: %s", node.name, e, fix)
    else:
        log.info("mla_attention: not rewritten: attention at %s: %s", node.name, e)


def _log_internal_error(node: fx.Node, e: Exception, context: str = "") -> None:
    log.warning("mla_attention: not rewritten: attention at %s: %sinternal error %s: %s (site left unchanged; please "
                "report)", node.name, context, type(e).__name__, e, exc_info=True)


def _log_dense(node: fx.Node, site: Site, e: NoMatch) -> None:
    """A site taken as absorbed attention with HF's mask: INFO; and a WARNING the first time when the user can get
    the decode ops for it (the fix named)."""
    how = (f"rewrote {site.impl} attention at {node.name} (H={site.heads}, S={site.tokens}, "
           f"R={_shape(site.latent)[-1]}, rope={site.rope}) -> absorbed attention with HF's mask (the decode ops "
           f"could not take it: {e})")
    fix = _new_fix(e)
    if fix is not None:
        log.warning("mla_attention: %s. For the decode kernels: %s", how, fix)
    else:
        log.info("mla_attention: %s", how)


def _rewrite_one(graph: fx.Graph, node: fx.Node, fake_mode, memo: Memo):
    """Rewrite the attention at `node`: (site, latent source), None where `node` is no attention, NoMatch (the graph
    unchanged) where it cannot be rewritten."""
    site = match_site(node)
    if site is None:
        return None
    src = latent_source(site)
    site.sparse = _sparse_indexer(graph, site, src)
    if site.sparse is not None:
        try:
            rewrite_site(graph, site, src, fake_mode, memo)
        except NoMatch as e:  # rolled back: fall back to HF's top-k mask as a token table
            log.info("mla_attention: DSA indexer at %s kept: %s", node.name, e)
            site.sparse = None
            if site.rows is not None:
                site.rows = NoMatch(f"{site.tokens}-token DSA step: {e}")
    if site.sparse is None and site.rows is not None:
        raise site.rows
    if site.sparse is None:
        rewrite_site(graph, site, src, fake_mode, memo)
    return site, src


def _specialize(node: fx.Node) -> bool:
    """The symbolic sizes (other than the batch) behind an attention site, or behind a DSA index mask, made this
    call's where the site is a decode step (`_fx.specialize_site`); counted and logged. Whether any was."""
    specialized = _fx.specialize_site(node, attention_rows.MAX_QUERY_TOKENS)
    if specialized:
        torch._dynamo.utils.counters["mla_compile"][SPECIALIZED_COUNTER] += 1
        log.info("mla_attention: %s at %s: sizes %s specialized to this call's",
                 "attention" if is_attention(node) else "DSA index mask", node.name, ", ".join(specialized))
    return bool(specialized)


def rewrite_mla_attention(gm: fx.GraphModule | fx.Graph, example_inputs=None) -> int:
    """Rewrite every matched decode site of `gm` (a Dynamo graph, or its fx.Graph) in place; returns the
    number rewritten. `example_inputs` is accepted for the backend-hook signature (metadata comes from the
    nodes' `example_value`)."""
    graph = graph_of(gm)
    # DSA dense graph: HF's index mask is "all selected" -> A alone
    dropped = dsa_indexer.drop_dense_indexer(graph, specialize=_specialize)
    candidates = [n for n in graph.nodes if is_attention(n)]
    fake_mode = None
    memo = Memo()
    rewritten = sparse = dense = 0
    counters = torch._dynamo.utils.counters["mla_compile"]
    for node in candidates:
        if getattr(node, "_erased", False):  # removed by an earlier rewrite
            continue
        if fake_mode is None:
            fake_mode = fake_mode_of(graph)
        try:
            try:
                found = _rewrite_one(graph, node, fake_mode, memo)
            except DynamicShape:
                # a size other than the batch is symbolic (Dynamo's automatic dynamic shapes after a size changed
                # between calls): specialized to this call's where the site is a decode step (a guard, so other
                # sizes compile their own graph, as under dynamic=False), then tried again
                if not _specialize(node):
                    raise
                found = _rewrite_one(graph, node, fake_mode, memo)
            if found is None:
                continue
            site, src = found
        except NoMatch as e:
            try:  # the decode ops cannot take it: HF's attention in absorbed form, with HF's mask
                site = rewrite_dense(graph, node, fake_mode, e)
            except NoMatch as e2:
                counters[SKIP_COUNTER] += 1
                _log_skip(node, e2)
                continue
            except Exception as e2:  # noqa: BLE001 - as below
                counters[SKIP_COUNTER] += 1
                _log_internal_error(node, e2, f"{e}; the absorbed form with HF's mask: ")
                continue
            dense += 1
            _log_dense(node, site, e)
            continue
        except Exception as e:  # noqa: BLE001 - a bug in the pass must not break the user's model
            counters[SKIP_COUNTER] += 1
            _log_internal_error(node, e)
            continue
        rewritten += 1
        if site.sparse is not None:
            sparse += 1
        if site.tokens > 1:
            counters[TOKENS_COUNTER] += 1
        log.info("mla_attention: rewrote %s attention at %s (H=%d, S=%d, R=%d, rope=%d, %s latent) -> %s",
                 site.impl, node.name, site.heads, site.tokens, _shape(site.latent)[-1], site.rope, src.kind,
                 _emitted(site, src))
    if rewritten or dense or dropped:
        finish_edits(graph)
        if rewritten:
            counters[COUNTER] += rewritten
        if dense:
            counters[DENSE_COUNTER] += dense
        if sparse:
            counters[SPARSE_COUNTER] += sparse
    return rewritten + dense
