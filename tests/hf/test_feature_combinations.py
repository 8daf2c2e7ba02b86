"""Features built on separate branches, composed (single process; the gloo combinations are
tests/dcp/test_feature_combinations_gloo.py):

- FP8 latent cache x multi-token verification steps: the S-token emission (passes/attention_tokens.py) hands the FP8
  latent's scales to mla.decode (also in the flat-softmax rows of eager attention). Compiled vs eager HF over the
  same FP8 cache: the same dequantized values, so fp32 logits agree to float32 rounding.
- the gather_latent schema `(..., str group_name, Tensor? ckv_scale=None, bool heads_sharded=False)`: both of our
  caches' calls (the FP8 one positional, the bf16 one by keyword) reach the pass's reading of the node
  (`attention_match._gather_source`) as what the cache holds.
"""

from __future__ import annotations

import pytest
import torch

import hf_models as M
from mla_compile.passes import mla_attention

pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

from mla_compile.integrations.hf import MLAPagedCache, MLAPagedLayer, cache_kwargs  # noqa: E402

FP8 = "fp8_e4m3"
COUNTERS = torch._dynamo.utils.counters


def _rewrite_only(gm, example_inputs):
    """The attention rewrite, then the FX graph as it is (the ops' CPU impls; no Inductor)."""
    mla_attention.rewrite_mla_attention(gm)
    return gm.forward


def _verify_steps(model, step, cache, ids, mask, drafts):
    """Prefill `ids` eagerly, then one S-token step per drafts[i] [B, S] through `step` (teacher-forced, as HF's
    verification of S - 1 drafted tokens: the mask built in the graph from the 2-D mask over the cache).
    Returns logits [steps, B, S, V]."""
    T = ids.shape[1]
    out = []
    with torch.no_grad():
        model(ids, attention_mask=mask[:, :T], **cache_kwargs(model, cache))
        for d in drafts:
            out.append(step(d, attention_mask=mask, **cache_kwargs(step, cache)).logits.float().clone())
    return torch.stack(out)


