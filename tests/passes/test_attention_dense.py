"""The attention rewrite's second form (`passes/attention_dense.py`): HF's attention over the latent in absorbed form
with HF's own mask, where the decode ops cannot take a site.

Every case runs the site eagerly in float64 (the reference) and compiled with `mla_dcp`, and checks what the pass
did (counters, log) and the values. HF continuous batching (`generate_batch`) is the road that needs it.
"""

from __future__ import annotations

import logging

import expecttest
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import hf_models as M
import mla_compile  # noqa: F401
from mla_compile.passes import attention_dense, mla_attention

COUNTERS = torch._dynamo.utils.counters
LOGGER = "mla_compile.passes.mla_attention"

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _inputs(B, H, S, L, dtype, seed=0):
    """q [B, H, S, 192], latent [B, 1, L, 512], kpe [B, 1, L, 64], kv_b_proj weight [H * 256, 512]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, 192, generator=g, dtype=torch.float64)
    latent = torch.randn(B, 1, L, 512, generator=g, dtype=torch.float64)
    kpe = torch.randn(B, 1, L, 64, generator=g, dtype=torch.float64)
    w = torch.randn(H * 256, 512, generator=g, dtype=torch.float64) / 512 ** 0.5
    return [t.to(dtype) for t in (q, latent, kpe, w)]


def _block_causal(B, S, L, seed, fill):
    """A continuous-batching mask [1|B, 1, S, L]: query rows split among requests, each row attending its own
    request's keys up to its position; some rows padding (every key masked). `fill`: the masked value (a float
    mask) or None (bool, True = attend)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.zeros(B, 1, S, L, dtype=torch.bool)
    for b in range(B):
        row = 0
        key = 0
        while row < S - 1 and key < L:
            n_q = int(torch.randint(1, max(2, (S - row) // 2 + 1), (1,), generator=g))
            n_k = int(torch.randint(n_q, max(n_q + 1, L - key + 1), (1,), generator=g))
            n_k = min(n_k, L - key)
            n_q = min(n_q, S - 1 - row, n_k)
            for j in range(n_q):  # causal within the request: its last n_q keys are its new tokens
                allowed[b, 0, row + j, key:key + n_k - n_q + j + 1] = True
            row, key = row + n_q, key + n_k
    return allowed if fill is None else torch.where(allowed, torch.zeros((), dtype=torch.float64), fill)


def _site(impl):
    def fn(q, latent, kpe, w, mask):
        return M.mla_attention_site(q, latent, kpe, w, mask, impl=impl)
    return fn


def _check(impl, q, latent, kpe, w, mask, *, dense: int, tol: float):
    fn = _site(impl)
    ref = fn(q.double(), latent.double(), kpe.double(), w.double(),
             mask if mask.dtype == torch.bool else mask.double())
    out = torch.compile(fn, backend="mla_dcp", fullgraph=True)(q, latent, kpe, w, mask)
    c = COUNTERS["mla_compile"]
    assert c[attention_dense.COUNTER] == dense and c[mla_attention.COUNTER] == 0, dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 1 - dense, dict(c)
    both = ~(ref.isnan() | out.isnan())
    assert torch.equal(out.isnan(), ref.isnan())
    err = ((out.double() - ref)[both].abs().max() / ref[both].abs().max()).item()
    assert err < tol, err
    return out, ref


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_continuous_batching_site_is_absorbed_with_its_own_mask(impl, dtype, tol, caplog):
    """16 query rows of several requests over their keys, HF's float mask handed in as a graph input (nothing
    provable about it): absorbed with that mask, values as HF's."""
    q, latent, kpe, w = _inputs(1, 4, 16, 96, dtype)
    mask = _block_causal(1, 16, 96, seed=1, fill=torch.finfo(dtype).min).to(dtype)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _check(impl, q, latent, kpe, w, mask, dense=1, tol=tol)
    assert "absorbed attention with HF's mask" in caplog.text and "query length 16 is not 1 .. 8" in caplog.text


@pytest.mark.parametrize("impl,fill,hf_gives", [("sdpa", None, "0"), ("sdpa", float("-inf"), "0"),
                                                ("eager", float("-inf"), "nan"), ("eager", "min", "uniform")])
def test_padding_rows_give_what_hf_gives(impl, fill, hf_gives):
    """Query rows with every key masked (continuous batching pads its query block): SDPA gives 0 (PyTorch's
    `_safe_softmax`), eager NaN under -inf and a flat softmax over every key under finfo.min."""
    q, latent, kpe, w = _inputs(2, 4, 12, 40, torch.float64)
    fill = torch.finfo(torch.float64).min if fill == "min" else fill
    mask = _block_causal(2, 12, 40, seed=3, fill=fill)
    mask[1, 0, -1] = False if mask.dtype == torch.bool else fill  # the last row of request block 1: padding
    out, ref = _check(impl, q, latent, kpe, w, mask, dense=1, tol=1e-12)
    padded = out[1, :, -1]
    if hf_gives == "0":
        assert torch.equal(padded, torch.zeros_like(padded))
    elif hf_gives == "nan":
        assert padded.isnan().all()
    else:
        assert not padded.isnan().any() and padded.abs().max() > 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 3), H=st.sampled_from([1, 2, 4]), S=st.integers(9, 24), extra=st.integers(0, 64),
       impl=st.sampled_from(["sdpa", "eager"]), bool_mask=st.booleans(), per_head=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_fuzz_any_mask_any_shape(fresh_dynamo, B, H, S, extra, impl, bool_mask, per_head, seed):
    """Random shapes and masks, bool or float, shared or per head (eager adds a bool mask: +1 / +0, HF's
    semantics, kept), against float64."""
    L = S + 8 + extra
    torch._dynamo.reset()
    COUNTERS.clear()
    q, latent, kpe, w = _inputs(B, H, S, L, torch.float64, seed)
    g = torch.Generator().manual_seed(seed)
    shape = (B, H if per_head else 1, S, L)
    mask = torch.rand(shape, generator=g) < 0.7
    if not bool_mask:
        mask = torch.where(mask, torch.randn(shape, generator=g, dtype=torch.float64), -1e9)
    hf, ours = _cost(H, S, L)
    _check(impl, q, latent, kpe, w, mask, dense=int(ours <= hf), tol=1e-12)


def _cost(H, S, L):
    return attention_dense.multiply_adds(H, S, L, 512, 64, 128, 128)


def test_prefill_over_its_own_tokens_stays_hf(caplog):
    """S close to L (a prefill): the absorbed form would cost more multiply-adds than HF's expansion, so the site
    stays HF's, counted and logged with both reasons."""
    q, latent, kpe, w = _inputs(1, 4, 64, 64, torch.float64)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()[None, None]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _check("sdpa", q, latent, kpe, w, mask, dense=0, tol=1e-12)
    assert "costs more than HF's expansion" in caplog.text


def test_cost_rule():
    """HF expands every key (L H R (nope + v)); the absorbed form pays per query row and key instead: it wins for
    decode-like rows over long latents, loses for a prefill over its own tokens."""
    hf, ours = _cost(16, 8, 65536)
    assert ours < hf / 10
    hf, ours = _cost(16, 64, 65536)
    assert ours < hf / 2
    hf, ours = _cost(16, 4096, 4096)
    assert ours > hf


transformers = pytest.importorskip("transformers")


@pytest.fixture
def cb_model():
    pytest.importorskip("transformers.generation.continuous_batching.cache_allocators.compressed_latents",
                        reason="HF continuous batching caches MLA latents from transformers 5.25")
    from mla_compile import models

    return models.deepseek_v3(num_layers=2, max_positions=512)


def test_hf_continuous_batching_generate_batch(cb_model):
    """HF `generate_batch` (continuous batching over its paged latent cache) with `mla_dcp` as the compile
    backend: the same tokens as HF uncompiled, every attention site absorbed with HF's mask."""
    from transformers import CompileConfig, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41]]
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def run(compile_config=None):
        cfg = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64,
                                       varlen_compile_config=compile_config)
        out = cb_model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg)
        return {k: v.generated_tokens for k, v in out.items()}

    ref = run()
    cc = CompileConfig(backend="mla_dcp", mode="default", fullgraph=False)
    cc._compile_all_devices = True  # HF compiles on CUDA only otherwise
    assert run(cc) == ref
    c = COUNTERS["mla_compile"]
    assert c[attention_dense.COUNTER] >= 1 and c[mla_attention.SKIP_COUNTER] == 0, dict(c)


