"""DSA (V3.2 / GLM-DSA) steps with S = 2 .. 8 query tokens per request (speculative verification, MTP) through the
attention pass: one teacher-forced run of S-token steps crosses index_topk, so it runs the dense graph (every
kv_len <= topk: the indexer dropped, the multi-token `mla.decode`) and then the sparse one (each query token its
own top-k: `dsa.indexer_topk` over one row per query token + `mla.sparse_decode` with indices [B, S, K]).
Compared with eager HF over HF's own StaticCache in fp32: every step's argmax tokens equal, logits within 1e-4.
Also: GLM-DSA's shared indexer layer, FP8 latent caches, a symbolic batch, HF's prompt-lookup generate(), the
full Inductor backend, DCP over 2 gloo ranks (dsa.dcp_indexer_topk rows + mla.dcp_decode) and TP 2 x DCP 2 (slow),
and an index mask the pass cannot prove (left to HF, counted)."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_models as M
from mla_compile.passes import dsa_indexer, mla_attention
from mla_compile.passes._fx import meta_val

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache, cache_kwargs  # noqa: E402
from test_hf_dsa_graphs import dsa_model  # noqa: E402

COUNTERS = torch._dynamo.utils.counters
TOPK = 16
PROMPT = 5
TOL = 1e-4


def _rewrite_only(gm, example_inputs):
    """The attention rewrite, then the FX graph as it is (the ops' CPU impls; no Inductor: fast)."""
    mla_attention.rewrite_mla_attention(gm)
    return gm.forward


def _cache(kind: str, config, L: int):
    fp8 = dict(kv_cache_dtype="fp8_e4m3") if kind.endswith("fp8") else {}
    if kind.startswith("static"):
        return DSAStaticCache(config, max_cache_len=L, **fp8)
    return MLAPagedCache(config, L, page_size=4, shuffle_pages=True, **fp8)


def _run(kind: str, impl: str, S: int, steps: int, backend=_rewrite_only, model_kind: str = "v32", pad: int = 2,
         ref_kind: str | None = None, shard=None, **model_kw):
    """Prefill PROMPT tokens (eager), then `steps` teacher-forced steps of S tokens each, compiled over our cache
    and eager over HF's StaticCache (or over our cache of `ref_kind`). Returns (logits, ref_logits, kv lengths
    after each step). shard: makes the compiled model (TP: this rank's heads) from a copy of the reference."""
    torch._dynamo.reset()
    COUNTERS.clear()
    model = dsa_model(model_kind, attn_impl=impl, **model_kw)
    L = PROMPT + S * steps + 2
    ids, mask = M.batch(T=PROMPT + S * steps, L=L, pad=pad)
    ref_cache = (StaticCache(config=model.config, max_cache_len=L) if ref_kind is None
                 else _cache(ref_kind, model.config, L))
    ours = model if shard is None else shard(copy.deepcopy(model))
    cache = _cache(kind, ours.config, L)
    step = torch.compile(ours, backend=backend, fullgraph=True, dynamic=False)
    logits, ref_logits, kv = [], [], []
    with torch.no_grad():
        for m, c in ((model, ref_cache), (ours, cache)):
            m(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], **cache_kwargs(m, c))
        for i in range(steps):
            new = ids[:, PROMPT + S * i: PROMPT + S * (i + 1)]
            out = step(new, attention_mask=mask, **cache_kwargs(model, cache))
            ref = model(new, attention_mask=mask, **cache_kwargs(model, ref_cache))
            logits.append(out.logits.float())
            ref_logits.append(ref.logits.float())
            kv.append(PROMPT + S * (i + 1))
    torch._dynamo.reset()
    return torch.stack(logits, 1), torch.stack(ref_logits, 1), kv


def _assert_equal(logits, ref):
    assert torch.equal(logits.argmax(-1), ref.argmax(-1)), (logits.argmax(-1), ref.argmax(-1))
    assert M.rel_err(logits, ref) < TOL, M.rel_err(logits, ref)


@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_dense_steps_are_multi_token(kind, impl):
    """Every step's kv_len <= index_topk: the dense graph; the index mask is dropped and each step is rewritten as
    a multi-token mla.decode (one graph: every step has the same S and the same dense guard)."""
    logits, ref, kv = _run(kind, impl, S=3, steps=3)
    assert max(kv) <= TOPK
    _assert_equal(logits, ref)
    c = COUNTERS["mla_compile"]
    assert c[dsa_indexer.COUNTER] == 1 and c[mla_attention.TOKENS_COUNTER] == 1, dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 0 and c[mla_attention.SPARSE_COUNTER] == 0, dict(c)


