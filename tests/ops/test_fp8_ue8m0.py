"""Power-of-two FP8 scales (`scale_fmt="ue8m0"`, mla_compile/fp8.py): DeepSeek's own quantizer, exact under
FlashMLA's bf16 dequantization.

- `fp8.quantize(x, "ue8m0")` against an independent definition (the smallest power of two >= max(amax / 448, 1e-4),
  by `math.frexp` in float64), hypothesis-fuzzed; against DeepSeek's torch formula (FlashMLA's tests/quant.py:
  `2 ** ceil(log2(clamp_min(amax / 448, 1e-4)))`) on random latents;
- the property the format is for: value x scale is exact in bf16 (with amax / 448 scales it is not);
- `mla::cache_write_fp8` / `mla::cache_write_fp8_tokens` write those bytes; a bad scale_fmt is refused naming it,
  also in fake mode; opcheck with the argument;
- every decode reads the cache (the CPU op against the float64 reference over the dequantized cache).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import mla_compile  # noqa: F401  (registers the ops)
import reference as ref
from mla_compile import fp8, paged

UE8M0 = "ue8m0"


def pow2_scale_reference(amax: float) -> float:
    """The smallest power of two >= max(float32(amax / 448), float32(1e-4)), exactly (frexp: no log2 rounding)."""
    s = max(float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0)),
            float(torch.tensor(1e-4, dtype=torch.float32)))
    m, e = math.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


@settings(max_examples=60, deadline=None)
@given(exps=st.lists(st.integers(-40, 40), min_size=3, max_size=3), seed=st.integers(0, 2**16),
       near=st.sampled_from(["random", "power", "above"]))
def test_quantize_ue8m0_is_the_smallest_power_of_two(exps, seed, near):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 384, generator=g) * torch.tensor([2.0 ** e for e in exps]).repeat_interleave(128)
    if near != "random":  # group 0 of row 0: amax / 448 a power of two, or one float32 ulp above it
        top = 448.0 * 2.0 ** exps[0]
        x[0, 0] = top if near == "power" else float(torch.nextafter(torch.tensor(top), torch.tensor(math.inf)))
        x[0, 1:128] = x[0, 1:128].clamp(-top / 2, top / 2)
    q, s = fp8.quantize(x, UE8M0)
    amax = x.abs().reshape(4, 3, 128).amax(-1)
    want = torch.tensor([[pow2_scale_reference(float(a)) for a in row] for row in amax], dtype=torch.float32)
    assert torch.equal(s, want)
    want_q = (x.reshape(4, 3, 128) / want[..., None]).to(torch.float8_e4m3fn)  # exact division by a power of two
    assert torch.equal(q.view(torch.uint8), want_q.reshape(4, 384).view(torch.uint8))


def test_quantize_ue8m0_matches_deepseeks_formula_on_latents():
    """FlashMLA's quantizer formula byte for byte on random latents (float32 log2 rounding differs from the exact
    power only within a few ulps above a power of two, which random data does not hit)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 512, generator=g) * torch.tensor([1.0, 0.25, 4.0, 1e-3]).repeat_interleave(128)).bfloat16()
    q, s = fp8.quantize(x, UE8M0)
    for tile in range(4):
        part = x[:, tile * 128:(tile + 1) * 128]
        inv = part.abs().amax(-1).float() / 448.0
        inv = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil()).float()
        assert torch.equal(s[:, tile], inv)
        want = (part.float() / inv[:, None]).to(torch.float8_e4m3fn)
        assert torch.equal(q[:, tile * 128:(tile + 1) * 128].view(torch.uint8), want.view(torch.uint8))


