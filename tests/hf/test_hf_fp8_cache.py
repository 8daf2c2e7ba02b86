"""The FP8 latent cache on the HF path (`kv_cache_dtype="fp8_e4m3"`, mla_compile/integrations/fp8_cache.py).

- the option: accepted values, refused ones named, the default unchanged;
- the write: what HF hands the cache is quantized on write, byte for byte `fp8.quantize` (656-byte tokens for a bf16
  model); `mla::cache_write_fp8_tokens` (the buffer-level write) against `mla::cache_write_fp8` over the views;
- eager HF over an FP8 cache runs over the dequantized latent (`mla_hf::gather_latent` with ckv_scale);
- compiled (`backend="mla_dcp"`) over an FP8 cache equals eager over it (fp32 model: the rewrite is exact up to
  float32 reassociation): V3 paged; V3.2 `DSAStaticCache` through the dense and the sparse graph; generate();
  DCP over 2 gloo ranks equals one rank;
- the acceptance's accuracy metric (bf16 weights; logits vs the fp32 model; FP8 cache vs bf16 cache).
"""

from __future__ import annotations

import re
import types

import pytest
import torch

import hf_models as M
from mla_compile import fp8
from mla_compile.integrations import fp8_cache
from mla_compile.passes import mla_attention

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache, cache_kwargs, optimize_generate  # noqa: E402

FP8 = "fp8_e4m3"
COUNTERS = torch._dynamo.utils.counters
TOL = 1e-4  # fp32 model: compiled vs eager over the same FP8 cache


# ----------------------------------------------------------------------------------------------- the option
@pytest.mark.parametrize("bad", ["fp8", "bf16", "e4m3", torch.float8_e4m3fn, 8])
def test_bad_kv_cache_dtype_is_refused_naming_the_argument(bad):
    cfg = M.deepseek_v32(num_layers=1).config
    for make in (lambda: MLAPagedCache(cfg, 16, kv_cache_dtype=bad), lambda: DSAStaticCache(cfg, 16, kv_cache_dtype=bad)):
        with pytest.raises(ValueError, match="^kv_cache_dtype: "):
            make()


@pytest.mark.parametrize("kv_cache_dtype, bad", [(FP8, "e8m0"), (FP8, "UE8M0"), (FP8, 1), (None, "ue8m0"),
                                                  ("auto", "ue8m0")])
def test_bad_fp8_scale_fmt_is_refused_naming_the_argument(kv_cache_dtype, bad):
    cfg = M.deepseek_v32(num_layers=1).config
    for make in (MLAPagedCache, DSAStaticCache):
        with pytest.raises(ValueError, match="^fp8_scale_fmt: "):
            make(cfg, 16, kv_cache_dtype=kv_cache_dtype, fp8_scale_fmt=bad)


def test_default_cache_dtype_is_the_models():
    model = M.deepseek_v32(num_layers=1, dtype=torch.bfloat16)
    ids, mask = M.batch(T=5, L=8)
    for cache in (MLAPagedCache(model.config, 8, page_size=4), MLAPagedCache(model.config, 8, kv_cache_dtype="auto"),
                  DSAStaticCache(model.config, 8)):
        with torch.no_grad():
            model(ids, attention_mask=mask[:, :5], **cache_kwargs(model, cache))
        layer = cache.layers[0]
        assert layer.keys.dtype == layer.values.dtype == torch.bfloat16
        assert layer.keys.shape[-1] == 512 and layer.values.shape[-1] == 64


def test_float64_model_is_refused_naming_the_argument():
    model = M.deepseek_v3(num_layers=1, dtype=torch.float64)
    ids, mask = M.batch(T=3, L=8)
    with pytest.raises(ValueError, match="^kv_cache_dtype: .*float64"), torch.no_grad():
        model(ids, attention_mask=mask[:, :3], **cache_kwargs(model, MLAPagedCache(model.config, 8, kv_cache_dtype=FP8)))


