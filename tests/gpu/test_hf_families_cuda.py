"""Every MLA family of the installed transformers on the GPU road (tests/hf/test_hf_families.py's cases and tiny
models, fp32, on CUDA):
- the compiled decode step under CUDA-graph trees (`torch.compile(model, backend="mla_dcp", mode="reduce-overhead")`,
  eager prefill into HF's StaticCache or, for DSA families, DSAStaticCache crossing index_topk): every MLA site
  rewritten, greedy tokens equal eager HF's and logits close;
- `generate()` through `optimize_generate(model)` (the README's recipe: HF's auto-compile with our backend, CUDA
  graphs, the mask built in the graph) for families with a causal-LM class, over HF's static cache, our paged cache
  and the FP8 cache: tokens equal eager `generate()`'s over the same kind of cache.
Families that fail on the CPU already (KNOWN there) keep their strict xfail; the CPU file's "slow" split does not
apply here. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("fresh_dynamo")]
transformers = pytest.importorskip("transformers")

import hf_models as M  # noqa: E402
import test_hf_families as F  # noqa: E402
from transformers import StaticCache  # noqa: E402

from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache, cache_kwargs, optimize_generate  # noqa: E402
from mla_compile.passes import mla_attention  # noqa: E402

COUNTERS = torch._dynamo.utils.counters
TOL = 1e-3  # fp32 on the GPU: cuBLAS / our kernels' summation orders against HF's eager ones
NEW = 6  # generate(): new tokens (DSA: the prompt + 1 = index_topk is crossed, dense then sparse)


def _gpu_cases():
    """The CPU file's cases with its xfail / skip marks, without its "slow" split."""
    out = []
    for p in F._cases():
        marks = [m for m in p.marks if m.name != "slow"]
        out.append(pytest.param(*p.values, id=p.id, marks=marks))
    return out


def _family_model(case: str, impl: str, dtype=torch.float32):
    model = F.tiny_model(case, impl).to(dtype).cuda().eval()
    return model, "index_topk" in model.config.to_dict()


def _step_inputs(model, dsa: bool):
    """(ids, 2-D mask over the whole cache, a maker of fresh caches: DSAStaticCache for DSA families) on CUDA."""
    L = F.PROMPT + F.STEPS + 1
    ids, mask = M.batch(T=F.PROMPT, L=L, vocab=model.config.vocab_size)
    return (ids.cuda(), mask.cuda(),
            lambda: DSAStaticCache(model.config, L) if dsa else StaticCache(config=model.config, max_cache_len=L))


@pytest.mark.parametrize("case, impl", _gpu_cases())
def test_family_decode_step_under_cuda_graphs(case, impl):
    model, dsa = _family_model(case, impl)
    ids, mask, cache = _step_inputs(model, dsa)
    ref_t, ref_l = M.greedy(model, model, ids, mask, cache(), F.STEPS)
    compiled = torch.compile(model, backend="mla_dcp", mode="reduce-overhead")
    # fp32 grouped_mm experts (transformers 5.25, e.g. longcat_flash) reach HF's host-synced fallback op here:
    # passes/grouped_mm.py rewrites it, or no CUDA graph could capture the step
    with torch._dynamo.config.patch(**F.DYNAMO.get(case.split(":")[0], {})):
        t, logits = M.greedy(compiled, model, ids, mask, cache(), F.STEPS, prefill=model)
    c = COUNTERS["mla_compile"]
    layers, graphs = F.mla_layers(model), 2 if dsa else 1
    assert c[mla_attention.COUNTER] == layers * graphs and c[mla_attention.SKIP_COUNTER] == 0, dict(c)
    assert torch.equal(t, ref_t)
    assert M.rel_err(logits, ref_l) < TOL, M.rel_err(logits, ref_l)


@pytest.mark.parametrize("case, impl", _gpu_cases())
def test_family_decode_step_bf16_under_cuda_graphs(case, impl):
    """bf16 (the production kernels: on sm_90 the Gluon ones for these shapes), teacher-forced on eager HF's greedy
    tokens (bf16 greedy paths may part at near-ties): the compiled step's logits within 3e-2 of eager HF's (relative
    to their largest), every MLA site rewritten."""
    model, dsa = _family_model(case, impl, torch.bfloat16)
    ids, mask, cache = _step_inputs(model, dsa)
    tokens, _ = M.greedy(model, model, ids, mask, cache(), F.STEPS)
    ref = M.forced(model, model, ids, mask, cache(), tokens)
    compiled = torch.compile(model, backend="mla_dcp", mode="reduce-overhead")
    with torch._dynamo.config.patch(**F.DYNAMO.get(case.split(":")[0], {})):
        got = M.forced(compiled, model, ids, mask, cache(), tokens)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.COUNTER] == F.mla_layers(model) * (2 if dsa else 1), dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)
    assert M.rel_err(got, ref) < 3e-2, M.rel_err(got, ref)


def _road_cache(road: str, model, dsa: bool, L: int):
    """The cache a user hands generate() on this road: HF's StaticCache (DSAStaticCache for DSA families), our paged
    cache over shuffled pages, or the FP8 latent cache (paged; DSA families: DSAStaticCache in FP8)."""
    if road == "static":
        return DSAStaticCache(model.config, L) if dsa else StaticCache(config=model.config, max_cache_len=L)
    if road == "paged":
        return MLAPagedCache(model.config, L, page_size=4, shuffle_pages=True)
    return (DSAStaticCache(model.config, L, kv_cache_dtype="fp8_e4m3") if dsa else
            MLAPagedCache(model.config, L, page_size=4, kv_cache_dtype="fp8_e4m3"))


