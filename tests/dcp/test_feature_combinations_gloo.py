"""Features built on separate branches, composed across gloo ranks (single-process combinations:
tests/hf/test_feature_combinations.py).

- FP8 latent cache x DSA under DCP: V3.2 over `MLAPagedCache(dcp=..., kv_cache_dtype="fp8_e4m3")` crossing
  index_topk (dense graph, then the sparse one: `dsa.dcp_indexer_topk` + the attention over each rank's selected
  FP8 slots, passes/dsa_dcp.py handing over the scales).
- FP8 latent cache x TP x DCP: the FP8 gather carries `heads_sharded`, so the pass emits `mla.tp_dcp_decode` (with
  the scales) in both DSA graphs.
- FP8 latent cache x multi-token verification steps x DCP (`mla.dcp_decode` with per-query-token limits and the
  scales), and the same with the heads split (TP x DCP).

The reference is single-process eager HF over an (unsharded) FP8 paged cache: quantization is per token, so
sharding does not change what the tokens hold; fp32 models, so tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch

import test_dcp_gloo as base

# its module fixture (a process group pool) runs once: every test here on one xdist worker
# (README's test command: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_feature_combinations_gloo")

pytest.importorskip("transformers")

FP8 = "fp8_e4m3"
TOPK, PROMPT, STEPS = 8, 5, 9  # kv lengths 6 .. 14: the dense DSA graph first, then the sparse one


@pytest.fixture(scope="module")
def groups():
    yield from base.group_pool(__name__)




def _recording(graphs):
    from mla_compile.backend import mla_dcp

    def backend(gm, example_inputs):
        compiled = mla_dcp(gm, example_inputs)  # rewrites gm's graph in place first
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return compiled

    return backend


def cmd_fp8_dsa_decode(ctx, tp: int, compiled_prefill: bool = False, kv_cache_dtype: str = FP8, impl: str = "sdpa"):
    """Greedy decode of V3.2 crossing index_topk: single-process eager over a whole FP8 cache (the reference), HF's
    StaticCache (unquantized: the FP8 cache must matter), and the model compiled with mla_dcp over this rank's FP8
    shard (tp > 0: heads split, TP tp x DCP n / tp). compiled_prefill: the 5-token prefill compiled too (a
    multi-token step in the dense graph: per-query-token limits over the shards). kv_cache_dtype "auto": the same
    with the model's dtype (the reference too). impl "eager": HF eager attention (a prefill query token at a padding
    position sees nothing: HF's flat softmax over the whole cache, the pass's flat rows over the shards)."""
    import copy

    import hf_models as M
    from mla_compile.integrations.hf import MLAPagedCache
    from mla_compile.integrations.tp import shard_mla_heads
    from transformers import StaticCache

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    grp = base.worker_group(ctx, tp)
    model = M.deepseek_v32(num_layers=1, heads=8, index_topk=TOPK, attn_impl=impl)
    L = PROMPT + STEPS + 3
    ids, mask = M.batch(T=PROMPT, L=L)
    ref_t, ref_l = M.greedy(model, model, ids, mask,
                            MLAPagedCache(model.config, L, page_size=4, kv_cache_dtype=kv_cache_dtype), STEPS)
    _, plain_l = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), STEPS)
    if tp:
        model = shard_mla_heads(copy.deepcopy(model), grp)
    graphs = []
    compiled = torch.compile(model, backend=_recording(graphs), fullgraph=True)
    c_t, c_l = M.greedy(compiled, model, ids, mask,
                        MLAPagedCache(model.config, L, page_size=4, dcp=grp, kv_cache_dtype=kv_cache_dtype), STEPS,
                        prefill=compiled if compiled_prefill else model)
    return dict(ref_t=ref_t, c_t=c_t, err=M.rel_err(c_l, ref_l), fp8_err=M.rel_err(ref_l, plain_l), graphs=graphs,
                counters=dict(torch._dynamo.utils.counters["mla_compile"]))


def cmd_fp8_verify(ctx, tp: int, impl: str = "sdpa", S: int = 3, steps: int = 3):
    """Teacher-forced S-token verification steps (the mask built in the graph from the 2-D mask) of V3 over this
    rank's FP8 shard, compiled with mla_dcp, vs single-process eager over a whole FP8 cache. impl "eager": request
    1's first query token sees nothing (HF's flat softmax over the whole cache: the pass's flat rows)."""
    import copy

    import hf_models as M
    from mla_compile.integrations.hf import MLAPagedCache, cache_kwargs
    from mla_compile.integrations.tp import shard_mla_heads

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    grp = base.worker_group(ctx, tp)
    model = M.deepseek_v3(num_layers=1, heads=8, attn_impl=impl)
    T = PROMPT
    L = T + S * steps + 2
    ids, mask = M.batch(B=2, T=T, L=L)
    if impl == "eager":
        mask[1, :T + 1] = 0
    g = torch.Generator().manual_seed(11)
    drafts = [torch.randint(1, 128, (2, S), generator=g) for _ in range(steps)]

    def run(step, prefill, cache):
        out = []
        with torch.no_grad():
            prefill(ids, attention_mask=mask[:, :T], **cache_kwargs(prefill, cache))
            for d in drafts:
                out.append(step(d, attention_mask=mask, **cache_kwargs(step, cache)).logits.float().clone())
        return torch.stack(out)

    ref = run(model, model, MLAPagedCache(model.config, L, page_size=4, kv_cache_dtype=FP8))
    if tp:
        model = shard_mla_heads(copy.deepcopy(model), grp)
    graphs = []
    compiled = torch.compile(model, backend=_recording(graphs), fullgraph=True, dynamic=False)
    got = run(compiled, model, MLAPagedCache(model.config, L, page_size=4, dcp=grp, kv_cache_dtype=FP8))
    return dict(ref=ref, got=got, graphs=graphs, counters=dict(torch._dynamo.utils.counters["mla_compile"]))