def _recording():
    graphs = []

    def backend(gm, example_inputs):
        mla_attention.rewrite_mla_attention(gm)
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


# (cache, attention, left padding of request 1): padding 15 puts the first sparse step's first query token of
# request 1 on a padding position (a row with no valid token: SDPA gives 0, eager HF a flat softmax over the cache)
# and its other query tokens at 1 and 2 valid tokens: the op's 4-D `len - S + 1 + j` limits would be wrong there
CROSSING = [("static", "sdpa", 2), ("paged", "eager", 2), ("static", "eager", 15), ("paged", "sdpa", 15)]


@pytest.mark.parametrize("kind,impl,pad", CROSSING)
def test_steps_crossing_topk_match_eager(kind, impl, pad):
    """kv_len 8 .. 23 in steps of 3 crosses index_topk 16: the dense graph, then the sparse one, each rewritten once
    (the sparse graph: dsa.indexer_topk over one row per query token, mla.sparse_decode with indices [B, S, K],
    HF's scores / top-k / scatter gone)."""
    graphs, backend = _recording()
    logits, ref, kv = _run(kind, impl, S=3, steps=6, backend=backend, pad=pad)
    assert min(kv) <= TOPK < max(kv)
    _assert_equal(logits, ref)
    assert dict(COUNTERS["mla_compile"]) == {dsa_indexer.COUNTER: 1, mla_attention.COUNTER: 2,
                                             mla_attention.TOKENS_COUNTER: 2, mla_attention.SPARSE_COUNTER: 1}
    assert len(graphs) == 2
    sparse = graphs[1].graph
    ops = _targets(graphs[1])
    assert not any("topk" in str(t) and t is not torch.ops.dsa.indexer_topk.default for t in ops), ops
    assert "relu" not in str(ops)
    (idx,) = [n for n in sparse.nodes if n.target is torch.ops.mla.sparse_decode.default]
    assert tuple(meta_val(idx.args[4]).shape) == (2, 3, TOPK)  # [B, S, K]: each query token its own list
    (sel,) = [n for n in sparse.nodes if n.target is torch.ops.dsa.indexer_topk.default]
    assert tuple(meta_val(sel).shape) == (2 * 3, TOPK)  # one indexer row per query token


@pytest.mark.parametrize("S", [2, 8])
def test_two_and_eight_query_tokens(S):
    steps = 3 if S == 2 else 2  # kv 7 .. 11 (dense only) / 13, 21 (dense, sparse)
    logits, ref, kv = _run("static", "sdpa", S=S, steps=steps)
    _assert_equal(logits, ref)
    sparse = max(kv) > TOPK
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.TOKENS_COUNTER] == 1 + sparse and c[mla_attention.SPARSE_COUNTER] == sparse, dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)


def test_glm_shared_indexer_layer():
    """GLM-DSA: a "shared" layer reuses the previous layer's per-query-token selection (one indexer call)."""
    graphs, backend = _recording()
    logits, ref, kv = _run("paged", "sdpa", S=3, steps=6, backend=backend, model_kind="glm", num_layers=2,
                           indexer_types=["full", "shared"])
    _assert_equal(logits, ref)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.TOKENS_COUNTER] == 4 and c[mla_attention.SPARSE_COUNTER] == 2, dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)
    assert _targets(graphs[1]).count(torch.ops.dsa.indexer_topk.default) == 1