def test_ue8m0_dequantization_is_exact_in_bf16():
    """Why the format: FlashMLA's FP8 kernels round value x scale to bf16 before their MMAs. With power-of-two scales
    that rounding is exact; with amax / 448 scales it is not (so only the former is FlashMLA-exact)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(32, 512, generator=g) * 3
    for scale_fmt, exact in ((UE8M0, True), (None, False)):
        q, s = fp8.quantize(x, scale_fmt)
        deq = fp8.dequantize(q, s)
        assert torch.equal(deq.bfloat16().float(), deq) == exact


def test_zero_nan_and_inf_groups():
    x = torch.ones(3, 256)
    x[0, :128] = 0.0
    x[1, 5] = float("nan")
    x[2, 130] = float("inf")
    q, s = fp8.quantize(x, UE8M0)
    assert s[0, 0] == 2.0 ** -13 and torch.all(q[0, :128].float() == 0)  # the 1e-4 floor, rounded up
    assert s[0, 1] == 2.0 ** -8  # amax 1: 1 / 448 -> 2^-8
    assert torch.isnan(s[1, 0]) and torch.isinf(s[2, 1])
    assert not torch.isfinite(ref.ref_dequantize_fp8(q, s)[1:, :]).all(1).any()


@pytest.mark.parametrize("bad", ["e8m0", "UE8M0", "", "amax"])
def test_bad_scale_fmt_names_the_argument(bad):
    with pytest.raises(ValueError, match="^scale_fmt: "):
        fp8.quantize(torch.ones(1, 128), bad)
    buf, c, s, k = fp8.allocate(2, 4, 128, 16)
    x, kp, slots = torch.ones(1, 128), torch.ones(1, 16, dtype=torch.bfloat16), torch.tensor([1])
    for call in (lambda: torch.ops.mla.cache_write_fp8(c, k, s, x, kp, slots, bad),
                 lambda: torch.ops.mla.cache_write_fp8_tokens(buf, x, kp, slots, bad)):
        with pytest.raises(ValueError, match="^scale_fmt: "):
            call()
    with FakeTensorMode() as mode:
        fb = mode.from_tensor(buf)
        with pytest.raises(ValueError, match="^scale_fmt: "):
            torch.ops.mla.cache_write_fp8_tokens(fb, mode.from_tensor(x), mode.from_tensor(kp),
                                                 mode.from_tensor(slots), bad)
    with pytest.raises(ValueError, match="^fp8_scale_fmt: "):
        paged.fill_paged([x], [kp], 4, kv_cache_dtype="fp8_e4m3", fp8_scale_fmt=bad)


@pytest.mark.parametrize("P", [16, 0])
def test_cache_write_ops_write_ue8m0_bytes(P):
    g = torch.Generator().manual_seed(7)
    x, kp = torch.randn(5, 256, generator=g) * 5, torch.randn(5, P, generator=g).bfloat16()
    slots = torch.tensor([0, 11, -1, 5, 6])
    q, sc = fp8.quantize(x, UE8M0)
    views_buf, c, s, k = fp8.allocate(3, 4, 256, P)
    torch.ops.mla.cache_write_fp8(c, k, s, x, kp, slots, UE8M0)
    tokens_buf = fp8.allocate(3, 4, 256, P)[0]
    torch.ops.mla.cache_write_fp8_tokens(tokens_buf, x, kp, slots, scale_fmt=UE8M0)
    assert torch.equal(views_buf, tokens_buf)
    flat = views_buf.view(12, -1)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot, :256], q[i].view(torch.uint8))
            assert torch.equal(flat[slot, 256:264].view(torch.float32), sc[i])
    default = fp8.allocate(3, 4, 256, P)[0]
    torch.ops.mla.cache_write_fp8_tokens(default, x, kp, slots)
    assert not torch.equal(default, tokens_buf)  # the argument reaches the write


def test_opcheck_with_scale_fmt():
    g = torch.Generator().manual_seed(8)
    _, c, s, k = fp8.allocate(3, 4, 128, 16, rope_dtype=torch.float32)
    x, kp, slots = torch.randn(4, 128, generator=g), torch.randn(4, 16, generator=g), torch.tensor([0, -1, 5, 11])
    # opcheck's schema check compares float8 tensors with allclose (no CPU kernel): the other checks
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mla.cache_write_fp8.default, (c, k, s, x, kp, slots, UE8M0), test_utils=checks)
    buf = fp8.allocate(3, 4, 128, 16, rope_dtype=torch.float32)[0]
    torch.library.opcheck(torch.ops.mla.cache_write_fp8_tokens.default, (buf, x, kp, slots, UE8M0))


@pytest.mark.parametrize("PS", [1, 16])
def test_decode_over_a_ue8m0_cache_matches_reference(PS):
    g = torch.Generator().manual_seed(9)
    lens, R, P, H = [0, 1, 17, 40], 256, 32, 4
    ckv = [torch.randn(n, R, generator=g).bfloat16() for n in lens]
    kpe = [torch.randn(n, P, generator=g).bfloat16() for n in lens]
    b = paged.fill_paged(ckv, kpe, PS, generator=torch.Generator().manual_seed(1), kv_cache_dtype="fp8_e4m3",
                         fp8_scale_fmt=UE8M0)
    flat = b.ckv_scale[b.ckv_scale == b.ckv_scale]  # written slots (unused ones are NaN)
    assert torch.equal(flat, torch.exp2(torch.log2(flat).round()))
    qn, qp = torch.randn(4, H, R, generator=g).bfloat16(), torch.randn(4, H, P, generator=g).bfloat16()
    out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1, b.ckv_scale)
    r_out, r_lse = ref.ref_decode(qn.double(), qp.double(), ref.ref_dequantize_fp8(b.ckv_cache, b.ckv_scale),
                                  b.kpe_cache.double(), b.block_table, b.seq_lens, 0.1)
    torch.testing.assert_close(out.double(), r_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), r_lse.double(), atol=1e-4, rtol=1e-4)


def test_a_broken_power_of_two_promise_is_caught_by_the_data_checks():
    """Tuning.fp8_scale_fmt "ue8m0" lets auto read with FlashMLA's FP8 kernel, exact only for power-of-two scales; the
    data checks (always on CPU tensors, MLA_COMPILE_CHECK_DATA=1 on CUDA) hold every op reading the cache to it."""
    from mla_compile import tuning

    g = torch.Generator().manual_seed(10)
    lens, R, P = [5, 0, 9], 128, 16
    ckv = [torch.randn(n, R, generator=g) for n in lens]
    kpe = [torch.randn(n, P, generator=g) for n in lens]
    qn, qp = torch.randn(3, 2, R, generator=g), torch.randn(3, 2, P, generator=g)
    idx = torch.tensor([[0, 3, -1], [-1, -1, -1], [7, 8, 2]], dtype=torch.int32)
    with tuning.use(tuning.Tuning(fp8_scale_fmt=UE8M0)):
        for scale_fmt, kept in ((UE8M0, True), (None, False)):
            b = paged.fill_paged(ckv, kpe, 4, kv_cache_dtype="fp8_e4m3", fp8_scale_fmt=scale_fmt)
            calls = (lambda: torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.2,
                                                  b.ckv_scale),
                     lambda: torch.ops.mla.sparse_decode(qn, qp, b.ckv_cache, b.kpe_cache, idx, 0.2, b.ckv_scale))
            for call in calls:
                if kept:
                    call()
                else:
                    with pytest.raises(ValueError, match="^ckv_scale: Tuning.fp8_scale_fmt 'ue8m0' promises"):
                        call()
    b = paged.fill_paged(ckv, kpe, 4, kv_cache_dtype="fp8_e4m3")
    torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.2, b.ckv_scale)  # no promise