@pytest.mark.parametrize("road", ["static", "paged", "fp8"])
@pytest.mark.parametrize("case, impl", _gpu_cases())
def test_family_generate_through_optimize_generate(case, impl, road):
    """Over each cache a user may hand generate(): tokens equal eager generate()'s over the same kind of cache (an
    FP8 cache's eager reference reads the dequantized latent), under CUDA graphs, every MLA site rewritten. The
    paged road takes in the hybrids' paged layers beside HF's recurrent ones and the rope-less layers' paged view."""
    model, dsa = _family_model(case, impl)
    if not hasattr(model, "generate"):
        pytest.skip(f"{case}: a multimodal family's text decoder (no causal-LM class with generate())")
    ids, mask = M.batch(T=F.PROMPT, L=F.PROMPT, vocab=model.config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()
    L = F.PROMPT + NEW

    def cache():
        return cache_kwargs(model, _road_cache(road, model, dsa, L))

    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, disable_compile=True, **cache(), **kw)
    M.fresh(model)
    optimize_generate(model)
    for _ in range(2):  # the second call replays the recorded graphs
        with torch._dynamo.config.patch(**F.DYNAMO.get(case.split(":")[0], {})), torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **cache(), **kw)
        assert torch.equal(out, ref)
    # every decode graph rewritten whole (a sliding-window family compiles one per window fill level: more graphs)
    c, layers = COUNTERS["mla_compile"], F.mla_layers(model)
    assert c[mla_attention.COUNTER] >= layers * (2 if dsa else 1) and c[mla_attention.COUNTER] % layers == 0, dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)


def test_sliding_window_generate_under_cuda_graphs(monkeypatch):
    """dots3_note's sliding-window layers through `optimize_generate` (reduce-overhead) with a window that fills
    during the decode: HF's sliding cache layer counts its tokens in a Python int, symbolic under `compile_config`
    (else one recompile per step) and an input of the step's graph (the window's mask reads it), so the backend
    compiles those steps without CUDA graphs: no recording per step (passes/step_kind.STEP_COUNTER_SOURCES). Tokens
    equal eager generate()'s, at most one compiled graph per window state and DSA graph. For comparison the same with
    `triton.cudagraphs` forced on (a CUDA graph recorded per step): recordings and ms per generate() printed."""
    import time

    from torch._inductor import cudagraph_trees

    case, new = "dots3_note:sliding", 12
    monkeypatch.setitem(F.VARIANTS, case, {**F.VARIANTS[case], "sliding_window": 8})
    records = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counted(self, *args, **kwargs):
        records.append(1)
        return record(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counted)
    model, dsa = _family_model(case, "sdpa")
    ids, mask = M.batch(T=F.PROMPT, L=F.PROMPT, vocab=model.config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def cache():
        return cache_kwargs(model, DSAStaticCache(model.config, F.PROMPT + new))

    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, disable_compile=True, **cache(), **kw)
    for forced in (False, True):
        M.fresh(model)
        optimize_generate(model, **({"triton.cudagraphs": True} if forced else {}))
        for call in range(3):
            records.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch._dynamo.config.patch(**F.DYNAMO.get("dots3_note", {})), torch.no_grad():
                out = model.generate(ids, attention_mask=mask, **cache(), **kw)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            assert torch.equal(out, ref)
            print(f"sliding window generate(), CUDA graphs {'forced on' if forced else 'as the backend chose'}, "
                  f"call {call}: {len(records)} CUDA graphs recorded for {new} new tokens, {ms:.1f} ms")
            if not forced and call:
                assert not records, len(records)
        c, layers = COUNTERS["mla_compile"], F.mla_layers(model)
        assert c[mla_attention.SKIP_COUNTER] == 0 and c[mla_attention.COUNTER] % layers == 0, dict(c)
        assert c[mla_attention.COUNTER] // layers <= 4, dict(c)


@pytest.mark.parametrize("cache_kind", ["static", "paged"])
def test_sinks_family_verification_steps_under_cuda_graphs(cache_kind):
    """Attention sinks on verification steps, on the GPU road: hy_v4 (sinks, DSA) through assisted generate() (a
    second tiny hy_v4 drafts 2 tokens every step: 3-token verification steps whatever the models generate; prompt
    lookup proposed none on transformers 5.24, whose tiny model repeats no n-gram) with `optimize_generate` (CUDA
    graphs), over DSAStaticCache or our paged cache. The prompt is shorter than index_topk, which the decode then
    crosses (the DSA-sparse graphs run too). Tokens equal eager generate()'s over the same kind of cache, the
    multi-token sites rewritten (the sinks scale each query row by its lse), none left to HF."""
    model, dsa = _family_model("hy_v4", "eager")
    assert dsa
    draft = F.tiny_model("hy_v4", "eager", seed=7).cuda().eval()
    draft.generation_config.num_assistant_tokens = 2
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    topk = model.config.get_text_config(decoder=True).index_topk
    ids = torch.randint(1, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(5)).cuda()
    assert ids.shape[1] < topk
    new = topk + 6 - ids.shape[1]  # the later verification steps read more than index_topk tokens
    L = ids.shape[1] + new + 4

    def cache():
        made = DSAStaticCache(model.config, L) if cache_kind == "static" else \
            MLAPagedCache(model.config, L, page_size=4, shuffle_pages=True)
        return cache_kwargs(model, made)

    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, assistant_model=draft)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, disable_compile=True, **cache(), **kw)
    M.fresh(model)
    optimize_generate(model)
    for _ in range(2):  # the second call replays the recorded graphs
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **cache(), **kw)
        assert torch.equal(out, ref), (out, ref)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.TOKENS_COUNTER] >= F.mla_layers(model), dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)