# ------------------------------------------------------------------------------------------------ the write
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("cache_kind", ["paged", "dsa_static"])
def test_hf_writes_quantized_656_byte_tokens(cache_kind, scale_fmt):
    """Prefill a bf16 V3.2 into an FP8 cache and into HF's StaticCache: every written token of the FP8 buffer is
    fp8.quantize(HF's latent, fp8_scale_fmt) and HF's rope latent, byte for byte; unwritten slots stay zero."""
    model = M.deepseek_v32(num_layers=1, dtype=torch.bfloat16)
    T, L = 7, 16
    ids, mask = M.batch(T=T, L=L)
    kw = dict(kv_cache_dtype=FP8, fp8_scale_fmt=scale_fmt)
    cache = (MLAPagedCache(model.config, L, page_size=4, shuffle_pages=True, **kw)
             if cache_kind == "paged" else DSAStaticCache(model.config, L, **kw))
    ref = StaticCache(config=model.config, max_cache_len=L)
    with torch.no_grad():
        for c in (cache, ref):
            model(ids, attention_mask=mask[:, :T], **cache_kwargs(model, c))
    layer = cache.layers[0]
    buf = layer.keys
    assert buf.dtype == torch.uint8 and buf.shape[-1] == 656 == fp8.token_bytes(512, 64)
    ckv, scale, kpe = fp8.views(buf, 512)
    PS = buf.shape[1]
    written = torch.zeros(buf.shape[:2], dtype=torch.bool)
    for b in range(ids.shape[0]):
        q, s = fp8.quantize(ref.layers[0].keys[b, 0, :T], scale_fmt)
        if scale_fmt:
            assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
        for t in range(T):
            page, off = int(layer.block_table[b, t // PS]), t % PS
            assert torch.equal(ckv[page, off].view(torch.uint8), q[t].view(torch.uint8))
            assert torch.equal(scale[page, off], s[t])
            assert torch.equal(kpe[page, off], ref.layers[0].values[b, 0, t])
            written[page, off] = True
    assert not buf[~written].any()


def test_cache_write_fp8_tokens_is_cache_write_fp8_over_the_views():
    g = torch.Generator().manual_seed(3)
    for R, P, rope in ((512, 64, torch.bfloat16), (256, 32, torch.float32), (128, 0, torch.bfloat16)):
        a, b = fp8.allocate(3, 4, R, P, rope_dtype=rope)[0], fp8.allocate(3, 4, R, P, rope_dtype=rope)[0]
        a.fill_(0x5A)
        b.fill_(0x5A)
        x, kp = torch.randn(5, R, generator=g).bfloat16(), torch.randn(5, P, generator=g).to(rope)
        slots = torch.tensor([0, 11, -1, 5, 6])
        torch.ops.mla.cache_write_fp8_tokens(a, x, kp, slots)
        c, s, k = fp8.views(b, R, rope)
        torch.ops.mla.cache_write_fp8(c, k, s, x, kp, slots)
        assert torch.equal(a, b)
        assert not torch.equal(a, torch.full_like(a, 0x5A))
    buf = fp8.allocate(3, 4, 128, 16, rope_dtype=torch.float32)[0]
    torch.library.opcheck(torch.ops.mla.cache_write_fp8_tokens.default,
                          (buf, torch.randn(4, 128, generator=g), torch.randn(4, 16, generator=g),
                           torch.tensor([0, -1, 5, 11])))


@pytest.mark.parametrize("change, name", [
    (dict(token_buf=torch.zeros(2, 4, 655, dtype=torch.uint8)), "token_buf"),
    (dict(token_buf=torch.zeros(2, 4, 656)), "token_buf"),
    (dict(token_buf=torch.zeros(2, 4, 1312, dtype=torch.uint8)[..., ::2]), "token_buf"),
    (dict(ckv=torch.zeros(1, 500)), "ckv"),
    (dict(kpe=torch.zeros(1, 63, dtype=torch.bfloat16)), "kpe"),
    (dict(kpe=torch.zeros(1, 64, dtype=torch.float64)), "kpe"),
    (dict(slots=torch.tensor([8])), "slots"),
    (dict(slots=torch.tensor([0], dtype=torch.int32)), "slots"),
])
def test_cache_write_fp8_tokens_bad_inputs_name_the_argument(change, name):
    kw = dict(token_buf=torch.zeros(2, 4, 656, dtype=torch.uint8), ckv=torch.zeros(1, 512),
              kpe=torch.zeros(1, 64, dtype=torch.bfloat16), slots=torch.tensor([3]))
    kw.update(change)
    with pytest.raises(ValueError, match=f"^{re.escape(name)}: "):
        torch.ops.mla.cache_write_fp8_tokens(**kw)


def test_gather_latent_dequantizes_an_fp8_cache():
    g = torch.Generator().manual_seed(4)
    buf = fp8.allocate(4, 2, 256, 16)[0]
    x, kp = torch.randn(5, 256, generator=g), torch.randn(5, 16, generator=g).bfloat16()
    bt = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)  # request 0: slots 4, 5, 0; request 1: slots 6, 7
    fp8_cache.write(buf, x, kp, torch.tensor([4, 5, 0, 6, 7]))
    ckv, kpe = fp8_cache.gather(buf, 256, torch.bfloat16, bt, 3, 1, 0, "")
    q, s = fp8.quantize(x)
    want = (q.double().view(5, 2, 128) * s.double()[..., None]).view(5, 256).bfloat16()  # independent of fp8.py
    assert ckv.dtype == kpe.dtype == torch.bfloat16 and ckv.shape == (2, 1, 3, 256) and kpe.shape == (2, 1, 3, 16)
    assert torch.equal(ckv[0, 0], want[:3]) and torch.equal(ckv[1, 0, :2], want[3:])
    assert torch.equal(kpe[0, 0], kp[:3]) and torch.equal(kpe[1, 0, :2], kp[3:])
    c, s8, k = fp8.views(buf, 256)
    torch.library.opcheck(torch.ops.mla_hf.gather_latent.default, (c, k, bt, 3, 1, 0, "", s8),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match="^ckv_scale: "):
        torch.ops.mla_hf.gather_latent(c, k, bt, 3, 1, 0, "")
    with pytest.raises(ValueError, match="^ckv_scale: "):
        torch.ops.mla_hf.gather_latent(k, k, bt, 3, 1, 0, "", s8)


def test_capacity_counts_the_scales():
    assert fp8_cache.tokens_per_gib(512, 64, torch.bfloat16) == (1 << 30) // 656
    assert fp8_cache.tokens_per_gib(512, 64, torch.bfloat16, "auto") == (1 << 30) // 1152
    assert fp8_cache.tokens_per_gib(512, 64, torch.float32) == (1 << 30) // (512 + 16 + 256)


# ------------------------------------------------------------------------ compiled over FP8 == eager over FP8
def _compiled_vs_eager(model, cache_fn, T: int, steps: int):
    """Teacher-forced decode of the same tokens: eager HF over an FP8 cache, and the model compiled with mla_dcp
    over another; both prefilled eagerly. Returns (eager logits, compiled logits, eager over HF's StaticCache (unquantized)
    logits, mla_compile counters)."""
    torch._dynamo.reset()
    COUNTERS.clear()
    L = T + steps + 1
    ids, mask = M.batch(T=T, L=L)
    toks = torch.randint(1, 128, (ids.shape[0], steps), generator=torch.Generator().manual_seed(7))
    eager = M.forced(model, model, ids, mask, cache_fn(model.config, L), toks)
    compiled = M.forced(torch.compile(model, backend="mla_dcp", fullgraph=True), model, ids, mask,
                        cache_fn(model.config, L), toks)
    plain = M.forced(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), toks)
    counters = dict(COUNTERS["mla_compile"])
    torch._dynamo.reset()
    return eager, compiled, plain, counters


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_compiled_v3_over_fp8_paged_cache_is_eager(scale_fmt):
    model = M.deepseek_v3(num_layers=1)
    eager, compiled, plain, c = _compiled_vs_eager(
        model, lambda cfg, L: MLAPagedCache(cfg, L, page_size=4, shuffle_pages=True, kv_cache_dtype=FP8,
                                            fp8_scale_fmt=scale_fmt), 9, 4)
    assert M.rel_err(compiled, eager) < TOL
    assert M.rel_err(eager, plain) > 30 * TOL  # the FP8 cache is what both read (not an fp32 copy)
    assert c.get(mla_attention.COUNTER) == 1 and not c.get(mla_attention.SKIP_COUNTER), c


