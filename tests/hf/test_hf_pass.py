"""The `mla_dcp` backend on unmodified HF MLA models: decode attention rewritten into absorbed MLA.

Every test compares torch.compile(model, backend="mla_dcp") with eager HF (same weights, same static cache
kind): greedy tokens equal, logits within 1e-4 relative (fp32), and the rewrite counter equals the number of
attention layers. Tiny configs with the real MLA head dims (kv_lora 512, rope 64, nope 128, v 128); batch 2
with row 1 left-padded (so the mask path is exercised); one decode graph compiled per test.
"""

from __future__ import annotations

import logging

import pytest
import torch

import hf_models as M
import mla_compile  # noqa: F401
from mla_compile.passes import mla_attention

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

STEPS = 16
TOL = 1e-4
COUNTERS = torch._dynamo.utils.counters


# its module fixture runs once: every test here on one xdist worker (README's test command: --dist loadgroup)
pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.xdist_group("test_hf_pass")]


MODELS = {
    # (builder kwargs, layers): every V3 variant axis is covered (q_lora on/off, rope_interleave on/off)
    "v3-qlora-interleave": (M.deepseek_v3, dict(q_lora_rank=96, rope_interleave=True), 2),
    "v3-noqlora-nointerleave": (M.deepseek_v3, dict(q_lora_rank=None, rope_interleave=False), 1),
    "v32-topk8": (M.deepseek_v32, dict(index_topk=8), 1),  # DSA top-k smaller than the context: sparse mask
    "glm-moe-dsa": (M.glm_moe_dsa, dict(), 1),
}


def one_token_rewrites() -> int:
    """Rewritten one-token (decode) sites; a short prefill (2-8 tokens over the cache, e.g. q_len 5 here) is a
    multi-token step the pass may rewrite as well, counted apart (mla_attention.TOKENS_COUNTER)."""
    c = COUNTERS["mla_compile"]
    return c[mla_attention.COUNTER] - c[mla_attention.TOKENS_COUNTER]


def _check(model, layers, cache_fn, *, compiled_prefill=False, L=32, options=None, expect_rewrites=None):
    ids, mask = M.batch(L=L)
    ref_t, ref_l = M.greedy(model, model, ids, mask, cache_fn(), STEPS)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True, options=options)
    t, logits = M.greedy(compiled, model, ids, mask, cache_fn(), STEPS, prefill=compiled if compiled_prefill else model)
    assert torch.equal(t, ref_t), f"tokens differ:\n{t}\n{ref_t}"
    assert M.rel_err(logits, ref_l) < TOL
    expect = layers if expect_rewrites is None else expect_rewrites
    assert one_token_rewrites() == expect
    return t


def _caches_latent(model) -> bool:
    """transformers 5.17's V3.2 / GLM-DSA attention caches the EXPANDED K/V (`update` after `expand_kv`):
    there is no latent cache to attend over, so the pass must leave it alone (and say so)."""
    import inspect

    import re

    src = inspect.getsource(type(model.model.layers[0].self_attn).forward)
    update = re.search(r"\b(past_key_values|cache)\.update\(", src)  # 5.24 renamed past_key_values -> cache
    return update is not None and update.start() < src.index("self.expand_kv(")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_static_cache_decode_matches_eager(name, impl):
    build, kwargs, layers = MODELS[name]
    model = build(attn_impl=impl, num_layers=layers, **kwargs)
    L = 32
    compiled_prefill = name == "v3-qlora-interleave"  # prefill (q_len 5) compiled too: a 5-token step
    _check(model, layers, lambda: StaticCache(config=model.config, max_cache_len=L), L=L,
           compiled_prefill=compiled_prefill, expect_rewrites=layers if _caches_latent(model) else 0)
    if compiled_prefill and _caches_latent(model):  # the prefill sites: each query token a causal prefix
        assert COUNTERS["mla_compile"][mla_attention.TOKENS_COUNTER] == layers


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_bf16_decode_within_tolerance(impl):
    """bf16: teacher-forced on eager HF's greedy tokens, every step's logits within 2e-2 relative."""
    model = M.deepseek_v3(num_layers=2, attn_impl=impl, dtype=torch.bfloat16)
    L = 32
    ids, mask = M.batch(L=L)
    ref_t, ref_l = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), STEPS)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    logits = M.forced(compiled, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), ref_t)
    assert M.rel_err(logits, ref_l) < 2e-2
    assert (logits.argmax(-1) == ref_l.argmax(-1)).float().mean() >= 0.9
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2


