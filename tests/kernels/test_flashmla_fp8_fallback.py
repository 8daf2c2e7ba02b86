"""FlashMLA's FP8 kernel as a backend (`mla_compile.kernels.flashmla_fp8`) on a machine without it (CI): what it
takes (`one_buffer`, `supported`), the kernel choice (asked for only, never auto), and the adapter's plumbing (the
V3.2 byte view of our cache, q concatenation, index lists for paged calls, topk_length, the (0, -inf) fix-up of
empty rows, several query tokens) against a stand-in for `flash_mla` that follows FlashMLA's documented sparse FP8
decode contract (kv_format "V32": the token's bytes decoded as e4m3 values, float32 scales and bf16 rope, value x
scale rounded to bf16 as its kernel does; empty rows lse +inf, output unwritten), checked against the float64
reference over the dequantized cache (tests/reference.py). The GPU test (tests/gpu/test_flashmla_fp8_cuda.py)
holds the real kernel to the same reference."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from flashmla_stand_in import StandIn
from mla_compile import fp8, tuning
from mla_compile.kernels import dispatch as D_
from mla_compile.kernels import flashmla as FM
from mla_compile.kernels import flashmla_fp8 as FM8

R, P = 512, 64
SCALE = 0.07


def fp8_cache(pages, PS, g, pow2=False):
    """(ckv, scale, kpe) views of one FP8 buffer holding random tokens; pow2: DeepSeek's power-of-two scales."""
    _, c, s, k = fp8.allocate(pages, PS, R, P)
    x = torch.randn(pages * PS, R, generator=g) * torch.rand(pages * PS, 1, generator=g) * 4
    torch.ops.mla.cache_write_fp8(c, k, s, x, torch.randn(pages * PS, P, generator=g).to(k.dtype),
                                  torch.arange(pages * PS))
    if pow2:  # rescale each group to a power-of-two scale (values re-quantized: still our format)
        v = fp8.dequantize(c.view(-1, R), s.view(-1, R // 128))
        amax = v.view(-1, R // 128, 128).abs().amax(-1).clamp_min(1e-4) / 448
        p2 = torch.exp2(torch.ceil(torch.log2(amax)))
        c.view(-1, R).copy_((v.view(-1, R // 128, 128) / p2[..., None]).view(-1, R).to(fp8.DTYPE))
        s.view(-1, R // 128).copy_(p2)
    return c, s, k


def dequantized(c, s, as_flashmla=False):
    """The cache's latent values in float64; as_flashmla: rounded to bf16 first, as FlashMLA's kernel does."""
    v = fp8.dequantize(c.reshape(-1, R), s.reshape(-1, R // 128), torch.float64).view(*c.shape[:2], R)
    return v.to(torch.bfloat16).double() if as_flashmla else v


class FakeFlashMLA(StandIn):
    """`flash_mla.flash_mla_with_kvcache`'s sparse FP8 path (use_legacy=True, kv_format "V32") as its interface and C++
    checks define it: q [B, s_q, H, 576] bf16, k_cache [NB, PS, 1, 656] e4m3 bytes with token stride 656, indices
    [B, s_q, K] int32 (-1 invalid), topk_length [B] -> out [B, s_q, H, 512] bf16, lse float32 [B, H, s_q] (natural
    log). Each token dequantized to bf16 (value x scale rounded), the attention in float64."""

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                               topk_length=None, use_legacy=False, kv_format=None):
        assert use_legacy and is_fp8_kvcache and not causal and kv_format == "V32" and head_dim_v == 512
        self.fill(tile_scheduler_metadata)
        B, S, H, D = q.shape
        assert q.dtype == torch.bfloat16 and D == 576 and q.stride(-1) == 1 and H in (64, 128)
        NB, PS, one, W = k_cache.shape
        assert one == 1 and W == 656 and k_cache.stride(1) == 656 and k_cache.stride(-1) == 1
        assert k_cache.dtype == torch.float8_e4m3fn
        assert indices.dtype == torch.int32 and indices.shape[:2] == (B, S) and indices.stride(-1) == 1
        assert indices.shape[-1] % 64 == 0, "index lists of whole 64-entry blocks (vLLM asserts it too)"
        assert topk_length is None, "V3.2 does not support dynamic topk length"  # its kernel's assert (H100 run)
        self.calls.append(dict(S=S, K=indices.shape[-1], topk_length=topk_length is not None))
        out = torch.full((B, S, H, head_dim_v), math.nan, dtype=q.dtype)
        lse = torch.full((B, H, S), math.inf, dtype=torch.float32)
        for b in range(B):
            for j in range(S):
                idx = indices[b, j, :None if topk_length is None else int(topk_length[b])]
                idx = [int(i) for i in idx if int(i) != -1]
                if not idx:
                    continue
                rows = torch.stack([k_cache[i // PS, i % PS, 0].view(torch.uint8) for i in idx])
                vals = rows[:, :512].view(torch.float8_e4m3fn).float()
                scales = rows[:, 512:528].contiguous().view(torch.float32)
                kv = (vals.view(-1, 4, 128) * scales[..., None]).view(-1, 512).to(torch.bfloat16)
                kv = torch.cat((kv, rows[:, 528:].contiguous().view(torch.bfloat16)), -1).double()
                s = softmax_scale * (q[b, j].double() @ kv.T)
                lse[b, :, j] = torch.logsumexp(s, -1).float()
                out[b, j] = (torch.softmax(s, -1) @ kv[:, :512]).to(q.dtype)
        return out, lse


@pytest.fixture
def fake(monkeypatch):
    f = FakeFlashMLA()
    monkeypatch.setattr(FM, "_flash_mla", lambda: f)
    monkeypatch.setattr(FM, "available", lambda: True)  # the CPU stands in for an SM90 GPU
    monkeypatch.setattr(FM8, "_on_sm90", lambda t: True)
    return f


def test_one_buffer_is_the_views_of_one_allocation():
    _, c, s, k = fp8.allocate(3, 64, R, P)
    assert FM8.one_buffer(c, k, s)
    assert FM8.one_buffer(c[1:], k[1:], s[1:])  # a slice of pages: the same packed tokens
    _, c1, s1, k1 = fp8.allocate(5, 1, R, P)  # page size 1: the HF pass's token-table cache
    assert FM8.one_buffer(c1, k1, s1)
    assert not FM8.one_buffer(c, k, None)
    assert not FM8.one_buffer(c.clone(), k, s)  # two allocations
    assert not FM8.one_buffer(c[1:], k[:-1], s[:-1])  # same buffer, different pages
    assert not FM8.one_buffer(c, k.float(), s)  # rope kept in float32: not V3.2's token
    _, c2, s2, k2 = fp8.allocate(3, 64, 256, P)  # R 256: a 336-byte token
    assert not FM8.one_buffer(c2, k2, s2)
    # what the HF pass hands mla.decode (benchmarks/lab/hf_call_args.py): read_views of a [B, max_len, 656] buffer
    # reshaped to [N, 1, width]; the size-1 token dimension's strides are the reshape's (512 / 64 / 4 elements)
    buf = fp8.allocate(2, 40, R, P)[0]
    hc, hs, hk = (t.reshape(80, 1, t.shape[-1]) for t in fp8.read_views(buf, R))
    assert hc.stride() == (656, 512, 1) and FM8.one_buffer(hc, hk, hs)
    assert FM8._kv(hc).stride() == (656, 656, 656, 1)
    other = fp8.read_views(fp8.allocate(2, 40, R, P)[0], R)[2].reshape(80, 1, P)
    assert not FM8.one_buffer(hc, other, hs)  # rope of another buffer
    one = fp8.allocate(1, 40, R, P)  # one page: its page stride unused
    assert FM8.one_buffer(one[1], one[3], one[2]) and FM8._kv(one[1]).stride() == (40 * 656, 656, 656, 1)


def test_without_flash_mla_it_refuses_with_a_reason():
    if FM.available():
        pytest.skip("flash_mla is usable here")
    _, c, s, k = fp8.allocate(2, 64, R, P)
    q, qp = torch.randn(1, 128, R, dtype=torch.bfloat16), torch.randn(1, 128, P, dtype=torch.bfloat16)
    ok, why = FM8.supported(q, qp, c, k, s)
    assert not ok and "flash_mla" in why
    with pytest.raises(ValueError, match="flash_mla"):
        FM8.sparse_decode(q, qp, c, k, torch.zeros(1, 4, dtype=torch.int32), s, SCALE)


@pytest.mark.parametrize("H,why", [(16, "heads"), (96, "heads")])
def test_supported_says_why(fake, H, why):
    _, c, s, k = fp8.allocate(2, 64, R, P)
    q, qp = torch.randn(1, H, R, dtype=torch.bfloat16), torch.randn(1, H, P, dtype=torch.bfloat16)
    ok, msg = FM8.supported(q, qp, c, k, s)
    assert not ok and why in msg
    q64, qp64 = torch.randn(1, 64, R, dtype=torch.bfloat16), torch.randn(1, 64, P, dtype=torch.bfloat16)
    ok, msg = FM8.supported(q64.half(), qp64.half(), c, k, s)
    assert not ok and "bf16" in msg
    assert FM8.supported(q64, qp64, c, k, s) == (True, "")
    ok, msg = FM8.supported(q64, qp64, c.clone(), k, s)
    assert not ok and "656" in msg


def _queries(g, *lead):
    bf16 = torch.bfloat16
    return torch.randn(*lead, R, generator=g).to(bf16), torch.randn(*lead, P, generator=g).to(bf16)


@pytest.mark.parametrize("pow2", [False, True])
def test_sparse_decode_matches_the_reference(fake, pow2):
    g = torch.Generator().manual_seed(1)
    c, s, k = fp8_cache(6, 16, g, pow2)
    qn, qp = _queries(g, 3, 64)
    idx = torch.full((3, 40), -1, dtype=torch.int32)
    idx[0, :40] = torch.randperm(96, generator=g)[:40].int()
    idx[2, 5:12] = torch.tensor([3, 90, 17, 44, 60, 61, 2], dtype=torch.int32)  # row 1: no valid index
    out, lse = FM8.sparse_decode(qn, qp, c, k, idx, s, SCALE)
    assert fake.calls == [dict(S=1, K=64, topk_length=False)]  # padded with -1 to a whole block
    want_out, want_lse = ref.ref_sparse_decode(qn.double(), qp.double(), dequantized(c, s, as_flashmla=True),
                                               k.double(), idx, SCALE)
    assert out.shape == (3, 64, R) and out.dtype == torch.bfloat16 and lse.shape == (3, 64)
    assert out.is_contiguous() and lse.is_contiguous()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == -math.inf).all())
    live = [0, 2]
    assert float((lse[live].double() - want_lse[live]).abs().max()) < 1e-5
    assert ref.rel_err(out[live].double(), want_out[live]) < 1e-2  # bf16 output
    # against the exact dequantized cache: power-of-two scales (DeepSeek's) make FlashMLA's bf16 dequantization
    # exact; ours (amax / 448) are rounded like a bf16 cache of the values
    exact_lse = ref.ref_sparse_decode(qn.double(), qp.double(), dequantized(c, s), k.double(), idx, SCALE)[1]
    assert float((lse[live].double() - exact_lse[live]).abs().max()) < (1e-5 if pow2 else 0.1)


def test_paged_decode_hands_flashmla_each_requests_slots(fake):
    g = torch.Generator().manual_seed(2)
    lens = [70, 0, 1, 128]
    PS = 64
    _, _, table, seq_lens, pages = ref.build_paged(lens, PS, (R, P), generator=g, extra_cols=1)
    c, s, k = fp8_cache(pages, PS, g)
    qn, qp = _queries(g, 4, 128)
    slots = FM8.token_slots(table, seq_lens, PS)
    K = -(-table.shape[1] * PS // 64) * 64
    assert slots.shape == (4, 1, K)
    for b, n in enumerate(lens):
        assert slots[b, 0, :n].tolist() == ref.request_slots(table, PS, b, n)
        assert bool((slots[b, 0, n:] == -1).all())
    out, lse = FM8.decode(qn, qp, c, k, table, seq_lens, s, SCALE)
    assert fake.calls == [dict(S=1, K=K, topk_length=False)]
    want_out, want_lse = ref.ref_decode(qn.double(), qp.double(), dequantized(c, s, as_flashmla=True), k.double(),
                                        table, seq_lens, SCALE)
    empty = seq_lens == 0
    assert torch.equal(lse == -math.inf, want_lse == -math.inf) and not out[empty].any()
    assert float((lse[~empty].double() - want_lse[~empty]).abs().max()) < 1e-5
    assert ref.rel_err(out[~empty].double(), want_out[~empty]) < 1e-2


def test_no_pages_or_no_indices_mean_all_empty(fake):
    _, c, s, k = fp8.allocate(2, 64, R, P)
    qn, qp = _queries(torch.Generator().manual_seed(3), 2, 64)
    for out, lse in (FM8.sparse_decode(qn, qp, c, k, torch.zeros(2, 0, dtype=torch.int32), s, SCALE),
                     FM8.decode(qn, qp, c, k, torch.zeros(2, 0, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                s, SCALE)):
        assert not out.any() and bool((lse == -math.inf).all()) and out.shape == (2, 64, R)
    assert fake.calls == []


def test_dispatch_runs_it_asked_for_only(fake, monkeypatch):
    # auto keeps our own FP8 kernels (FlashMLA's numerics are a bf16 cache's); "flashmla" asked for runs it, for the
    # paged op and the sparse one, several query tokens of a sparse call as FlashMLA's s_q
    monkeypatch.setattr(D_, "_capability", lambda device: (9, 0))
    g = torch.Generator().manual_seed(4)
    c, s, k = fp8_cache(4, 64, g)
    qn, qp = _queries(g, 2, 128)
    table, lens = torch.arange(4, dtype=torch.int32).view(2, 2), torch.tensor([100, 7], dtype=torch.int32)
    assert D_.decode_kernel(qn, qp, c, k, ckv_scale=s, kernel="auto").name != "flashmla"
    assert D_.decode_kernel(qn, qp, c, k, ckv_scale=s, kernel="flashmla").name == "flashmla"
    assert D_.decode_kernel(qn[:, :16], qp[:, :16], c, k, ckv_scale=s, kernel="flashmla").name != "flashmla"
    monkeypatch.setenv("MLA_COMPILE_DECODE_BACKEND", "flashmla")
    plan, keep = D_.decode_plan(qn, qp, c, k, table, lens, SCALE, ckv_scale=s)
    out, lse = plan(qn, qp, c, k, table, lens, s)
    assert keep and fake.calls[-1] == dict(S=1, K=128, topk_length=False)
    want = ref.ref_decode(qn.double(), qp.double(), dequantized(c, s, True), k.double(), table, lens, SCALE)
    assert ref.rel_err(out.double(), want[0]) < 1e-2
    idx = torch.randint(-1, 256, (2, 3, 50), generator=g, dtype=torch.int32)
    qn3, qp3 = _queries(g, 2, 3, 128)
    plan, keep = D_.sparse_decode_plan(qn3.view(6, 128, R), qp3.view(6, 128, P), c, k, idx.view(6, 50), SCALE,
                                       ckv_scale=s, outer=qn3.shape)
    out, lse = plan(qn3, qp3, c, k, idx, None, s)
    assert keep and fake.calls[-1] == dict(S=3, K=64, topk_length=False)
    assert out.shape == (2, 3, 128, R) and lse.shape == (2, 3, 128) and lse.is_contiguous()
    want = ref.ref_sparse_decode(qn3.view(6, 128, R).double(), qp3.view(6, 128, P).double(),
                                 dequantized(c, s, True), k.double(), idx.view(6, 50), SCALE)
    assert ref.rel_err(out.view(6, 128, R).double(), want[0]) < 1e-2
    assert float((lse.view(6, 128).double() - want[1]).abs().max()) < 1e-5


def test_auto_takes_it_at_128_heads_over_promised_power_of_two_scales(fake, monkeypatch):
    """Tuning.fp8_scale_fmt "ue8m0" (the caches hold power-of-two scales, FlashMLA-exact): auto takes FlashMLA's FP8
    kernel at 128 heads, keeps ours at 64 (within 3% there) and without the promise; an asked-for kernel stays."""
    monkeypatch.setattr(D_, "_capability", lambda device: (9, 0))
    g = torch.Generator().manual_seed(6)
    c, s, k = fp8_cache(4, 64, g)
    qn, qp = _queries(g, 2, 128)
    promised = tuning.Tuning(fp8_scale_fmt="ue8m0")
    with tuning.use(promised):
        choice = D_.decode_kernel(qn, qp, c, k, ckv_scale=s)
        assert choice.name == "flashmla" and "power-of-two" in choice.reason
        assert D_.decode_kernel(qn, qp, c, k, ckv_scale=s, sparse=True).name == "flashmla"
        assert D_.decode_kernel(qn[:, :64], qp[:, :64], c, k, ckv_scale=s).name != "flashmla"
        assert D_.decode_kernel(qn, qp, c, k, ckv_scale=s, kernel="triton").name == "triton"
        table, lens = torch.arange(4, dtype=torch.int32).view(2, 2), torch.tensor([100, 7], dtype=torch.int32)
        with tuning.use(tuning.DEFAULT):  # the CPU impl (the definition); under the promise its data check would
            out, lse = torch.ops.mla.decode(qn, qp, c, k, table, lens, SCALE, s)  # refuse these amax scales
        plan, keep = D_.decode_plan(qn, qp, c, k, table, lens, SCALE, ckv_scale=s)
        got, got_lse = plan(qn, qp, c, k, table, lens, s)
        assert keep and fake.calls[-1]["S"] == 1
        assert ref.rel_err(got.double(), out.double()) < 1e-2
    assert D_.decode_kernel(qn, qp, c, k, ckv_scale=s).name != "flashmla"  # no promise: ours
    monkeypatch.setattr(FM, "available", lambda: False)  # promised, but FlashMLA absent: ours, no error
    with tuning.use(promised):
        assert D_.decode_kernel(qn, qp, c, k, ckv_scale=s).name != "flashmla"
    with pytest.raises(ValueError, match="^fp8_scale_fmt: "):
        tuning.Tuning(fp8_scale_fmt="e8m0")