def test_compiled_v32_over_fp8_dsa_static_cache_is_eager_in_both_graphs():
    """kv length 6 .. 13 crosses index_topk 9: the dense graph (indexer dropped) then the sparse one
    (dsa.indexer_topk + mla.sparse_decode over the FP8 pages)."""
    model = M.deepseek_v32(num_layers=1, index_topk=9)
    eager, compiled, plain, c = _compiled_vs_eager(
        model, lambda cfg, L: DSAStaticCache(cfg, L, kv_cache_dtype=FP8), 5, 8)
    assert M.rel_err(compiled, eager) < TOL
    assert M.rel_err(eager, plain) > 30 * TOL
    assert c.get("dsa_index_mask_dropped", 0) >= 1 and c.get(mla_attention.SPARSE_COUNTER, 0) >= 1, c
    assert not c.get(mla_attention.SKIP_COUNTER), c


def test_generate_over_an_fp8_cache():
    """optimize_generate's road (HF's auto-compile of the decode step with mla_dcp) over a passed FP8 cache: the
    tokens of eager generate() over an FP8 cache."""
    model = M.deepseek_v3(num_layers=1)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)

    def cache():
        return cache_kwargs(model, MLAPagedCache(model.config, 16, page_size=4, kv_cache_dtype=FP8))

    with torch.no_grad():
        ref = model.generate(ids, cache_implementation=None, disable_compile=True, **cache(), **kw)
        torch._dynamo.reset()
        COUNTERS.clear()
        optimize_generate(model)
        out = model.generate(ids, **cache(), **kw)
    assert torch.equal(out, ref)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 1, dict(COUNTERS["mla_compile"])
    torch._dynamo.reset()


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_generate_takes_the_power_of_two_promise_from_its_cache(scale_fmt, monkeypatch):
    """A cache written with power-of-two scales (fp8_scale_fmt="ue8m0") is the only setting a generate() user
    makes: optimize_generate's wrapper runs the call under Tuning.fp8_scale_fmt "ue8m0" (what lets auto take
    FlashMLA's FP8 kernel at 128 heads), seen by every FP8 read of the compiled step; a cache of amax scales promises
    nothing. The tokens stay eager generate()'s over the same cache."""
    from mla_compile import tuning
    from mla_compile.ops import _checks

    model = M.deepseek_v3(num_layers=1)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    seen, check = [], _checks._check_promised_scales

    def spy(ckv_scale, scale_name):
        seen.append(tuning.current().fp8_scale_fmt)
        return check(ckv_scale, scale_name)

    def cache():
        return cache_kwargs(model, MLAPagedCache(model.config, 16, page_size=4, kv_cache_dtype=FP8,
                                                 fp8_scale_fmt=scale_fmt))

    with torch.no_grad():
        ref = model.generate(ids, cache_implementation=None, disable_compile=True, **cache(), **kw)
        torch._dynamo.reset()
        monkeypatch.setattr(_checks, "_check_promised_scales", spy)
        optimize_generate(model)
        out = model.generate(ids, **cache(), **kw)
    assert torch.equal(out, ref)
    assert seen and set(seen) == {scale_fmt}, seen
    assert tuning.current() == tuning.DEFAULT  # only for the call
    torch._dynamo.reset()