def test_unproven_indexer_stays_hf():
    """An S-token index mask whose top-k is not HF's indexer (here: largest=False) has no token-table fallback
    (its rows are no prefixes of the last row's): not for the decode ops; the indexer stays HF's and the attention
    is absorbed with its mask as it is."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _run("static", "sdpa", S=3, steps=6, backend=capture)
    gm = graphs[1]
    (topk,) = [n for n in gm.graph.nodes if "topk" in str(n.target)]
    topk.kwargs = {**topk.kwargs, "largest": False}
    COUNTERS.clear()
    assert mla_attention.rewrite_mla_attention(gm) == 1
    assert dict(COUNTERS["mla_compile"]) == {mla_attention.DENSE_COUNTER: 1}
    assert any(n.target is torch.ops.aten.topk.default or "topk" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.parametrize("kind,impl,pad", [("static", "sdpa", 2), ("paged", "eager", 15)])
def test_inductor_steps_match_eager(kind, impl, pad):
    """The full backend (Inductor over the rewritten graphs); eager with rows of no valid token: the flat-softmax
    decode beside the sparse one."""
    logits, ref, kv = _run(kind, impl, S=3, steps=6, backend="mla_dcp", pad=pad)
    _assert_equal(logits, ref)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.TOKENS_COUNTER] == 2 and c[mla_attention.SPARSE_COUNTER] == 1, dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)


def test_prompt_lookup_generate_crossing_topk():
    """HF's own verification loop: generate(prompt_lookup_num_tokens=2) over a DSAStaticCache, the mask built in the
    graph, 20 new tokens from a 12-token prompt (kv_len 13 .. 32 crosses index_topk 16; HF crops rejected drafts):
    tokens equal eager generate's over HF's StaticCache, every step graph rewritten (dense and sparse, S = 1 and
    S > 1: each distinct S and dense / sparse choice is a graph of its own)."""
    from mla_compile.integrations.hf import compile_config, create_masks_in_graph

    torch._dynamo.reset()
    model = dsa_model("v32")
    model.create_masks_for_generate = create_masks_in_graph
    base = torch.randint(1, 120, (1, 4), generator=torch.Generator().manual_seed(5))
    ids = base.repeat(1, 3)  # repeated n-grams: prompt lookup finds drafts
    L = ids.shape[1] + 24  # HF's last draft may reach past max_length: room
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20, do_sample=False,
              pad_token_id=0, prompt_lookup_num_tokens=2)
    cfg = compile_config(mode="default")
    cfg.backend = _rewrite_only
    with torch.no_grad():
        ref = model.generate(ids, **kw, **cache_kwargs(model, StaticCache(config=model.config, max_cache_len=L)),
                             disable_compile=True)
        COUNTERS.clear()
        out = model.generate(ids, **kw, **cache_kwargs(model, DSAStaticCache(model.config, max_cache_len=L)),
                             compile_config=cfg)
    torch._dynamo.reset()
    assert torch.equal(out, ref), (out, ref)
    assert dict(COUNTERS["mla_compile"]) == {dsa_indexer.COUNTER: 1, mla_attention.COUNTER: 4,
                                             mla_attention.TOKENS_COUNTER: 2, mla_attention.SPARSE_COUNTER: 3}


# ------------------------------------------------------------------------------------------------ DCP
DCP_CASES = [("sdpa", 2), ("eager", 15)]  # eager, padding 15: rows with no valid token get HF's flat softmax


def dcp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    """One DCP rank (gloo, CPU): S = 3 teacher-forced steps crossing index_topk over the DCP-sharded paged cache
    (the pass, then the FX graph) vs single-rank eager HF over HF's StaticCache."""
    import types

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dcp = types.SimpleNamespace(size=world, rank=rank, group_name=dist.group.WORLD.group_name)
        global _cache
        _cache = lambda kind, config, L: MLAPagedCache(config, L, page_size=4, dcp=dcp)  # noqa: E731
        for i, (impl, pad) in enumerate(DCP_CASES):
            logits, ref, kv = _run("paged", impl, S=3, steps=6, pad=pad)
            torch.save(dict(logits=logits, ref=ref, kv=kv, counters=dict(COUNTERS["mla_compile"])),
                       f"{result_dir}/rank{rank}_case{i}.pt")
    finally:
        dist.destroy_process_group()