def test_absorbed_projections_as_per_head_linear_match_eager():
    """The pass's `mla.per_head_linear` spelling of W_UK / W_UV computes what the bmm spelling does."""
    from mla_compile import tuning

    model = M.deepseek_v3(num_layers=2)
    with tuning.use(tuning.Tuning(absorb="per_head_linear")):
        _check(model, 2, lambda: StaticCache(config=model.config, max_cache_len=32), L=32)


def test_paged_cache_single_rank():
    from mla_compile.integrations.hf import MLAPagedCache

    model = M.deepseek_v3(num_layers=1)
    L = 40
    ids, mask = M.batch(L=L)
    # eager HF over the paged cache (gather path) is HF over a StaticCache, bit for bit
    ref = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), STEPS)
    paged = M.greedy(model, model, ids, mask, MLAPagedCache(model.config, L, page_size=8, shuffle_pages=True), STEPS)
    assert torch.equal(paged[0], ref[0]) and torch.equal(paged[1], ref[1])
    _check(model, 1, lambda: MLAPagedCache(model.config, L, page_size=8, shuffle_pages=True), L=L)


def test_paged_cache_with_fused_rows():
    """fused_rows=True: each layer's ckv / kpe are the two column ranges of one [NP, PS, R + P] buffer (FlashMLA's K
    layout, read in place): eager HF over it is HF over a StaticCache bit for bit, and the compiled decode matches."""
    from mla_compile.integrations.hf import MLAPagedCache
    from mla_compile.kernels import flashmla

    model = M.deepseek_v3(num_layers=1)
    L = 40
    ids, mask = M.batch(L=L)
    ref = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), STEPS)
    cache = MLAPagedCache(model.config, L, page_size=8, shuffle_pages=True, fused_rows=True)
    fused = M.greedy(model, model, ids, mask, cache, STEPS)
    assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])
    layer = cache.layers[0]
    assert layer.keys.shape[-1] == 512 and flashmla.shares_rows(layer.keys, layer.values)
    _check(model, 1, lambda: MLAPagedCache(model.config, L, page_size=8, shuffle_pages=True, fused_rows=True), L=L)
    with pytest.raises(ValueError, match="fused_rows"):
        MLAPagedCache(model.config, L, fused_rows=True, kv_cache_dtype="fp8_e4m3")


def _slice_split_expand_kv(self, kv_nope, k_rot):
    """A 'future transformers' expand_kv: slices instead of torch.split (same math, different graph)."""
    B, _, L, _ = kv_nope.shape
    kv = self.kv_b_proj(kv_nope).view(B, L, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
    k_nope, value = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim:]
    key = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    return key, value


def test_unmatched_attention_is_left_alone_and_logged(monkeypatch, caplog):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

    monkeypatch.setattr(mod.DeepseekV3Attention, "expand_kv", _slice_split_expand_kv)
    model = M.deepseek_v3(num_layers=1)
    L = 32
    with caplog.at_level(logging.INFO, logger="mla_compile.passes.mla_attention"):
        _check(model, 1, lambda: StaticCache(config=model.config, max_cache_len=L), L=L, expect_rewrites=0)
    assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] >= 1
    assert any("not rewritten" in r.getMessage() for r in caplog.records), caplog.text


def test_rewrite_attention_option_off():
    model = M.deepseek_v3(num_layers=1)
    L = 32
    _check(model, 1, lambda: StaticCache(config=model.config, max_cache_len=L), L=L,
           options={"rewrite_attention": False}, expect_rewrites=0)