# -------------------------------------------------------------------------------------------- DCP, 2 ranks
def cmd_hf_fp8_dcp(ctx, steps: int):
    """This rank: single-rank eager HF over a whole FP8 cache (the reference), eager HF over this rank's FP8 shard
    (the shards' dequantized latents all-gathered), and the model compiled with mla_dcp over it (mla.dcp_decode
    over FP8 shards). Quantization is per token, so sharding does not change what the tokens hold."""
    torch.manual_seed(0)
    dcp = types.SimpleNamespace(size=ctx.n, rank=ctx.rank, group_name=ctx.group_name)
    model = M.deepseek_v3(num_layers=1)
    L = 32
    ids, mask = M.batch(L=L)
    one = M.greedy(model, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, kv_cache_dtype=FP8), steps)
    sharded = lambda: MLAPagedCache(model.config, L, page_size=4, dcp=dcp, kv_cache_dtype=FP8)  # noqa: E731
    eager = M.greedy(model, model, ids, mask, sharded(), steps)
    COUNTERS.clear()
    compiled = M.greedy(torch.compile(model, backend="mla_dcp", fullgraph=True), model, ids, mask, sharded(), steps,
                        prefill=model)
    return dict(one=one, eager=eager, compiled=compiled, counters=dict(COUNTERS["mla_compile"]))


COMMANDS = {"hf_fp8_dcp": cmd_hf_fp8_dcp}


def test_dcp_over_fp8_hf_caches_on_two_gloo_ranks_is_one_rank():
    import test_dcp_gloo as base

    group = base.GlooGroup(2, commands=__name__)
    try:
        results = group.run("hf_fp8_dcp", 6, timeout=400.0)
    finally:
        if not group.broken:
            group.close()
    for r in results:
        (t1, l1), (te, le), (tc, lc) = r["one"], r["eager"], r["compiled"]
        assert torch.equal(te, t1) and M.rel_err(le, l1) < TOL
        assert torch.equal(tc, t1) and M.rel_err(lc, l1) < TOL
        assert r["counters"].get(mla_attention.COUNTER) == 1, r["counters"]
    assert torch.equal(results[0]["compiled"][1], results[1]["compiled"][1])  # identical on every rank