def test_dcp_steps_match_single_rank_eager(tmp_path):
    """DCP (2 gloo ranks): the dense graph's S-token step is rewritten (the indexer dropped, mla.dcp_decode with
    per-query-token limits), the sparse graph's into dsa.dcp_indexer_topk over one row per query token +
    mla.dcp_decode over each rank's selected slots; tokens equal single-rank eager HF throughout."""
    import torch.multiprocessing as mp

    mp.spawn(dcp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        for i in range(len(DCP_CASES)):
            res = torch.load(tmp_path / f"rank{r}_case{i}.pt")
            assert min(res["kv"]) <= TOPK < max(res["kv"])
            _assert_equal(res["logits"], res["ref"])
            want = {dsa_indexer.COUNTER: 1, mla_attention.COUNTER: 2, mla_attention.TOKENS_COUNTER: 2,
                    mla_attention.SPARSE_COUNTER: 1}
            assert res["counters"] == want, res["counters"]


@pytest.mark.parametrize("kind", ["static-fp8", "paged-fp8"])
def test_fp8_cache_steps_match_eager_over_it(kind):
    """An FP8 latent cache (HF reads the dequantized latent, so eager over the same cache is the reference): the
    sparse S-token step reads the FP8 pages with their scales (mla.sparse_decode's ckv_scale)."""
    logits, ref, kv = _run(kind, "sdpa", S=3, steps=6, ref_kind=kind)
    _assert_equal(logits, ref)
    assert dict(COUNTERS["mla_compile"]) == {dsa_indexer.COUNTER: 1, mla_attention.COUNTER: 2,
                                             mla_attention.TOKENS_COUNTER: 2, mla_attention.SPARSE_COUNTER: 1}


def test_batch_change_symbolic_batch():
    """A second run with another batch size recompiles with a symbolic batch (Dynamo's automatic dynamic shapes):
    the S-token dense and sparse rewrites take B from q.size(0)."""
    torch._dynamo.reset()
    COUNTERS.clear()
    model = dsa_model("v32")
    step = torch.compile(model, backend=_rewrite_only, fullgraph=True)  # dynamic=None: automatic dynamic
    S, steps = 3, 6
    L = PROMPT + S * steps + 2
    for B in (2, 3):
        ids, mask = M.batch(B=B, T=PROMPT + S * steps, L=L)
        ref_cache, cache = StaticCache(config=model.config, max_cache_len=L), _cache("paged", model.config, L)
        with torch.no_grad():
            for c in (ref_cache, cache):
                model(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], **cache_kwargs(model, c))
            for i in range(steps):
                new = ids[:, PROMPT + S * i: PROMPT + S * (i + 1)]
                _assert_equal(step(new, attention_mask=mask, **cache_kwargs(model, cache)).logits,
                              model(new, attention_mask=mask, **cache_kwargs(model, ref_cache)).logits)
    torch._dynamo.reset()
    assert dict(COUNTERS["mla_compile"]) == {dsa_indexer.COUNTER: 2, mla_attention.COUNTER: 4,
                                             mla_attention.TOKENS_COUNTER: 4, mla_attention.SPARSE_COUNTER: 2}


def tp_dcp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    """One rank of TP 2 x DCP 2 (gloo, CPU): the compiled model holds this rank's heads (`shard_mla_heads`)."""
    import torch.distributed as dist

    from mla_compile.distributed import init_dcp
    from mla_compile.integrations.tp import shard_mla_heads

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        grp = init_dcp(tp_size=2, dcp_size=2)
        global _cache
        _cache = lambda kind, config, L: MLAPagedCache(config, L, page_size=4, dcp=grp)  # noqa: E731
        logits, ref, kv = _run("paged", "sdpa", S=3, steps=6, shard=lambda m: shard_mla_heads(m, grp))
        torch.save(dict(logits=logits, ref=ref, kv=kv, counters=dict(COUNTERS["mla_compile"])),
                   f"{result_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 4 gloo ranks, ~30 s on 2 cores; the 2-rank DCP test covers the sparse DCP rows fast
def test_tp_dcp_steps_match_single_rank_eager(tmp_path):
    """TP 2 x DCP 2 (4 gloo ranks): the sparse graph's S-token step -> dsa.dcp_indexer_topk over one row per query
    token + mla.tp_dcp_decode; the dense graph's -> mla.tp_dcp_decode with per-query-token limits; tokens equal
    single-rank eager HF throughout."""
    import torch.multiprocessing as mp

    mp.spawn(tp_dcp_worker, args=(4, str(tmp_path / "init"), str(tmp_path)), nprocs=4, join=True)
    for r in range(4):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert min(res["kv"]) <= TOPK < max(res["kv"])
        _assert_equal(res["logits"], res["ref"])
        assert res["counters"] == {dsa_indexer.COUNTER: 1, mla_attention.COUNTER: 2, mla_attention.TOKENS_COUNTER: 2,
                                   mla_attention.SPARSE_COUNTER: 1}, res["counters"]