def test_fx_graph_cache_hits_on_rewritten_graph(tmp_path, monkeypatch):
    """The rewrite runs before AOTAutograd; Inductor's FX graph cache must still store and hit."""
    from torch._inductor.utils import fresh_cache

    model = M.deepseek_v3(num_layers=1)
    L = 32
    ids, mask = M.batch(L=L)
    with fresh_cache(dir=str(tmp_path)), torch._inductor.config.patch(fx_graph_cache=True):
        for attempt in range(2):
            torch._dynamo.reset()
            cache = StaticCache(config=model.config, max_cache_len=L)
            compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
            M.greedy(compiled, model, ids, mask, cache, 2, prefill=model)
    assert COUNTERS["inductor"]["fxgraph_cache_hit"] >= 1, dict(COUNTERS["inductor"])
    assert COUNTERS["aot_autograd"]["autograd_cache_bypass"] == 0, dict(COUNTERS["aot_autograd"])
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2


# one spawn per group size, its cases run one after another in the same ranks (a spawn costs each rank the
# torch + transformers imports): (impl, empty_row)
DCP_CASES = {2: [("sdpa", False), ("eager", True)], 3: [("sdpa", False)]}


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory):
    import torch.multiprocessing as mp

    done = {}

    def run(world: int):
        if world not in done:
            d = tmp_path_factory.mktemp(f"dcp{world}")
            cases = [(impl, STEPS if not empty_row else 6, 32, empty_row) for impl, empty_row in DCP_CASES[world]]
            mp.spawn(M.dcp_worker, args=(world, str(d / "init"), str(d), cases), nprocs=world, join=True)
            done[world] = d
        return done[world]

    return run


@pytest.mark.parametrize("world,impl,empty_row", [(2, "sdpa", False), (3, "sdpa", False), (2, "eager", True)])
def test_dcp_gloo_matches_single_rank_eager(dcp_runs, world, impl, empty_row):
    """empty_row: a request masked everywhere; eager HF attends its whole (global) cache alike, which each rank
    reproduces over its own shard (the merge weighs the shards by their slot counts)."""
    case = DCP_CASES[world].index((impl, empty_row))
    d = dcp_runs(world)
    first = None
    for r in range(world):
        res = torch.load(d / f"rank{r}_case{case}.pt")
        # eager HF over the sharded cache (all-gathered shards) == single-rank HF
        assert torch.equal(res["e_t"], res["ref_t"]) and M.rel_err(res["e_l"], res["ref_l"]) < TOL
        # compiled: gather + attention -> mla.dcp_decode
        assert torch.equal(res["c_t"], res["ref_t"]), (res["c_t"], res["ref_t"])
        assert M.rel_err(res["c_l"], res["ref_l"]) < TOL
        assert res["counters"].get(mla_attention.COUNTER) == 1
        first = first if first is not None else res["c_l"]
        assert torch.equal(res["c_l"], first)  # identical on every rank


GENERATE = dict(max_new_tokens=STEPS, do_sample=False, cache_implementation="static", disable_compile=True)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_generate_with_static_cache(impl):
    """What an HF user already has: generate(cache_implementation="static") with a compiled forward. generate()
    builds the 4-D mask outside the forward for static caches: bool for sdpa (a proven mask), but HF's float
    eager mask would be a graph input of unknown values, so the eager model gets the mask built in the graph
    (`create_masks_for_generate` handing over the 2-D mask padded to the cache length)."""
    model = M.deepseek_v3(num_layers=1, attn_impl=impl)
    ids, mask = M.batch(L=5)
    ref = model.generate(ids, attention_mask=mask, **GENERATE)
    if impl == "eager":
        model.create_masks_for_generate = M.create_masks_in_graph
        assert torch.equal(model.generate(ids, attention_mask=mask, **GENERATE), ref)  # eagerly: HF's answer
    model.forward = torch.compile(model.forward, backend="mla_dcp", fullgraph=True)
    out = model.generate(ids, attention_mask=mask, **GENERATE)
    assert torch.equal(out, ref)
    assert one_token_rewrites() == 1  # the decode graph (the 5-token prefill is a multi-token step)
    assert COUNTERS["stats"]["unique_graphs"] == 2  # prefill + one decode graph for all steps