# ------------------------------------------------------------------------------------- the accuracy metric
ACC_PROMPT, ACC_STEPS = 256, 128  # 2 x 128 greedy picks: with 2 x 16 one flipped near-tie moved agreement 3%


def _accuracy(kind: str, cache_fn, **model_kw):
    """Acceptance metric (issue 25): bf16 weights, teacher-forced decode after a ACC_PROMPT-token prompt; logits of
    the bf16 model over a bf16 cache and over an FP8 cache against the fp32 model (fp32 StaticCache). Returns
    {cache: (relative RMS error of the logits, greedy agreement with the fp32 model)}. Eager HF: compiled over the
    same cache is eager up to float32 reassociation (the tests above)."""
    build = M.deepseek_v3 if kind == "v3" else M.deepseek_v32
    m32, m16 = build(num_layers=2, **model_kw), build(num_layers=2, dtype=torch.bfloat16, **model_kw)
    L = ACC_PROMPT + ACC_STEPS + 1
    g = torch.Generator().manual_seed(5)
    ids, mask = torch.randint(1, 128, (2, ACC_PROMPT), generator=g), torch.ones(2, L, dtype=torch.long)
    toks = torch.randint(1, 128, (2, ACC_STEPS), generator=g)
    ref = M.forced(m32, m32, ids, mask, StaticCache(config=m32.config, max_cache_len=L), toks)
    out = {}
    for dt in ("auto", FP8):
        got = M.forced(m16, m16, ids, mask, cache_fn(m16.config, L, dt), toks)
        out[dt] = ((got - ref).norm() / ref.norm()).item(), (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(kind, model_kw, {k: f"err {e:.4f} agree {a:.3f}" for k, (e, a) in out.items()})
    return out


ACCURACY = {  # name: (model, cache, model kwargs)
    "v3-paged": ("v3", lambda cfg, L, dt: MLAPagedCache(cfg, L, page_size=16, kv_cache_dtype=dt), {}),
    "v32-dense": ("v32", lambda cfg, L, dt: DSAStaticCache(cfg, L, kv_cache_dtype=dt), {}),
    "v32-sparse": ("v32", lambda cfg, L, dt: DSAStaticCache(cfg, L, kv_cache_dtype=dt), dict(index_topk=64)),
}


_RESULTS: dict = {}


def _measured(name):
    if name not in _RESULTS:
        kind, cache_fn, kw = ACCURACY[name]
        _RESULTS[name] = _accuracy(kind, cache_fn, **kw)
    return _RESULTS[name]["auto"], _RESULTS[name][FP8]


@pytest.mark.parametrize("name", list(ACCURACY))
def test_fp8_cache_error_is_the_quantization_only(name):
    """What holds on these tiny random-weight models (measured over 2 x 128 picks: FP8 / bf16-cache logit error 2.7x
    V3, 2.7x V3.2 dense, 1.05x V3.2 sparse, where the bf16 model's own top-k choices already differ from fp32's)."""
    (e16, a16), (e8, a8) = _measured(name)
    assert e16 < 0.3 and e8 < 0.3  # a wrong scale / group / slot would be off by O(1) (sparse bf16: 0.2)
    assert e8 <= 4 * e16 and a8 >= 0.8 * a16


@pytest.mark.parametrize("name", list(ACCURACY))
def test_fp8_cache_greedy_agreement_acceptance(name):
    """Issue 25's acceptance, greedy half: agreement with the fp32 model >= 90% of the bf16 cache's (measured 0.92
    V3, 0.95 V3.2 dense, 0.98 V3.2 sparse over 2 x 128 teacher-forced picks)."""
    (e16, a16), (e8, a8) = _measured(name)
    assert a8 >= 0.9 * a16


@pytest.mark.parametrize("name", [
    pytest.param("v3-paged", marks=pytest.mark.xfail(strict=True, reason="measured 2.7x the bf16 cache's error")),
    pytest.param("v32-dense", marks=pytest.mark.xfail(strict=True, reason="measured 2.7x the bf16 cache's error")),
    "v32-sparse"])
def test_fp8_cache_logit_error_acceptance(name):
    """Issue 25's acceptance, logit half: FP8 cache logit error <= 2x the bf16 cache's. Not met for dense attention
    on these models (hidden 64, 2 layers; hidden 256 and 512 with 4 layers measured 3.0x and 3.1x): e4m3's 3
    mantissa bits put ~3% relative noise on every latent value, against bf16 weights' ~0.4% (strict xfail: a change
    that meets it shows up)."""
    (e16, a16), (e8, a8) = _measured(name)
    assert e8 <= 2 * e16