def cmd_tp_limits(ctx, seed: int, kv_cache_dtype: str):
    """`mla.tp_dcp_decode` with GLOBAL per-query-token limits [B, S] (rows not one token apart, empty rows, a
    request of length 0) == single-process `mla.decode` with the same limits over the whole cache, on this rank's
    heads; and bit-identical to `mla.dcp_decode`'s merge of the same partials. bf16-free: fp32 q, an fp32 or FP8
    latent."""
    import math

    from mla_compile import paged

    n, rank = ctx.n, ctx.rank
    R, P, PS, HL, S, B = 128, 8, 4, 2, 3, 5
    g = torch.Generator().manual_seed(seed)
    lens = [0, 3, 9, 14, 22]
    ckv = [torch.randn(L, R, generator=g) for L in lens]
    kpe = [torch.randn(L, P, generator=g) for L in lens]
    q = torch.randn(B, S, n * HL, R, generator=g)
    qp = torch.randn(B, S, n * HL, P, generator=g)
    kw = dict(kv_cache_dtype=kv_cache_dtype)
    full = paged.fill_paged(ckv, kpe, PS, generator=torch.Generator().manual_seed(seed + 1), **kw)
    sh = paged.fill_sharded(ckv, kpe, PS, n, rank, generator=torch.Generator().manual_seed(seed + 2 + rank), **kw)
    seq = torch.tensor(lens, dtype=torch.int32)
    # limits [B, S], non-decreasing in j: a gap of 4 between query tokens 1 and 2, and 0 where that runs below
    lim = (seq[:, None] - torch.tensor([5, 4, 0], dtype=torch.int32)).clamp_min(0)
    scale = 1.0 / math.sqrt(R + P)
    mine = slice(rank * HL, (rank + 1) * HL)
    qn, qpn = q[:, :, mine].contiguous(), qp[:, :, mine].contiguous()
    out, lse = torch.ops.mla.tp_dcp_decode(qn, qpn, sh.ckv_cache, sh.kpe_cache, sh.block_table, lim, scale, n, rank,
                                           ctx.group_name, True, sh.ckv_scale)
    assert out.shape == (B, S, HL, R) and lse.shape == (B, S, HL)
    ref_o, ref_l = torch.ops.mla.decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, lim, scale,
                                        full.ckv_scale)
    base._close(out, ref_o[:, :, mine], torch.float32, "out vs decode")
    base._close_lse(lse, ref_l[:, :, mine], "lse vs decode")
    empty = lim == 0
    assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all()), "limit 0 -> (0, -inf)"
    d_o, d_l = torch.ops.mla.dcp_decode(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, lim, scale, n, rank,
                                        ctx.group_name, True, sh.ckv_scale)
    assert torch.equal(out, d_o[:, :, mine]) and torch.equal(lse, d_l[:, :, mine]), "differs from dcp_decode's merge"
    # limits that differ across ranks (with check_lens) are caught, not merged: NaN rows or a ValueError everywhere
    bad = lim.clone()
    bad[3, 1] -= rank
    try:
        o_b, _ = torch.ops.mla.tp_dcp_decode(qn, qpn, sh.ckv_cache, sh.kpe_cache, sh.block_table, bad, scale, n,
                                             rank, ctx.group_name, True, sh.ckv_scale)
        caught = bool(torch.isnan(o_b[3]).all()) and not bool(torch.isnan(o_b[:3]).any())
    except ValueError as e:
        caught = "seq_lens" in str(e)
    return dict(caught=caught)


COMMANDS = {"fp8_dsa_decode": cmd_fp8_dsa_decode, "fp8_verify": cmd_fp8_verify, "tp_limits": cmd_tp_limits}