def test_hf_generate_eager_precomputed_mask_is_absorbed_and_warned(monkeypatch, caplog):
    """generate()'s precomputed eager mask arrives as a float graph input: not provable, so not for the decode ops;
    absorbed with that mask as it is (HF's answer), with a WARNING naming what would give the decode ops."""
    monkeypatch.setattr(mla_attention, "_warned", set())
    model = M.deepseek_v3(num_layers=1, attn_impl="eager")
    ids, mask = M.batch(L=5)
    ref = model.generate(ids, attention_mask=mask, **GENERATE)
    model.forward = torch.compile(model.forward, backend="mla_dcp", fullgraph=True)
    with caplog.at_level(logging.INFO, logger="mla_compile.passes.mla_attention"):
        out = model.generate(ids, attention_mask=mask, **GENERATE)
    assert torch.equal(out, ref)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 0
    assert COUNTERS["mla_compile"][mla_attention.DENSE_COUNTER] >= 1
    assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] == 0
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "create_masks_for_generate" in warned[0].getMessage(), caplog.text


def test_batch_size_change_keeps_the_rewrite():
    """Compiled once with Dynamo's default (automatic dynamic shapes): batch 2, then 3 (a graph with a symbolic
    batch), then 2 again (served by the symbolic graph): every decode graph rewritten, tokens equal eager HF."""
    model = M.deepseek_v3(num_layers=1, attn_impl="eager")
    L = 24
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    for B in (2, 3, 2):
        ids, mask = M.batch(B=B, L=L)
        ref = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 4)
        out = M.greedy(compiled, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 4,
                       prefill=model)
        assert torch.equal(out[0], ref[0]), B
        assert M.rel_err(out[1], ref[1]) < TOL
    assert COUNTERS["stats"]["unique_graphs"] == 2  # batch 2, then the symbolic batch
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2
    assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] == 0


@pytest.mark.parametrize("impl,cache", [("eager", "static"), ("sdpa", "paged")])
def test_dsa_sparse_batch_size_change_keeps_the_rewrite(impl, cache):
    """V3.2 past index_topk (the sparse graph), batch 2 / 3 / 2: the symbolic-batch graph keeps dsa.indexer_topk +
    mla.sparse_decode."""
    from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache

    model = M.deepseek_v32(num_layers=1, index_topk=4, attn_impl=impl)
    L = 16
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    for B in (2, 3, 2):
        ids, mask = M.batch(B=B, L=L)
        ref = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 4)
        c = DSAStaticCache(model.config, L) if cache == "static" else MLAPagedCache(model.config, L, page_size=4)
        out = M.greedy(compiled, model, ids, mask, c, 4, prefill=model)
        assert torch.equal(out[0], ref[0]) and M.rel_err(out[1], ref[1]) < TOL, B
    assert COUNTERS["mla_compile"]["dsa_sparse_rewritten"] == 2
    assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] == 0


def test_hf_generate_batch_size_change_keeps_the_rewrite():
    model = M.deepseek_v3(num_layers=1, attn_impl="eager")
    batches = {B: M.batch(B=B, L=5) for B in (2, 3)}
    refs = {B: model.generate(ids, attention_mask=mask, **GENERATE) for B, (ids, mask) in batches.items()}
    model.create_masks_for_generate = M.create_masks_in_graph
    model.forward = torch.compile(model.forward, backend="mla_dcp", fullgraph=True)
    for B in (2, 3, 2):
        ids, mask = batches[B]
        assert torch.equal(model.generate(ids, attention_mask=mask, **GENERATE), refs[B]), B
    assert one_token_rewrites() == 2  # the static and the symbolic-batch decode graph


