"""S >= 1 query tokens per request on the GPU: `mla::decode` / `mla::sparse_decode` CUDA impls (S folded into the
rows: the Gluon kernels from 32 rows on an H200, else the Triton pointer kernel, each checked) and the DSA
selection ops with S > 1, against the float64 references of tests/reference.py; shuffled pages with NaN in every unused slot,
ragged lengths with empty requests and lengths exactly S; one CUDA-graph capture replayed with new lengths.

Run: python -m pytest -q tests/gpu/test_multi_token_cuda.py
"""

from __future__ import annotations

import pytest
import torch

import reference as ref
from gpu_util import capture, rel

import mla_compile  # noqa: F401  (registers torch.ops.mla: this file may run alone)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
R, P = 512, 64
SCALE = 192 ** -0.5
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # out: relative norm error vs float64
LSE_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # lse: absolute


def build(lens, S, H, dtype, PS, seed):
    g = torch.Generator().manual_seed(seed)
    _, (c, k), bt, sl, _ = ref.build_paged(lens, PS, (R, P), dtype, generator=g, shuffle=True, extra_cols=1)
    B = len(lens)
    qn = torch.randn(B, S, H, R, generator=g).to(dtype)
    qp = torch.randn(B, S, H, P, generator=g).to(dtype)
    return [t.to(DEV) for t in (qn, qp, c, k, bt, sl)]


def check(out, lse, want, dtype, shape):
    ref_out, ref_lse = want
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == shape[:-1] and lse.dtype == torch.float32
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "empty rows differ"
    assert (out[empty] == 0).all(), "empty rows must be exactly 0"
    assert rel(out[~empty], ref_out[~empty]) < TOL[dtype]
    assert float((lse[~empty].double() - ref_lse[~empty]).abs().max()) < LSE_TOL[dtype]


LENS = [0, 4, 63, 64, 65, 1000, 4097, 3]  # on and off page / tile edges, an empty request, lengths near S


@pytest.mark.parametrize("PS", [1, 64])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_matches_reference(dtype, S, H, PS):
    lens = [n if n == 0 else max(n, S) for n in LENS]
    qn, qp, c, k, bt, sl = build(lens, S, H, dtype, PS, seed=S * 10 + H + PS)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, SCALE)
    want = ref.ref_decode_multi(qn.cpu(), qp.cpu(), c.cpu(), k.cpu(), bt.cpu(), sl.cpu(), SCALE)
    check(out, lse, want, dtype, qn.shape)


@pytest.mark.parametrize("kernel", ["auto", "wgmma", "triton"])
@pytest.mark.parametrize("PS", [16, 64])
@pytest.mark.parametrize("H,S", [(16, 2), (16, 4), (24, 3), (8, 8), (128, 2)])
def test_both_multi_token_kernels_match_reference(H, S, PS, kernel):
    """Rows = S x H: auto takes the Gluon kernels from 32 rows (page 64: decode_wgmma's TMA kernel for one head block,
    the seesaw for more; page 16: decode_wgmma's gather kernel), with a head block holding rows of several query
    tokens (H 24 x S 3: 72 rows, a block boundary inside token 2); decode_wgmma and the pointer kernel asked for
    serve the same calls."""
    from mla_compile import tuning

    lens = [0, S, 63, 64, 65, 2000, 4097]
    qn, qp, c, k, bt, sl = build(lens, S, H, torch.bfloat16, PS, seed=H * S + PS)
    with tuning.use(tuning.Tuning(decode_kernel=kernel)):
        out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, SCALE)
    want = ref.ref_decode_multi(qn.cpu(), qp.cpu(), c.cpu(), k.cpu(), bt.cpu(), sl.cpu(), SCALE)
    check(out, lse, want, torch.bfloat16, qn.shape)


@pytest.mark.parametrize("H", [16, 128])
def test_decode_limits_table_and_strided_q(H):
    """A [B, S] limits table (DCP's per-rank counts) and q as absorption hands it over ([H, B, S, R] permuted)."""
    S, dtype = 3, torch.bfloat16
    qn, qp, c, k, bt, sl = build([300, 0, 70], S, H, dtype, 64, seed=H)
    qn = qn.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    assert not qn.is_contiguous()
    lim = torch.tensor([[0, 150, 300], [0, 0, 0], [1, 64, 65]], dtype=torch.int32, device=DEV)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, lim, SCALE)
    want = ref.ref_decode_multi(qn.cpu(), qp.cpu(), c.cpu(), k.cpu(), bt.cpu(), lim.cpu(), SCALE)
    check(out, lse, want, dtype, qn.shape)