# ------------------------------------------------------------------------------------------- the snapshot
def _graph_text(gm) -> str:
    return M.node_lines([n for n in gm.graph.nodes if n.op in ("call_function", "call_method")])


class TestDenseSnapshot(expecttest.TestCase):
    """The rewritten graph of a 12-row site over 40 keys with a float mask input (sdpa, bfloat16: the float32
    math of PyTorch's math backend). Regenerate: `EXPECTTEST_ACCEPT=1 pytest tests/passes/test_attention_dense.py`."""

    def test_after(self):
        torch._dynamo.reset()
        COUNTERS.clear()
        seen = {}

        def backend(gm, example_inputs):
            seen["n"] = mla_attention.rewrite_mla_attention(gm)
            seen["text"] = _graph_text(gm)
            return gm.forward

        q, latent, kpe, w = _inputs(1, 2, 12, 40, torch.bfloat16)
        mask = _block_causal(1, 12, 40, seed=0, fill=-1e9).to(torch.bfloat16)
        torch.compile(_site("sdpa"), backend=backend, fullgraph=True)(q, latent, kpe, w, mask)
        torch._dynamo.reset()
        self.assertEqual(seen["n"], 1)
        self.assertExpectedInline(seen["text"], """\
%0 = aten.reshape.default(%in, [2, 256, 512]) -> [2, 256, 512] bfloat16
%1 = aten.slice.Tensor(%0, 1, 0, 128) -> [2, 128, 512] bfloat16
%2 = aten.slice.Tensor(%0, 1, 128, 256) -> [2, 128, 512] bfloat16
%3 = aten.transpose.int(%2, 1, 2) -> [2, 512, 128] bfloat16
%4 = aten.slice.Tensor(%in, 3, 0, 128) -> [1, 2, 12, 128] bfloat16
%5 = aten.slice.Tensor(%in, 3, 128, 192) -> [1, 2, 12, 64] bfloat16
%6 = aten.permute.default(%4, [1, 0, 2, 3]) -> [2, 1, 12, 128] bfloat16
%7 = aten.reshape.default(%6, [2, -1, 128]) -> [2, 12, 128] bfloat16
%8 = aten.bmm.default(%7, %1) -> [2, 12, 512] bfloat16
%9 = aten.reshape.default(%8, [2, -1, 12, 512]) -> [2, 1, 12, 512] bfloat16
%10 = aten.permute.default(%9, [1, 0, 2, 3]) -> [1, 2, 12, 512] bfloat16
%11 = aten.reshape.default(%10, [-1, 24, 512]) -> [1, 24, 512] bfloat16
%12 = aten.reshape.default(%5, [-1, 24, 64]) -> [1, 24, 64] bfloat16
%13 = aten.cat.default([%11, %12], -1) -> [1, 24, 576] bfloat16
%14 = aten.reshape.default(%in, [-1, 40, 512]) -> [1, 40, 512] bfloat16
%15 = aten.reshape.default(%in, [-1, 40, 64]) -> [1, 40, 64] bfloat16
%16 = aten.cat.default([%14, %15], -1) -> [1, 40, 576] bfloat16
%17 = aten._to_copy.default(%13, dtype=float32) -> [1, 24, 576] float32
%18 = aten._to_copy.default(%16, dtype=float32) -> [1, 40, 576] float32
%19 = aten.transpose.int(%18, 1, 2) -> [1, 576, 40] float32
%20 = aten.bmm.default(%17, %19) -> [1, 24, 40] float32
%21 = aten.reshape.default(%20, [-1, 2, 12, 40]) -> [1, 2, 12, 40] float32
%22 = aten.mul.Tensor(%21, 0.07) -> [1, 2, 12, 40] float32
%23 = aten.add.Tensor(%22, %in) -> [1, 2, 12, 40] float32
%24 = aten._safe_softmax.default(%23, -1) -> [1, 2, 12, 40] float32
%25 = aten.slice.Tensor(%18, 2, 0, 512) -> [1, 40, 512] float32
%26 = aten.reshape.default(%24, [-1, 24, 40]) -> [1, 24, 40] float32
%27 = aten.bmm.default(%26, %25) -> [1, 24, 512] float32
%28 = aten._to_copy.default(%27, dtype=bfloat16) -> [1, 24, 512] bfloat16
%29 = aten.reshape.default(%28, [-1, 2, 12, 512]) -> [1, 2, 12, 512] bfloat16
%30 = aten.permute.default(%29, [1, 0, 2, 3]) -> [2, 1, 12, 512] bfloat16
%31 = aten.reshape.default(%30, [2, -1, 512]) -> [2, 12, 512] bfloat16
%32 = aten.bmm.default(%31, %3) -> [2, 12, 128] bfloat16
%33 = aten.reshape.default(%32, [2, -1, 12, 128]) -> [2, 1, 12, 128] bfloat16
%34 = aten.permute.default(%33, [1, 0, 2, 3]) -> [1, 2, 12, 128] bfloat16""")