@pytest.mark.parametrize("impl, backend, dtype", [
    ("sdpa", "mla_dcp", torch.float32),  # the whole backend (Inductor over the FP8 views)
    ("eager", "rewrite", torch.float32),  # eager attention with a query token at a padding position: flat rows
    ("sdpa", "mla_dcp", torch.bfloat16),  # a bf16 model: bf16 rope part and queries beside the e4m3 latent
])
def test_fp8_cache_verification_steps_match_eager_over_the_same_cache(impl, backend, dtype):
    S, T, steps = 3, 5, 3
    L = T + S * steps + 1
    model = M.deepseek_v3(num_layers=1, attn_impl=impl, dtype=dtype)
    ids, mask = M.batch(B=2, T=T, L=L)
    if impl == "eager":
        mask[1, :T + 1] = 0  # request 1's first step: its first query token sees nothing (HF: flat softmax)
    g = torch.Generator().manual_seed(11)
    drafts = [torch.randint(1, 128, (2, S), generator=g) for _ in range(steps)]

    def fp8_cache():
        return MLAPagedCache(model.config, L, page_size=4, shuffle_pages=True, kv_cache_dtype=FP8)

    eager = _verify_steps(model, model, fp8_cache(), ids, mask, drafts)
    torch._dynamo.reset()
    COUNTERS.clear()
    compiled = torch.compile(model, backend=_rewrite_only if backend == "rewrite" else "mla_dcp", fullgraph=True,
                             dynamic=False)
    got = _verify_steps(model, compiled, fp8_cache(), ids, mask, drafts)
    c = dict(COUNTERS["mla_compile"])
    plain = _verify_steps(model, model, StaticCache(config=model.config, max_cache_len=L), ids, mask, drafts)
    torch._dynamo.reset()
    assert c.get(mla_attention.TOKENS_COUNTER, 0) >= 1 and not c.get(mla_attention.SKIP_COUNTER), c
    assert torch.isfinite(got).all()
    if dtype == torch.bfloat16:  # HF eager rounds its probabilities to bf16: near-ties may part
        assert M.rel_err(got, eager) < 2e-2, M.rel_err(got, eager)
        assert (got.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9
        return
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    assert M.rel_err(got, eager) < 1e-5, M.rel_err(got, eager)  # the same dequantized latent: float32 rounding
    # the FP8 values are what both read: an unquantized cache is far off (a rewrite that read the e4m3 bytes
    # without their scales would be off by orders of magnitude)
    assert M.rel_err(eager, plain) > 3e-3, M.rel_err(eager, plain)


# ---------------------------------------------------------------------------------- gather_latent's callers
class _Captured(Exception):
    pass


def _gather_sources(layer, B=2, T=3, R=512, P=64):
    """What the pass reads (`_gather_source`) from the Dynamo graph of `layer.update` (captured, never run: a DCP
    gather would need the group)."""
    from mla_compile.ops.hf_cache import GATHER_OPS
    from mla_compile.passes.attention_match import _gather_source

    k, v = torch.randn(B, 1, T, R), torch.randn(B, 1, T, P)
    layer.lazy_initialization(k, v)
    found = []

    def capture(gm, example_inputs):
        found.extend(_gather_source(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in GATHER_OPS)
        raise _Captured

    torch._dynamo.reset()
    with pytest.raises(Exception) as e:
        torch.compile(lambda k, v: layer.update(k, v), backend=capture, fullgraph=True)(k, v)
    assert isinstance(e.value, _Captured) or isinstance(e.value.__cause__, _Captured) or "_Captured" in str(e.value)
    torch._dynamo.reset()
    return found


@pytest.mark.parametrize("kv_cache_dtype", [FP8, None])
@pytest.mark.parametrize("heads_sharded", [True, False])
def test_gather_latent_callers_pass_scale_and_heads_sharded_in_place(kv_cache_dtype, heads_sharded):
    layer = MLAPagedLayer(max_cache_len=8, page_size=4, dcp_size=2, dcp_rank=1, group_name="g", shuffle_pages=False,
                          kv_cache_dtype=kv_cache_dtype, heads_sharded=heads_sharded)
    (src,) = _gather_sources(layer)
    assert (src.kind, src.dcp_size, src.dcp_rank, src.group_name) == ("dcp", 2, 1, "g")
    assert src.heads_sharded is heads_sharded
    if kv_cache_dtype == FP8:
        assert src.ckv_scale is not None
        assert src.ckv_scale.meta["example_value"].dtype == torch.float32
        assert src.ckv.meta["example_value"].dtype == torch.float8_e4m3fn
    else:
        assert src.ckv_scale is None
        assert src.ckv.meta["example_value"].dtype == torch.float32


# ------------------------------------------------------------------------------- DSA x multi-token x FP8
def test_v32_verification_steps_over_an_fp8_dsa_cache_cross_index_topk():
    """V3.2 over `DSAStaticCache(kv_cache_dtype="fp8_e4m3")`, 3-token steps crossing index_topk 9 (kv lengths 8, 11,
    14): the dense graph's steps are rewritten (indexer dropped, mla.decode with [B, S] limits over the FP8 pages);
    the sparse graph's rewritten too (each query token its own top-k: passes/dsa_tokens.py), counted.
    Logits: eager HF over the same FP8 cache."""
    from mla_compile.integrations.hf import DSAStaticCache

    S, T, steps = 3, 5, 3
    L = T + S * steps + 1
    model = M.deepseek_v32(num_layers=1, index_topk=9)
    ids, mask = M.batch(B=2, T=T, L=L)
    g = torch.Generator().manual_seed(12)
    drafts = [torch.randint(1, 128, (2, S), generator=g) for _ in range(steps)]

    def fp8_cache():
        return DSAStaticCache(model.config, L, kv_cache_dtype=FP8)

    eager = _verify_steps(model, model, fp8_cache(), ids, mask, drafts)
    torch._dynamo.reset()
    COUNTERS.clear()
    got = _verify_steps(model, torch.compile(model, backend="mla_dcp", fullgraph=True, dynamic=False), fp8_cache(),
                        ids, mask, drafts)
    c = dict(COUNTERS["mla_compile"])
    torch._dynamo.reset()
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    assert M.rel_err(got, eager) < 1e-5, M.rel_err(got, eager)
    assert c.get("dsa_index_mask_dropped", 0) >= 1 and c.get(mla_attention.TOKENS_COUNTER, 0) >= 1, c
    assert c.get(mla_attention.SPARSE_COUNTER, 0) >= 1 and not c.get(mla_attention.SKIP_COUNTER), c


# ------------------------------------------------------------------ short compiled prefill x FP8 cache
@pytest.mark.parametrize("kind", ["v3_paged", "v32_dsa_static"])
def test_compiled_short_prefill_over_an_fp8_cache(kind):
    """The prefill compiled too (5 tokens: a multi-token step the pass rewrites), the FP8 cache allocated and first
    written inside that graph, then greedy decode: the tokens and logits of eager HF over an FP8 cache."""
    from mla_compile.integrations.hf import DSAStaticCache

    L, steps = 20, 10
    if kind == "v3_paged":
        model = M.deepseek_v3(num_layers=1)

        def fp8_cache():
            return MLAPagedCache(model.config, L, page_size=4, shuffle_pages=True, kv_cache_dtype=FP8)
    else:  # kv lengths 6 .. 15 cross index_topk 8: the dense graph, then the sparse one
        model = M.deepseek_v32(num_layers=1, index_topk=8)

        def fp8_cache():
            return DSAStaticCache(model.config, L, kv_cache_dtype=FP8)

    ids, mask = M.batch(T=5, L=L)
    ref_t, ref_l = M.greedy(model, model, ids, mask, fp8_cache(), steps)
    torch._dynamo.reset()
    COUNTERS.clear()
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    t, logits = M.greedy(compiled, model, ids, mask, fp8_cache(), steps, prefill=compiled)
    c = dict(COUNTERS["mla_compile"])
    torch._dynamo.reset()
    assert torch.equal(t, ref_t), (t, ref_t)
    assert M.rel_err(logits, ref_l) < 1e-5, M.rel_err(logits, ref_l)
    assert c.get(mla_attention.TOKENS_COUNTER, 0) == 1, c  # the prefill
    assert c.get(mla_attention.COUNTER, 0) - c[mla_attention.TOKENS_COUNTER] >= 1, c  # the decode graph(s)
    assert not c.get(mla_attention.SKIP_COUNTER), c


# --------------------------------------------------------------- generate(): prompt lookup over an FP8 cache
def test_prompt_lookup_generate_over_an_fp8_cache():
    """HF's own verification loop (prompt lookup: drafts from the prompt, rejected ones cropped) over our FP8 paged
    cache, compiled (the mask built in the graph): the tokens of eager generate() over an FP8 cache."""
    from mla_compile.integrations.hf import compile_config, create_masks_in_graph

    model = M.deepseek_v3(num_layers=1)
    model.create_masks_for_generate = create_masks_in_graph
    ids = torch.randint(1, 120, (1, 4), generator=torch.Generator().manual_seed(5)).repeat(1, 3)
    new = 16

    def run(**extra):
        cache = MLAPagedCache(model.config, ids.shape[1] + new + 4, page_size=4, shuffle_pages=True, kv_cache_dtype=FP8)
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=2,
                                  **cache_kwargs(model, cache), **extra)

    ref = run(disable_compile=True)
    torch._dynamo.reset()
    COUNTERS.clear()
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    out = run(compile_config=compile_config(mode="default"))
    c = dict(COUNTERS["mla_compile"])
    torch._dynamo.reset()
    assert torch.equal(out, ref), (out, ref)
    assert c.get(mla_attention.TOKENS_COUNTER, 0) >= 1 and not c.get(mla_attention.SKIP_COUNTER), c