def _padded(t):
    """t's values as a view whose rows are padded (last dim stride-1, rows 16 elements apart): folding [B, S, H] into
    rows stays a view of it, so the plan reads it as it is (ops/attention.py `_folded_plan`)."""
    out = torch.full((*t.shape[:-1], t.shape[-1] + 16), float("nan"), dtype=t.dtype, device=t.device)
    out[..., :t.shape[-1]] = t
    return out[..., :t.shape[-1]]


@pytest.mark.parametrize("H", [16, 128])
def test_decode_and_sparse_decode_read_padded_q_as_it_is(H):
    """q [B, S, H, *] whose token-to-row fold is a view but not contiguous (padded rows, NaN in the padding): decode
    (causal lengths and a limits table) and sparse_decode of S tokens read it by its strides, outputs in q's shape;
    the same values as a copy (heads first: no view folds them) give the same answer."""
    S, dtype = 2, torch.bfloat16
    qn, qp, c, k, bt, sl = build([300, 0, 70], S, H, dtype, 64, seed=3 + H)
    pn, pp = _padded(qn), _padded(qp)
    want = ref.ref_decode_multi(qn.cpu(), qp.cpu(), c.cpu(), k.cpu(), bt.cpu(), sl.cpu(), SCALE)
    for _ in range(2):  # the plan made, then found as a recent signature
        out, lse = torch.ops.mla.decode(pn, pp, c, k, bt, sl, SCALE)
        check(out, lse, want, dtype, qn.shape)
    hn = qn.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, R] with heads before tokens in memory
    out, lse = torch.ops.mla.decode(hn, qp, c, k, bt, sl, SCALE)
    check(out, lse, want, dtype, qn.shape)
    idx = torch.ops.dsa.k_only_indices(bt, sl.clamp(max=256), 64, 256, S)
    want = ref.ref_sparse_decode_multi(qn.cpu(), qp.cpu(), c.cpu(), k.cpu(), idx.cpu(), SCALE)
    for q_nope, q_pe in ((pn, pp), (qn.transpose(0, 1).contiguous().transpose(0, 1), qp)):
        out, lse = torch.ops.mla.sparse_decode(q_nope, q_pe, c, k, idx, SCALE)
        check(out, lse, want, dtype, qn.shape)


@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("H", [16, 128])
def test_sparse_decode_with_k_only_and_indexer_selection(S, H):
    """DSA with S query tokens: each token's k-only and indexer top-k slots through sparse_decode, vs float64."""
    dtype, PS, topk = torch.bfloat16, 64, 256
    lens = [0, S, 200, 900]
    qn, qp, c, k, bt, sl = build(lens, S, H, dtype, PS, seed=S + H)
    idx = torch.ops.dsa.k_only_indices(bt, sl.clamp(max=topk), PS, topk, S)
    g = torch.Generator().manual_seed(S)
    kc = torch.randn(c.shape[0], PS, 128, generator=g).to(dtype).to(DEV)
    top = torch.ops.dsa.indexer_topk(torch.randn(len(lens), S, 4, 128, generator=g).to(dtype).to(DEV),
                                     torch.randn(len(lens), S, 4, generator=g).to(DEV), kc, bt, sl, topk, 0.1)
    assert idx.shape == top.shape == (len(lens), S, topk)
    for indices in (idx, top):
        out, lse = torch.ops.mla.sparse_decode(qn, qp, c, k, indices, SCALE)
        want = ref.ref_sparse_decode_multi(qn.cpu(), qp.cpu(), c.cpu(), k.cpu(), indices.cpu(), SCALE)
        check(out, lse, want, dtype, qn.shape)
    # each query token's k-only list is its causal prefix (CPU op as the reference)
    assert torch.equal(idx.cpu(), torch.ops.dsa.k_only_indices(bt.cpu(), sl.clamp(max=topk).cpu(), PS, topk, S))


