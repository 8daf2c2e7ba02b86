"""`torch.library.opcheck` (schema, fake impl, autograd registration, AOT dispatch) for every op.

Shapes: page size 1 and 64, H 1/16/128, R/P 512/64 and small, P = 0 (rope-less MLA), rows with seq_len 0, shuffled block tables
(with garbage in the unused block-table entries), and a transposed (non-contiguous) q_nope as produced by
weight absorption. B and lengths stay small: opcheck runs every op several times per call.
"""

from __future__ import annotations

import pytest
import torch

import mla_compile  # noqa: F401
import reference as ref

# (page_size, H, R, P, lens)
SHAPES = [
    (1, 1, 16, 8, [3, 0]),
    (64, 16, 512, 64, [70, 0, 5]),
    (64, 128, 512, 64, [0, 9]),
    (1, 16, 8, 4, [0, 0]),
    (3, 2, 5, 3, [7, 1, 0, 4]),
    (4, 3, 8, 0, [6, 0, 2]),  # rope-less MLA: q_pe [B, H, 0], kpe_cache [NP, PS, 0]
]
IDS = [f"ps{s[0]}-H{s[1]}-R{s[2]}-P{s[3]}-lens{'_'.join(map(str, s[4]))}" for s in SHAPES]


def opcheck(op, args):
    torch.library.opcheck(op, args)


