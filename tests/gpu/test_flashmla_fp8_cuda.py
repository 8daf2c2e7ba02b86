"""FlashMLA's FP8 kernel over our FP8 cache (`mla_compile.kernels.flashmla_fp8`, asked for with
decode_kernel="flashmla") on an SM90 GPU: that FlashMLA reads our 656-byte token as DeepSeek-V3.2's (over a cache
written with power-of-two scales, `scale_fmt="ue8m0"`, its bf16 dequantization is exact, so any layout mismatch
would show against the float64 reference), index lists with -1 and empty rows, paged calls through the op (each
request's slots written on the device), several query tokens, CUDA-graph replay with changed lengths; with amax / 448
scales its error is a bf16 cache's, not fp32 accumulation's. Skipped unless `flash_mla` imports on SM90."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from gpu_util import capture, rel
from mla_compile import fp8, tuning
from mla_compile.kernels import flashmla as FM
from mla_compile.kernels import flashmla_fp8 as FM8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not FM.available(), reason="needs flash_mla on an SM90 GPU")]

DEV = "cuda"
R, P, PS = 512, 64, 64
SCALE = 192 ** -0.5
LSE_TOL = 1e-3  # fp32 accumulation of bf16 products, as tests/gpu/test_flashmla_cuda.py
OUT_TOL = 2e-2


def fp8_cache(pages, page_size, g, pow2=True):
    """(ckv, scale, kpe) FP8 views of one buffer on the GPU, random tokens written by mla.cache_write_fp8 (the
    Triton write); pow2: with scale_fmt "ue8m0" (DeepSeek's power-of-two scales, FlashMLA's tests)."""
    _, c, s, k = fp8.allocate(pages, page_size, R, P, device=DEV)
    n = pages * page_size
    x = torch.randn(n, R, generator=g) * torch.rand(n, 1, generator=g) * 4
    torch.ops.mla.cache_write_fp8(c, k, s, x.to(DEV), torch.randn(n, P, generator=g).to(DEV, torch.bfloat16),
                                  torch.arange(n, device=DEV), fp8.UE8M0 if pow2 else None)
    if pow2:
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    return c, s, k


def latent(c, s):
    """The cache's latent values in float64 on the host (the exact dequantization)."""
    return fp8.dequantize(c.reshape(-1, R).cpu(), s.reshape(-1, R // 128).cpu(), torch.float64).view(*c.shape[:2], R)


def check(out, lse, want_out, want_lse, lse_tol=LSE_TOL):
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()
    assert not out.isnan().any() and not lse.isnan().any() and not (lse == math.inf).any()
    empty = want_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty) and float(out[empty].abs().sum()) == 0
    if (~empty).any():
        assert rel(out[~empty], want_out[~empty]) < OUT_TOL
        assert float((lse.double() - want_lse)[~empty].abs().max()) < lse_tol


def queries(g, *lead):
    return (torch.randn(*lead, R, generator=g).to(DEV, torch.bfloat16),
            torch.randn(*lead, P, generator=g).to(DEV, torch.bfloat16))


def sparse_case(H, pow2, seed):
    """(out, lse, float64 reference over the exact dequantized cache) of one FlashMLA sparse call."""
    g = torch.Generator().manual_seed(seed)
    c, s, k = fp8_cache(40, PS, g, pow2)
    B, K = 6, 2048
    idx = torch.stack([torch.randperm(40 * PS, generator=g)[:K] for _ in range(B)]).int()
    idx[1] = -1  # a request without a valid index
    idx[2, 100:] = -1
    idx[3, ::3] = -1
    idx, (qn, qp) = idx.to(DEV), queries(g, B, H)
    out, lse = FM8.sparse_decode(qn, qp, c, k, idx, s, SCALE)
    want = ref.ref_sparse_decode(qn.cpu().double(), qp.cpu().double(), latent(c, s), k.cpu().double(), idx.cpu(),
                                 SCALE)
    return out, lse, want


@pytest.mark.parametrize("H", [64, 128])
def test_sparse_decode_matches_float64(H):
    """Power-of-two scales: FlashMLA's bf16 dequantization is exact, so our token layout is V3.2's byte for byte."""
    out, lse, want = sparse_case(H, True, H)
    check(out, lse, *want)


def test_amax_scales_err_like_a_bf16_cache():
    """amax / 448 scales (our default): FlashMLA's result is off the exact dequantization by a bf16 cache's rounding
    (lse 0.04-0.09 at scores ~20, H100 2026-12-06; the float32 scale and the products rounded), far above fp32
    accumulation: why the op takes FlashMLA's FP8 kernel only for caches written with power-of-two scales."""
    out, lse, (want_out, want_lse) = sparse_case(64, False, 3)
    check(out, lse, want_out, want_lse, lse_tol=0.2)
    live = want_lse > -math.inf
    assert float((lse.cpu().double() - want_lse)[live].abs().max()) > 10 * LSE_TOL


LENS = [0, 1, 63, 64, 65, 1000, 4097, 0]


def paged(H, g, pow2=True, page_size=PS):
    pages = sum(-(-n // page_size) for n in LENS) + 16
    c, s, k = fp8_cache(pages, page_size, g, pow2)
    cols = max(-(-n // page_size) for n in LENS) + 1
    table = torch.full((len(LENS), cols), 1 << 30, dtype=torch.int32)  # entries past a request's pages: garbage
    perm = torch.randperm(pages, generator=g)
    at = 0
    for b, n in enumerate(LENS):
        m = -(-n // page_size)
        table[b, :m] = perm[at:at + m].int()
        at += m
    return c, s, k, table.to(DEV), torch.tensor(LENS, dtype=torch.int32, device=DEV), queries(g, len(LENS), H)


@pytest.mark.parametrize("page_size", [PS, 1])
@pytest.mark.parametrize("H", [64, 128])
def test_paged_decode_through_the_op(H, page_size):
    g = torch.Generator().manual_seed(5 + H)
    c, s, k, table, lens, (qn, qp) = paged(H, g, page_size=page_size)
    with tuning.use(tuning.Tuning(decode_kernel="flashmla")):
        from mla_compile.kernels import dispatch

        assert dispatch.decode_kernel(qn, qp, c, k, block_table=table, ckv_scale=s).name == "flashmla"
        out, lse = torch.ops.mla.decode(qn, qp, c, k, table, lens, SCALE, s)
    want = ref.ref_decode(qn.cpu().double(), qp.cpu().double(), latent(c, s), k.cpu().double(), table.cpu(),
                          lens.cpu(), SCALE)
    check(out, lse, *want)


def test_sparse_decode_several_query_tokens_through_the_op():
    g = torch.Generator().manual_seed(9)
    c, s, k = fp8_cache(20, PS, g)
    B, S, H, K = 3, 2, 128, 300
    idx = torch.randint(-1, 20 * PS, (B, S, K), generator=g, dtype=torch.int32).to(DEV)
    qn, qp = queries(g, B, S, H)
    with tuning.use(tuning.Tuning(decode_kernel="flashmla")):
        out, lse = torch.ops.mla.sparse_decode(qn, qp, c, k, idx, SCALE, s)
    assert out.shape == (B, S, H, R) and lse.shape == (B, S, H)
    want = ref.ref_sparse_decode(qn.view(B * S, H, R).cpu().double(), qp.view(B * S, H, P).cpu().double(),
                                 latent(c, s), k.cpu().double(), idx.view(B * S, K).cpu(), SCALE)
    check(out.view(B * S, H, R), lse.view(B * S, H), *want)


def test_cuda_graph_replay_with_changed_lengths():
    # FlashMLA's schedule and our index list are made inside the call from the lengths on the device
    g = torch.Generator().manual_seed(13)
    c, s, k, table, lens, (qn, qp) = paged(128, g)
    graph, (out, lse) = capture(lambda: FM8.decode(qn, qp, c, k, table, lens, s, SCALE))
    for new in ([0, 5, 64, 1, 100, 1000, 3000, 0], [0] * 8, LENS):  # within each request's pages (LENS's)
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.ref_decode(qn.cpu().double(), qp.cpu().double(), latent(c, s), k.cpu().double(),
                              table.cpu(), lens.cpu(), SCALE)
        check(out, lse, *want)


def test_other_shapes_fall_back_saying_why():
    g = torch.Generator().manual_seed(17)
    c, s, k = fp8_cache(4, PS, g, False)
    qn, qp = queries(g, 2, 16)
    ok, why = FM8.supported(qn, qp, c, k, s)
    assert not ok and "heads" in why
    from mla_compile.kernels import dispatch

    choice = dispatch.decode_kernel(qn, qp, c, k, ckv_scale=s, kernel="flashmla")
    assert choice.name != "flashmla" and "asked for flashmla, which cannot serve this call" in choice.reason


@pytest.mark.parametrize("page_size", [PS, 1])
def test_auto_takes_it_over_promised_power_of_two_scales(page_size):
    """Tuning.fp8_scale_fmt "ue8m0" over a cache written with those scales: auto runs FlashMLA's FP8 kernel at 128
    heads (page size 1: the HF pass's token table), exact against float64, also replayed as a CUDA graph."""
    from mla_compile.kernels import dispatch

    g = torch.Generator().manual_seed(21 + page_size)
    c, s, k, table, lens, (qn, qp) = paged(128, g, page_size=page_size)
    with tuning.use(tuning.Tuning(fp8_scale_fmt="ue8m0")):
        assert dispatch.decode_kernel(qn, qp, c, k, block_table=table, ckv_scale=s).name == "flashmla"
        graph, (out, lse) = capture(lambda: torch.ops.mla.decode(qn, qp, c, k, table, lens, SCALE, s))
    graph.replay()
    torch.cuda.synchronize()
    want = ref.ref_decode(qn.cpu().double(), qp.cpu().double(), latent(c, s), k.cpu().double(), table.cpu(),
                          lens.cpu(), SCALE)
    check(out, lse, *want)