def test_cache_length_change_is_specialized_and_rewritten(monkeypatch, caplog):
    """A cache length that changes between calls makes Dynamo's second graph symbolic in L (automatic dynamic
    shapes). The pass specializes L to the call's length (a guard: the third length compiles its own graph, as
    under dynamic=False) and rewrites it: every length rewritten, tokens equal eager HF's, no warning."""
    monkeypatch.setattr(mla_attention, "_warned", set())
    model = M.deepseek_v3(num_layers=1)
    for dynamic, specialized in ((None, 2), (False, 0)):
        torch._dynamo.reset()
        COUNTERS.clear()
        compiled = torch.compile(model, backend="mla_dcp", fullgraph=True, dynamic=dynamic)
        with caplog.at_level(logging.INFO, logger="mla_compile.passes.mla_attention"):
            for L in (24, 32, 40, 32):
                ids, mask = M.batch(L=L)
                ref = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 2)
                out = M.greedy(compiled, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 2,
                               prefill=model)
                assert torch.equal(out[0], ref[0]) and M.rel_err(out[1], ref[1]) < TOL, (dynamic, L)
        assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 3, dynamic  # L 32 again: its graph replays
        assert COUNTERS["mla_compile"][mla_attention.SPECIALIZED_COUNTER] == specialized, dynamic
        assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] == 0, dynamic
        assert COUNTERS["stats"]["unique_graphs"] == 3, dynamic
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == []


@pytest.mark.parametrize("kind", ["paged", "dsa_static", "dsa_sparse"])
def test_our_caches_of_another_length_are_rewritten(kind):
    """Our caches under Dynamo's default: a new cache of another length (the block table's width, or
    DSAStaticCache's length) makes the second graph symbolic there; each length is specialized and rewritten, the
    tokens equal eager HF's over HF's static cache. DSA with every length <= index_topk: each graph is the dense one
    (the index mask's top-k size, min(index_topk, L), is read once L is specialized), no sparse rewrite; with
    index_topk 4 (under the prompt's length) each graph is the sparse one."""
    from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache

    model = M.deepseek_v3(num_layers=1) if kind == "paged" else \
        M.deepseek_v32(num_layers=1, index_topk=64 if kind == "dsa_static" else 4)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    for L in (24, 32, 40):
        ids, mask = M.batch(L=L)
        ref = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 2)
        cache = MLAPagedCache(model.config, L, page_size=4) if kind == "paged" else DSAStaticCache(model.config, L)
        out = M.greedy(compiled, model, ids, mask, cache, 2, prefill=model)
        assert torch.equal(out[0], ref[0]) and M.rel_err(out[1], ref[1]) < TOL, L
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 3
    assert COUNTERS["mla_compile"][mla_attention.SPECIALIZED_COUNTER] == 2
    assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] == 0
    if kind != "paged":
        dense = kind == "dsa_static"
        assert COUNTERS["mla_compile"]["dsa_index_mask_dropped"] == (3 if dense else 0)
        assert COUNTERS["mla_compile"][mla_attention.SPARSE_COUNTER] == (0 if dense else 3)


def test_prefills_of_other_lengths_stay_symbolic(caplog):
    """A compiled model that also prefills: a second prompt length makes the prefill graph symbolic in S, more
    query tokens than a decode step takes: not specialized (one graph serves every prompt length), HF attention,
    logged at INFO only."""
    model = M.deepseek_v3(num_layers=1)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    with caplog.at_level(logging.INFO, logger="mla_compile.passes.mla_attention"), torch.no_grad():
        for T in (12, 14, 16):
            ids = torch.randint(1, 128, (2, T), generator=torch.Generator().manual_seed(T))
            want = model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=24)).logits
            got = compiled(ids, past_key_values=StaticCache(config=model.config, max_cache_len=24)).logits
            assert M.rel_err(got, want) < TOL, T
    assert COUNTERS["stats"]["unique_graphs"] == 2  # T 12, then the symbolic prompt length
    assert COUNTERS["mla_compile"][mla_attention.SPECIALIZED_COUNTER] == 0
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_growing_dynamic_cache_is_not_specialized_per_step(monkeypatch, caplog):
    """HF's DynamicCache concatenates: the key length is the past length + the new token, a new size every step.
    Specializing it would compile a graph per step, so that site stays symbolic (HF attention; one WARNING naming a
    static cache): three graphs in all (prefill, the first decode step, the symbolic rest), tokens equal eager
    generate()'s."""
    monkeypatch.setattr(mla_attention, "_warned", set())
    model = M.deepseek_v3(num_layers=1)
    ids, mask = M.batch(L=5)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="dynamic")
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    model.forward = torch.compile(model.forward, backend="mla_dcp")
    with caplog.at_level(logging.INFO, logger="mla_compile.passes.mla_attention"):
        out = model.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
    assert torch.equal(out, ref)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "static cache" in warned[0], warned
    assert COUNTERS["stats"]["unique_graphs"] == 3
    assert COUNTERS["mla_compile"][mla_attention.SPECIALIZED_COUNTER] == 0
    assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] == 1  # the symbolic past length's graph