def paged(lens, PS, R, P, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    _, (c, k), bt, sl, _ = ref.build_paged(lens, PS, (R, P), dtype, generator=g, shuffle=True, extra_cols=1)
    return g, c, k, bt, sl


@pytest.mark.parametrize("transposed_q", [False, True])
@pytest.mark.parametrize("PS,H,R,P,lens", SHAPES, ids=IDS)
def test_opcheck_decode(PS, H, R, P, lens, transposed_q):
    g, c, k, bt, sl = paged(lens, PS, R, P)
    B = len(lens)
    q_nope = torch.randn(H, B, R, generator=g).transpose(0, 1) if transposed_q else torch.randn(B, H, R, generator=g)
    q_pe = torch.randn(B, H, P, generator=g)
    opcheck(torch.ops.mla.decode.default, (q_nope, q_pe, c, k, bt, sl, (R + P) ** -0.5))


@pytest.mark.parametrize("PS,H,R,P,lens", SHAPES, ids=IDS)
def test_opcheck_sparse_decode(PS, H, R, P, lens):
    g, c, k, bt, sl = paged(lens, PS, R, P, seed=1)
    B = len(lens)
    K = 6
    rows = []
    for b in range(B):
        s = ref.request_slots(bt, PS, b, int(sl[b]))[:K]
        rows.append((s + [-1] * K)[:K][::-1])  # valid slots out of order, -1 first
    idx = torch.tensor(rows, dtype=torch.int32)
    q_nope, q_pe = torch.randn(B, H, R, generator=g), torch.randn(B, H, P, generator=g)
    opcheck(torch.ops.mla.sparse_decode.default, (q_nope, q_pe, c, k, idx, 0.1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,B,H,R", [(1, 2, 1, 512), (2, 1, 16, 512), (3, 2, 128, 8), (8, 1, 2, 4)])
def test_opcheck_merge_states(N, B, H, R, dtype):
    g = torch.Generator().manual_seed(N)
    outs = torch.randn(N, B, H, R, generator=g).to(dtype)
    lses = torch.randn(N, B, H, generator=g)
    lses[0, 0, 0] = float("-inf")  # an empty part
    if N > 1:
        lses[1, 0, 0] = float("nan")
        outs[1, 0, 0] = float("nan")
    opcheck(torch.ops.mla.merge_states.default, (outs, lses))


def requiring_grad(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


# autograd variants: float inputs require grad, so opcheck also checks the autograd registration and AOT
# dispatch of the backward (eager vs traced gradients); float64 is the ops' reference precision
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("PS,H,R,P,lens", [SHAPES[0], SHAPES[4], SHAPES[5], (64, 16, 32, 8, [70, 0])], ids=str)
def test_opcheck_decode_autograd(PS, H, R, P, lens, dtype):
    g, c, k, bt, sl = paged(lens, PS, R, P, dtype=dtype, seed=5)
    B = len(lens)
    q_nope = torch.randn(H, B, R, generator=g, dtype=dtype).transpose(0, 1)
    q_pe = torch.randn(B, H, P, generator=g, dtype=dtype)
    opcheck(torch.ops.mla.decode.default, (*requiring_grad(q_nope, q_pe, c, k), bt, sl, (R + P) ** -0.5))


@pytest.mark.parametrize("P", [3, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_sparse_decode_autograd(dtype, P):
    g, c, k, bt, sl = paged([7, 1, 0, 4], 3, 5, P, dtype=dtype, seed=6)
    s0 = ref.request_slots(bt, 3, 0, 7)
    idx = torch.tensor([[s0[6], -1, s0[0], s0[0]], [ref.request_slots(bt, 3, 1, 1)[0], -1, -1, -1], [-1] * 4,
                        ref.request_slots(bt, 3, 3, 4)], dtype=torch.int32)
    q_nope, q_pe = torch.randn(4, 2, 5, generator=g, dtype=dtype), torch.randn(4, 2, P, generator=g, dtype=dtype)
    opcheck(torch.ops.mla.sparse_decode.default, (*requiring_grad(q_nope, q_pe, c, k), idx, 0.3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_opcheck_merge_states_autograd(dtype):
    g = torch.Generator().manual_seed(7)
    outs = torch.randn(3, 2, 4, 8, generator=g).to(dtype)
    lses = torch.randn(3, 2, 4, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    lses[0, 0, 0] = float("-inf")
    lses[1, 1, 2] = float("nan")
    lses[:, 1, 3] = float("-inf")
    opcheck(torch.ops.mla.merge_states.default, tuple(requiring_grad(outs, lses)))


@pytest.mark.parametrize("PS,R,P,T", [(1, 16, 8, 5), (64, 512, 64, 7), (3, 5, 3, 0), (2, 8, 0, 5)])
def test_opcheck_cache_write(PS, R, P, T):
    g = torch.Generator().manual_seed(PS)
    NP = 3 + T  # enough slots for T distinct targets
    c, k = torch.zeros(NP, PS, R), torch.zeros(NP, PS, P)
    slots = torch.randperm(NP * PS, generator=g)[:T]
    if T:
        slots[0] = -1
    opcheck(torch.ops.mla.cache_write.default,
            (c, k, torch.randn(T, R, generator=g), torch.randn(T, P, generator=g), slots))


@pytest.mark.parametrize("PS,Hi,Di,topk,lens", [(1, 1, 16, 4, [9, 0]), (64, 64, 128, 32, [70, 0, 3]),
                                                 (64, 4, 8, 2048, [5]), (3, 2, 5, 1, [0, 0, 4])])
def test_opcheck_indexer_topk(PS, Hi, Di, topk, lens):
    g = torch.Generator().manual_seed(PS + topk)
    _, (kc,), bt, sl, _ = ref.build_paged(lens, PS, (Di,), generator=g, shuffle=True, extra_cols=1)
    B = len(lens)
    q, w = torch.randn(B, Hi, Di, generator=g), torch.randn(B, Hi, generator=g)
    opcheck(torch.ops.dsa.indexer_topk.default, (q, w, kc, bt, sl, topk, Di ** -0.5))


@pytest.mark.parametrize("PS,Hi,Di,topk,lens,n,r", [(1, 1, 16, 4, [9, 0], 2, 1), (64, 4, 8, 32, [70, 0, 3], 4, 3),
                                                     (3, 2, 5, 1, [0, 0, 4], 1, 0)])
def test_opcheck_dcp_local_candidates(PS, Hi, Di, topk, lens, n, r):
    g = torch.Generator().manual_seed(PS + topk)
    _, (kc,), bt, sl, _ = ref.build_paged(lens, PS, (Di,), generator=g, shuffle=True, extra_cols=1)
    B = len(lens)
    q, w = torch.randn(B, Hi, Di, generator=g), torch.randn(B, Hi, generator=g)
    opcheck(torch.ops.dsa.dcp_local_candidates.default, (q, w, kc, bt, sl, topk, Di ** -0.5, n, r))


@pytest.mark.parametrize("PS,topk,lens", [(1, 4, [4, 0]), (64, 2048, [100, 0, 2048]), (3, 9, [0, 0, 9]),
                                          (64, 1, [1])])
def test_opcheck_k_only_indices(PS, topk, lens):
    g = torch.Generator().manual_seed(PS + topk)
    _, _, bt, sl, _ = ref.build_paged(lens, PS, (1,), generator=g, shuffle=True, extra_cols=1)
    opcheck(torch.ops.dsa.k_only_indices.default, (bt, sl, PS, topk))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_low_precision_decode_and_sparse(dtype):
    g, c, k, bt, sl = paged([70, 0], 64, 512, 64, dtype=dtype, seed=3)
    q_nope, q_pe = torch.randn(2, 16, 512, generator=g).to(dtype), torch.randn(2, 16, 64, generator=g).to(dtype)
    opcheck(torch.ops.mla.decode.default, (q_nope, q_pe, c, k, bt, sl, 576 ** -0.5))
    idx = torch.tensor([ref.request_slots(bt, 64, 0, 5), [-1] * 5], dtype=torch.int32)
    opcheck(torch.ops.mla.sparse_decode.default, (q_nope, q_pe, c, k, idx, 576 ** -0.5))


def test_opcheck_merge_states_non_contiguous_parts():
    """Parts gathered as [B, N, ...] and viewed as [N, B, ...]: outputs are contiguous in fake and real impls."""
    outs = torch.randn(3, 2, 4, 16).transpose(0, 1)
    lses = torch.randn(3, 2, 4).transpose(0, 1)
    opcheck(torch.ops.mla.merge_states.default, (outs, lses))


@pytest.mark.parametrize("lead,K,Ns", [((8,), 64, [32, 8]), ((2, 1), 16, [5]), ((3, 1), 24, [7, 9, 4]), ((0,), 8, [3, 2])])
def test_opcheck_fused_linear(lead, K, Ns):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(*lead, K, generator=g)
    opcheck(torch.ops.mla.fused_linear.default, (x, [torch.randn(N, K, generator=g) for N in Ns]))


def test_fused_linear_gradients_match_linear():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 10, generator=g, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(n, 10, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 6)]
    torch.autograd.gradcheck(lambda x, a, b: torch.ops.mla.fused_linear(x, [a, b]), (x, *ws))
    ys = torch.ops.mla.fused_linear(x, ws)
    (ys[0].sum() * 2 + ys[1].pow(2).sum()).backward()
    got = [x.grad.clone()] + [w.grad.clone() for w in ws]
    for t in (x, *ws):
        t.grad = None
    (torch.nn.functional.linear(x, ws[0]).sum() * 2 + torch.nn.functional.linear(x, ws[1]).pow(2).sum()).backward()
    for a, b in zip(got, [x.grad] + [w.grad for w in ws]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("M,K,Ns,splits", [(8, 300, [32, 8], 4), (2, 16, [5], 1), (3, 260, [7, 9, 4], 3), (0, 8, [3], 2),
                                           (4, 0, [3], 2)])
def test_opcheck_linear_partials(M, K, Ns, splits):
    g = torch.Generator().manual_seed(K + splits)
    x = torch.randn(M, K, generator=g)
    opcheck(torch.ops.mla.linear_partials.default, (x, [torch.randn(N, K, generator=g) for N in Ns], splits))


def test_linear_partials_gradients_match_linear():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 300, generator=g, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(n, 300, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 6)]
    torch.autograd.gradcheck(lambda x, a, b: torch.ops.mla.linear_partials(x, [a, b], 3), (x, *ws))


@pytest.mark.parametrize("B,H,K,N", [(8, 4, 128, 32), (1, 3, 70, 9), (0, 2, 8, 3), (2, 2, 0, 3)])
def test_opcheck_per_head_linear(B, H, K, N):
    g = torch.Generator().manual_seed(B + H + K)
    x = torch.randn(B, H, K, generator=g)
    opcheck(torch.ops.mla.per_head_linear.default, (x, torch.randn(H, N, K, generator=g)))
    wt = torch.randn(H, K, N, generator=g).transpose(1, 2)  # W_UK's layout: a transposed view
    opcheck(torch.ops.mla.per_head_linear.default, (x, wt))


def test_per_head_linear_gradients():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 10, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, 10, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, w: torch.ops.mla.per_head_linear(x, w), (x, w))