def test_dsa_indexer_of_query_tokens_in_any_layout_equals_the_cpu_op():
    """dsa.indexer_topk of S tokens on the GPU (the kernels' query rows, kernels/dsa.py `_row_tokens`) equals the CPU
    op exactly on small-integer data (every score exact, ties by the one rule): q / weights contiguous, with padded
    rows (read as they are) and tokens before requests (copied per call); a table the radix select takes and one past
    RADIX_MAX_TOKENS (torch.topk + the slots kernel)."""
    S, PS, topk, Hi, Di = 3, 16, 24, 4, 16
    g = torch.Generator().manual_seed(9)
    for longest in (60, 17000):
        _, (kc,), bt, sl, _ = ref.build_paged([0, 3, 40, longest], PS, (Di,), torch.float32, generator=g,
                                              shuffle=True)
        kc = torch.randint(-1, 2, kc.shape, generator=g).float()
        q = torch.randint(-1, 2, (4, S, Hi, Di), generator=g).float()
        w = torch.randint(-2, 3, (4, S, Hi), generator=g).float()
        want = torch.ops.dsa.indexer_topk(q, w, kc, bt, sl, topk, 0.5)
        qd, wd, rest = q.to(DEV), w.to(DEV), (kc.to(DEV), bt.to(DEV), sl.to(DEV), topk, 0.5)
        tokens_first = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (qd, wd)]
        for qq, ww in ((qd, wd), (_padded(qd), _padded(wd)), tokens_first):
            for _ in range(2):  # the plan made, then found as a recent signature
                got = torch.ops.dsa.indexer_topk(qq, ww, *rest)
                assert torch.equal(got.cpu(), want), (longest, qq.stride())


def test_dsa_indexer_per_query_token_matches_cpu_op():
    """The CUDA indexer with S = 3 picks, per query token, slots whose CPU-op scores are that token's top scores."""
    S, PS, topk, Hi, Di = 3, 64, 64, 4, 128
    g = torch.Generator().manual_seed(5)
    _, (kc,), bt, sl, _ = ref.build_paged([0, 3, 100, 700], PS, (Di,), torch.float32, generator=g, shuffle=True)
    q, w = torch.randn(4, S, Hi, Di, generator=g), torch.randn(4, S, Hi, generator=g)
    got = torch.ops.dsa.indexer_topk(q.to(DEV), w.to(DEV), kc.to(DEV), bt.to(DEV), sl.to(DEV), topk, 0.1).cpu()
    for j in range(S):
        lens_j = (sl - S + 1 + j).clamp(min=0).to(torch.int32)
        for b in range(4):
            by_slot, top = ref.ref_topk_scores(q[:, j], w[:, j], kc, bt, lens_j, 0.1, topk, b)
            n = min(topk, int(lens_j[b]))
            row = got[b, j].tolist()
            assert all(s == -1 for s in row[n:]) and len(set(row[:n])) == n
            scores = sorted((by_slot[s] for s in row[:n]), reverse=True)
            scale = max([abs(v) for v in by_slot.values()] + [1e-6])
            assert max([abs(a - r) for a, r in zip(scores, top)] + [0.0]) <= 1e-4 * scale


@pytest.mark.parametrize("H", [16, 128])
def test_cuda_graph_replay_with_new_lengths(H):
    """One captured S = 4 decode, replayed after the lengths grow by S (a verification step's next call)."""
    S, dtype = 4, torch.bfloat16
    lens = [0, 4, 500, 1500]
    qn, qp, c, k, bt, sl = build([n + 2 * S for n in lens], S, H, dtype, 64, seed=H + 1)
    sl.copy_(torch.tensor(lens, dtype=torch.int32))
    graph, (out, lse) = capture(lambda: torch.ops.mla.decode(qn, qp, c, k, bt, sl, SCALE))
    for step in range(2):
        sl.copy_(torch.tensor([n + step * S if n else 0 for n in lens], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.ref_decode_multi(qn.cpu(), qp.cpu(), c.cpu(), k.cpu(), bt.cpu(), sl.cpu(), SCALE)
        check(out, lse, want, dtype, qn.shape)


def test_kernel_choice_for_several_query_tokens():
    """S > 1 from 32 rows takes a Gluon kernel on an H200 (a limit per row; FlashMLA takes one query token per
    request), fewer rows the pointer kernel."""
    from mla_compile.kernels import dispatch

    gluon = torch.cuda.get_device_capability() == (9, 0) and dispatch._wgmma.fits(R, P)
    qn, qp, c, k, bt, sl = build([100], 2, 128, torch.bfloat16, 64, seed=0)
    folded, folded_pe = qn.reshape(1, 256, R), qp.reshape(1, 256, P)  # what mla::decode hands over for S = 2
    assert dispatch.decode_kernel(folded, folded_pe, c, k, n_query=2).name in (("seesaw", "wgmma") if gluon else
                                                                               ("triton",))
    assert dispatch.decode_kernel(folded[:, :16], folded_pe[:, :16], c, k, n_query=2).name == "triton"