# ------------------------------------------------------------------- synthetic sites (no HF model: fast)
_mla_attention, _synthetic_inputs = M.mla_attention_site, M.synthetic_site_inputs


@pytest.mark.parametrize("impl,cat,mask_kind", [("sdpa", True, "bool"), ("sdpa", False, "none"),
                                                ("eager", True, "additive-min"), ("eager", False, "bool-fill")])
def test_synthetic_site_variants(impl, cat, mask_kind):
    q, latent, kpe, w, valid = _synthetic_inputs()

    def fn(q, latent, kpe, w, valid):
        if mask_kind == "bool":
            mask = valid
        elif mask_kind == "none":
            mask = None
        elif mask_kind == "additive-min":
            mask = torch.where(valid, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        else:  # DSA style: additive, then masked_fill of an extra boolean "not selected" mask
            mask = torch.where(valid, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
            mask = mask.masked_fill(torch.arange(valid.shape[-1]) % 5 == 3, torch.finfo(q.dtype).min)
        return _mla_attention(q, latent, kpe, w, mask, impl=impl, cat=cat)

    ref = fn(q, latent, kpe, w, valid)
    out = torch.compile(fn, backend="mla_dcp", fullgraph=True)(q, latent, kpe, w, valid)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 1
    assert M.rel_err(out, ref) < TOL


def test_synthetic_long_mask_chunked_scan():
    """Rows longer than the pass's scan chunk (1024): the token table is built from chunked prefix sums.
    L = 2500 (not a multiple of the chunk), random holes, a fully masked chunk, a row valid only at its end."""
    q, latent, kpe, w, valid = _synthetic_inputs(B=3, H=2, L=2500)
    valid[0, ..., 1024:2048] = False
    valid[2] = False
    valid[2, ..., -3:] = True

    def fn(q, latent, kpe, w, valid):
        return _mla_attention(q, latent, kpe, w, valid, impl="sdpa", cat=True)

    out = torch.compile(fn, backend="mla_dcp", fullgraph=True)(q, latent, kpe, w, valid)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 1
    assert M.rel_err(out, fn(q, latent, kpe, w, valid)) < TOL


def test_synthetic_unknown_additive_mask_keeps_its_values(caplog):
    q, latent, kpe, w, valid = _synthetic_inputs()
    bias = torch.randn(valid.shape)  # an additive mask of arbitrary values: no boolean "valid" to recover

    def fn(q, latent, kpe, w, bias):
        return _mla_attention(q, latent, kpe, w, bias, impl="eager")

    with caplog.at_level(logging.INFO, logger="mla_compile.passes.mla_attention"):
        out = torch.compile(fn, backend="mla_dcp", fullgraph=True)(q, latent, kpe, w, bias)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 0  # no valid tokens for the decode ops
    assert COUNTERS["mla_compile"][mla_attention.DENSE_COUNTER] == 1  # absorbed with the bias as it is
    assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] == 0
    assert "not provably 0 / -inf" in caplog.text
    assert M.rel_err(out, fn(q, latent, kpe, w, bias)) < TOL