def _check_decode(res, tp: bool, compiled_prefill: bool = False, fp8: bool = True):
    op, other = ("mla.tp_dcp_decode.default", "mla.dcp_decode.default") if tp else \
        ("mla.dcp_decode.default", "mla.tp_dcp_decode.default")
    for r in res:
        assert torch.equal(r["c_t"], r["ref_t"]), (r["c_t"], r["ref_t"])
        assert r["err"] < 1e-4, r["err"]
        if fp8:
            assert r["fp8_err"] > 30 * 1e-4, r["fp8_err"]  # the reference did read FP8 values
        c = r["counters"]
        assert c.get("mla_attention_rewritten", 0) >= 2 and not c.get("mla_attention_not_rewritten"), c
        assert c.get("dsa_index_mask_dropped", 0) >= 1 and c.get("dsa_sparse_rewritten", 0) >= 1, c
        if compiled_prefill:  # the prefill graph: its 5-token site rewritten (dense: kv 5 <= index_topk)
            assert len(r["graphs"]) == 3 and c.get("mla_attention_multi_token_rewritten") == 1, (len(r["graphs"]), c)
            prefill = r["graphs"][0]
            assert op in prefill and "mla_hf.gather_latent.default" not in prefill, prefill
        graphs = r["graphs"][1:] if compiled_prefill else r["graphs"]
        assert len(graphs) == 2, len(graphs)  # the dense and the sparse decode graph
        dense, sparse = graphs
        for g in (dense, sparse):
            assert op in g and other not in g, g
            assert "mla_hf.gather_latent.default" not in g, g  # FP8 latent read in place, no gather left
        assert "dsa.dcp_indexer_topk.default" in sparse and "dsa.dcp_indexer_topk.default" not in dense
    assert all(torch.equal(r["c_t"], res[0]["c_t"]) for r in res)


@pytest.mark.parametrize("compiled_prefill", [False, True])
def test_fp8_dsa_under_dcp_2_ranks_matches_single_process_eager_fp8(groups, compiled_prefill):
    _check_decode(groups(2).run("fp8_dsa_decode", 0, compiled_prefill, timeout=600), False, compiled_prefill)


def test_compiled_prefill_under_dcp_2_ranks_model_dtype_cache(groups):
    """Short compiled prefill x DCP without FP8 (the model's dtype): its per-query-token counts over the shards used
    to be a sum over local_mask's padded copy of HF's padded prefill mask, which Inductor's CPU vectorizer turned
    into C++ that does not compile (passes/attention_tokens.py)."""
    _check_decode(groups(2).run("fp8_dsa_decode", 0, True, "auto", timeout=600), False, True, fp8=False)


@pytest.mark.parametrize("compiled_prefill", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fp8_tp2_x_dcp2_dsa_matches_single_process_eager_fp8(groups, compiled_prefill):
    _check_decode(groups(4).run("fp8_dsa_decode", 2, compiled_prefill, timeout=600), True, compiled_prefill)


def _check_verify(res, op: str):
    import hf_models as M

    for r in res:
        assert torch.equal(r["got"].argmax(-1), r["ref"].argmax(-1))
        assert M.rel_err(r["got"], r["ref"]) < 1e-5, M.rel_err(r["got"], r["ref"])
        c = r["counters"]
        assert c.get("mla_attention_multi_token_rewritten", 0) >= 1, c
        assert not c.get("mla_attention_not_rewritten"), c
        for g in r["graphs"]:
            assert op in g and "mla_hf.gather_latent.default" not in g, g


def test_fp8_verification_steps_under_dcp_2_ranks(groups):
    _check_verify(groups(2).run("fp8_verify", 0, timeout=600), "mla.dcp_decode.default")


def test_fp8_eager_verification_steps_heads_split_tp1_x_dcp2(groups):
    """TP 1 x DCP 2 (the heads split over a 2-rank DCP group: the cheap stand-in for TP x DCP), eager attention with
    a flat-softmax row: mla.tp_dcp_decode with [B, S] limits and, for that row, with zero queries over every slot."""
    _check_verify(groups(2).run("fp8_verify", 1, "eager", timeout=600), "mla.tp_dcp_decode.default")


def test_fp8_verification_steps_tp2_x_dcp2(groups):
    """S-token steps with the heads split: mla.tp_dcp_decode with per-query-token limits [B, S] and the scales."""
    _check_verify(groups(4).run("fp8_verify", 2, timeout=600), "mla.tp_dcp_decode.default")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", FP8])
def test_tp_dcp_decode_takes_per_query_token_limits(groups, kv_cache_dtype):
    res = groups(2).run("tp_limits", 3, kv_cache_dtype, timeout=300)
    assert all(r["caught"] for r in res), res


def test_fp8_eager_attention_compiled_prefill_under_dcp_2_ranks(groups):
    """Eager attention: the compiled prefill's padding rows (request 1's first query tokens) take the flat-softmax
    rows over every rank's FP8 slots (attention_tokens._flat_rows with the scales, mla.dcp_decode): compiled and
    run here; those rows' own logits are not compared (padding positions), their values are checked single-process
    in tests/hf/test_feature_combinations.py."""
    _check_decode(groups(2).run("fp8_dsa_decode", 0, True, FP8, "eager", timeout=600), False, True)
