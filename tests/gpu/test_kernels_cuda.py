"""Every op's CUDA path (Triton, and FlashInfer when it imports) against the float64 references, plus
CUDA-graph capture and replay with changed lengths. Skipped without a CUDA device."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

import mla_compile  # noqa: E402,F401  (registers the ops)
import reference as ref  # noqa: E402
from gpu_util import capture, rel as _rel, token_table_rows  # noqa: E402
from mla_compile import paged, tuning  # noqa: E402

DEV = "cuda"


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    # the kernels `auto` picks (dispatch.select_decode_kernel): ours here, since these tests' caches are two
    # separate tensors (FlashMLA only reads one shared buffer in place) and auto never picks FlashInfer
    monkeypatch.delenv("MLA_COMPILE_DECODE_BACKEND", raising=False)
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}




def assert_attention(out, lse, ref_out, ref_lse, dtype):
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in result"
    tol = TOL[dtype]
    assert _rel(out, ref_out) < tol, f"out rel err {_rel(out, ref_out):.2e} >= {tol}"
    empty = ref_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty), "empty rows (and only they) must give lse -inf"
    assert float(out[empty].abs().sum()) == 0, "empty rows must give out 0"
    err = (lse.double() - ref_lse)[~empty].abs().max() if (~empty).any() else torch.tensor(0.0)
    assert float(err) < 10 * tol, f"lse max err {float(err):.2e}"


def make_batch(lens, H, R, P, PS, dtype, seed, max_pages=None):
    g = torch.Generator().manual_seed(seed)
    ckv = [torch.randn(n, R, generator=g).to(dtype).to(DEV) for n in lens]
    kpe = [torch.randn(n, P, generator=g).to(dtype).to(DEV) for n in lens]
    # shuffled pages; every unused slot holds NaN, so reading one poisons the result
    b = paged.fill_paged(ckv, kpe, PS, shuffle=True, spare_pages=3, max_pages=max_pages, generator=g)
    q_nope = torch.randn(len(lens), H, R, generator=g).to(dtype).to(DEV)
    q_pe = torch.randn(len(lens), H, P, generator=g).to(dtype).to(DEV)
    return b, q_nope, q_pe


def assert_replays(graph, out, lse, lens, b, q_nope, q_pe, scale, new_lens):
    """Replay a captured decode (outputs out/lse, lengths read from `lens`) once per lengths list in new_lens;
    each result against the float64 reference."""
    for new in new_lens:
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.ref_decode(q_nope.cpu(), q_pe.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(), b.block_table.cpu(),
                              lens.cpu(), scale)
        assert_attention(out, lse, *want, torch.bfloat16)


def ref_of(b, q_nope, q_pe, scale):
    return ref.ref_decode(q_nope.cpu(), q_pe.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(), b.block_table.cpu(),
                          b.seq_lens.cpu(), scale)


# ------------------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("PS", [1, 16, 64])
@pytest.mark.parametrize("H", [16, 128])
def test_decode(H, PS, dtype):
    lens = [0, 1, 777, 64, 1500, 0, 33]
    b, qn, qp = make_batch(lens, H, 512, 64, PS, dtype, seed=H + PS)
    scale = 192 ** -0.5
    want = ref_of(b, qn, qp, scale)
    out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_attention(out, lse, *want, dtype)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_decode_forced_splits(splits):
    from mla_compile.kernels import decode as K

    b, qn, qp = make_batch([300, 0, 2, 1000], 16, 512, 64, 16, torch.bfloat16, seed=splits)
    want = ref_of(b, qn, qp, 0.1)
    out, lse = K.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1, splits=splits)
    assert_attention(out, lse, *want, torch.bfloat16)


@pytest.mark.parametrize("H,R,P,PS", [(5, 96, 32, 7), (1, 512, 64, 128), (40, 256, 64, 3)])
def test_decode_other_dims_fp32(H, R, P, PS):
    b, qn, qp = make_batch([50, 0, 200], H, R, P, PS, torch.float32, seed=R)
    want = ref_of(b, qn, qp, 0.05)
    out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.05)
    assert_attention(out, lse, *want, torch.float32)


def test_decode_short_lens_large_capacity():
    # the split count follows the table's capacity (128K) while the requests are short: most splits are empty
    b, qn, qp = make_batch([5, 0, 130], 128, 512, 64, 64, torch.bfloat16, seed=11, max_pages=2048)
    want = ref_of(b, qn, qp, 0.07)
    out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.07)
    assert_attention(out, lse, *want, torch.bfloat16)


KERNEL_CONFIGS = {  # name: (H, DecodeConfig fields, page sizes); tma=True configs must be TMA-eligible there
    "h16": (16, dict(block_h=16, block_n=32, num_warps=4, num_stages=3, tma=True), (32, 64, 128)),
    "h128": (128, dict(block_h=64, block_n=32, num_warps=8, num_stages=2, ctas_per_sm=1, tma=True), (32, 64, 128)),
    "ptr-h16": (16, dict(block_h=16, block_n=64, num_warps=4, num_stages=3, max_splits=256), (1, 16, 64)),
    "ptr-h128": (128, dict(block_h=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1), (1, 64)),
    # the Gluon kernels (decode_wgmma.py, decode_seesaw.py): sm_90 only
    "wgmma-h128": (128, dict(block_h=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1, tma=True,
                             kernel="wgmma"), (64, 128)),
    "seesaw-h128": (128, dict(block_h=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1, tma=True,
                              kernel="seesaw"), (64, 128)),
}
CONFIG_PAGES = [(name, ps) for name, (_, _, pages) in sorted(KERNEL_CONFIGS.items()) for ps in pages]


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("which,PS", CONFIG_PAGES)
def test_decode_kernel_config(which, PS, splits):
    # one kernel config forced (TMA: whole tiles by descriptor, tails by masked loads; unused slots hold NaN),
    # lengths on and off tile and page edges, then captured in a CUDA graph and replayed with new lengths
    from mla_compile.kernels import decode as K

    H, kw, _ = KERNEL_CONFIGS[which]
    cfg = K.DecodeConfig(**kw)
    if cfg.kernel != "triton" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    b, qn, qp = make_batch([0, 1, 777, 64, 1500, 0, 33, 256], H, 512, 64, PS, torch.bfloat16, seed=PS)
    assert K.tma_eligible(b.ckv_cache, b.kpe_cache, False, cfg) == cfg.tma
    lens = b.seq_lens.clone()
    run = lambda: K.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, lens, 0.09, cfg=cfg, splits=splits)  # noqa
    assert_attention(*run(), *ref_of(b, qn, qp, 0.09), torch.bfloat16)
    graph, (out, lse) = capture(run)
    # lengths <= the filled ones
    assert_replays(graph, out, lse, lens, b, qn, qp, 0.09, ([0, 1, 700, 63, 1500, 0, 0, 255], [0] * 8))


# ------------------------------------------------------------------------------------------ sparse decode
@pytest.mark.parametrize("H", [16, 128])
def test_sparse_decode(H):
    g = torch.Generator().manual_seed(H)
    b, qn, qp = make_batch([600, 900, 10], H, 512, 64, 64, torch.bfloat16, seed=H)
    from mla_compile.ops.attention import token_slots

    slots = token_slots(b.block_table.cpu(), 64, 900)
    K = 512
    idx = torch.full((3, K), -1, dtype=torch.int32)
    idx[0, :400] = slots[0, torch.randperm(600, generator=g)[:400]].int()
    pick = slots[1, torch.randperm(900, generator=g)[:300]].int()
    idx[1, torch.randperm(K, generator=g)[:300]] = pick  # -1 holes scattered between valid slots
    # row 2: no valid slot -> (0, -inf)
    idx = idx.to(DEV)
    want = ref.ref_sparse_decode(qn.cpu(), qp.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(), idx.cpu(), 0.08)
    out, lse = torch.ops.mla.sparse_decode(qn, qp, b.ckv_cache, b.kpe_cache, idx, 0.08)
    assert_attention(out, lse, *want, torch.bfloat16)


# ------------------------------------------------------------------------------------------------- merge
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_states(dtype):
    g = torch.Generator().manual_seed(1)
    N, B, H, R = 8, 4, 16, 512
    outs = torch.randn(N, B, H, R, generator=g)
    lses = torch.randn(N, B, H, generator=g) * 4
    lses[2, 0, :3] = torch.tensor([-math.inf, math.inf, math.nan])
    outs[2, 0, :3] = math.nan  # a foreign kernel's empty rows: must weigh exactly 0
    lses[:, 1, 5] = -math.inf
    outs[:, 1, 5] = math.nan  # all empty -> (0, -inf)
    outs = outs.to(dtype)
    want = ref.ref_merge(outs, lses)
    out, lse = torch.ops.mla.merge_states(outs.to(DEV), lses.to(DEV))
    assert out.dtype == dtype
    assert_attention(out, lse, *want, dtype)


# ----------------------------------------------------------------------------------------------- cache_write
def test_cache_write_matches_cpu():
    g = torch.Generator().manual_seed(2)
    ckv_c, kpe_c = torch.randn(10, 16, 512, generator=g).bfloat16(), torch.randn(10, 16, 64, generator=g).bfloat16()
    ckv, kpe = torch.randn(40, 512, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    slots = torch.randperm(160, generator=g)[:40]
    slots[::3] = -1
    gc, gk = ckv_c.to(DEV), kpe_c.to(DEV)
    torch.ops.mla.cache_write(ckv_c, kpe_c, ckv, kpe, slots)
    torch.ops.mla.cache_write(gc, gk, ckv.to(DEV), kpe.to(DEV), slots.to(DEV))
    assert torch.equal(gc.cpu(), ckv_c) and torch.equal(gk.cpu(), kpe_c)


# ------------------------------------------------------------------------------------------------------- DSA
def make_index_batch(lens, Hi, Di, PS, seed):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, Di, generator=g).bfloat16().to(DEV) for n in lens]
    b = paged.fill_paged(keys, keys, PS, shuffle=True, spare_pages=2, generator=g)
    q = torch.randn(len(lens), Hi, Di, generator=g).bfloat16().to(DEV)
    w = (torch.randn(len(lens), Hi, generator=g) * Hi ** -0.5).to(DEV)
    return b, q, w


def check_topk(got, q, w, b, topk, scale):
    got = got.cpu()
    for r in range(got.shape[0]):
        slots, scores = ref.ref_indexer_scores(q.cpu(), w.cpu(), b.ckv_cache.cpu(), b.block_table.cpu(),
                                               b.seq_lens.cpu(), scale, r)
        k = min(topk, len(slots))
        picked = got[r, :k].tolist()
        assert got[r, k:].eq(-1).all()
        assert len(set(picked)) == k and set(picked) <= set(slots)
        pos = {s: i for i, s in enumerate(slots)}
        mine = torch.sort(torch.tensor([float(scores[pos[s]]) for s in picked], dtype=torch.float64)).values
        best = torch.sort(torch.sort(scores, descending=True).values[:k]).values
        # bf16 inputs: near-ties may swap, so compare the picked scores, not the slots
        assert torch.allclose(mine, best, atol=2e-2, rtol=1e-2), "picked tokens are not the top-k by score"


@pytest.mark.parametrize("topk", [64, 2048])
@pytest.mark.parametrize("PS", [1, 64])
def test_indexer_topk(topk, PS):
    b, q, w = make_index_batch([3000, 0, 100, 2048], 64, 128, PS, seed=topk + PS)
    scale = 128 ** -0.5
    got = torch.ops.dsa.indexer_topk(q, w, b.ckv_cache, b.block_table, b.seq_lens, topk, scale)
    assert got.shape == (4, topk) and got.dtype == torch.int32
    check_topk(got, q, w, b, topk, scale)


def test_k_only_indices():
    g = torch.Generator().manual_seed(4)
    table, _ = paged.make_block_table([2048, 0, 7, 1000], 64, max_pages=40, generator=g)
    lens = torch.tensor([2048, 0, 7, 1000], dtype=torch.int32)
    got = torch.ops.dsa.k_only_indices(table.to(DEV), lens.to(DEV), 64, 2048)
    assert torch.equal(got.cpu(), ref.ref_k_only(table, lens, 64, 2048))


# ---------------------------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_decode_cuda_graph_replay(backend, monkeypatch):
    # flashinfer plans on the host, so under capture the op must fall back to Triton (and still be right)
    monkeypatch.setenv("MLA_COMPILE_DECODE_BACKEND", backend)
    full = [900, 400, 1200, 64]
    b, qn, qp = make_batch(full, 128, 512, 64, 16, torch.bfloat16, seed=5)
    lens = b.seq_lens.clone()
    graph, (out, lse) = capture(lambda: torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table,
                                                             lens, 0.1))
    assert_replays(graph, out, lse, lens, b, qn, qp, 0.1, ([900, 400, 1200, 64], [0, 1, 700, 64], [17, 0, 0, 3]))


def test_sparse_merge_cache_dsa_cuda_graph_replay():
    b, qn, qp = make_batch([500, 300], 16, 512, 64, 64, torch.bfloat16, seed=6)
    idx = torch.full((2, 256), -1, dtype=torch.int32, device=DEV)
    outs = torch.randn(4, 2, 16, 512, device=DEV)
    lses = torch.randn(4, 2, 16, device=DEV)
    new_c, new_k = torch.randn(3, 512, device=DEV).bfloat16(), torch.randn(3, 64, device=DEV).bfloat16()
    slots = torch.full((3,), -1, dtype=torch.int64, device=DEV)
    kq, kw = torch.randn(2, 64, 512, device=DEV).bfloat16(), torch.randn(2, 64, device=DEV)
    lens = b.seq_lens.clone()

    def step():
        torch.ops.mla.cache_write(b.ckv_cache, b.kpe_cache, new_c, new_k, slots)
        top = torch.ops.dsa.indexer_topk(kq, kw, b.ckv_cache, b.block_table, lens, 128, 0.05)
        konly = torch.ops.dsa.k_only_indices(b.block_table, lens, 64, 512)
        return (torch.ops.mla.sparse_decode(qn, qp, b.ckv_cache, b.kpe_cache, idx, 0.1),
                torch.ops.mla.merge_states(outs, lses), top, konly)

    graph, res = capture(step)
    from mla_compile.ops.attention import token_slots

    tok = token_slots(b.block_table.cpu(), 64, 500)
    for r in range(3):
        g = torch.Generator().manual_seed(r)
        idx.fill_(-1)
        idx[0, :100 * r] = tok[0, torch.randperm(500, generator=g)[:100 * r]].int().to(DEV)
        outs.copy_(torch.randn(4, 2, 16, 512, generator=g))
        lses.copy_(torch.randn(4, 2, 16, generator=g))
        lens.copy_(torch.tensor([400 - 100 * r, 300 - 150 * r], dtype=torch.int32))
        slots.copy_(torch.tensor([int(tok[0, 5 + r]), -1, int(tok[0, 7 + r])]))
        graph.replay()
        torch.cuda.synchronize()
        (so, sl), (mo, ml), top, konly = res
        want_c = b.ckv_cache.cpu().view(-1, 512)[tok[0, 5 + r]]
        assert torch.equal(want_c, new_c.cpu()[0]), "cache_write did not replay with the new slots"
        assert_attention(so, sl, *ref.ref_sparse_decode(qn.cpu(), qp.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(),
                                                        idx.cpu(), 0.1), torch.bfloat16)
        assert_attention(mo, ml, *ref.ref_merge(outs.cpu(), lses.cpu()), torch.float32)
        # the indexer reads the cache as a 512-dim key head: fine for a replay check
        b_idx = paged.PagedBatch(b.ckv_cache, b.kpe_cache, b.block_table, lens)
        check_topk(top, kq, kw, b_idx, 128, 0.05)
        assert torch.equal(konly.cpu(), ref.ref_k_only(b.block_table.cpu(), lens.cpu(), 64, 512))


# ------------------------------------------------------------------------------------------------ FlashInfer
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")
@pytest.mark.parametrize("PS", [1, 64])
@pytest.mark.parametrize("H", [16, 128])
def test_flashinfer_matches_triton(H, PS, monkeypatch):
    from mla_compile.kernels import dispatch, flashinfer_mla

    assert flashinfer_mla.available()
    b, qn, qp = make_batch([0, 1000, 37, 2000], H, 512, 64, PS, torch.bfloat16, seed=H * PS)
    want = ref_of(b, qn, qp, 0.06)
    args = (qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.06)
    monkeypatch.setenv("MLA_COMPILE_DECODE_BACKEND", "flashinfer")
    assert dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache).name == "flashinfer"
    fi = torch.ops.mla.decode(*args)
    monkeypatch.setenv("MLA_COMPILE_DECODE_BACKEND", "triton")
    assert dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache).name == "triton"
    tr = torch.ops.mla.decode(*args)
    assert_attention(*fi, *want, torch.bfloat16)
    assert_attention(*tr, *want, torch.bfloat16)
    monkeypatch.setenv("MLA_COMPILE_DECODE_BACKEND", "auto")
    # never auto's choice: CUDA-graph-tree safe (dispatch.select_decode_kernel)
    assert dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache).name != "flashinfer"


@pytest.mark.parametrize("H", [16, 128])
def test_decode_strided_q_gives_contiguous_out(H):
    # the pass hands q as permuted bmm outputs; out must still be contiguous, as the fake impl promises
    b, qn, qp = make_batch([300, 0, 77], H, 512, 64, 64, torch.bfloat16, seed=H)
    qn_t = qn.transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, R] with strides (R, B*R, 1)
    qp_t = qp.transpose(0, 1).contiguous().transpose(0, 1)
    want = ref_of(b, qn, qp, 0.06)
    out, lse = torch.ops.mla.decode(qn_t, qp_t, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.06)
    assert out.is_contiguous() and lse.is_contiguous()
    assert_attention(out, lse, *want, torch.bfloat16)


# ------------------------------------------------------------------------------------------ fused_linear
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead,K,Ns", [((8, 1), 2048, [1536, 576]), ((1,), 2048, [8192, 8192]), ((16,), 1000, [70]),
                                       ((4,), 64, [48, 16, 33]), ((17,), 256, [64, 32])])  # 17 rows: cuBLAS
def test_fused_linear(lead, K, Ns, dtype):
    g = torch.Generator(device="cuda").manual_seed(K)
    x = torch.randn(*lead, K, device="cuda", generator=g).to(dtype)
    ws = [(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(dtype) for N in Ns]
    ys = torch.ops.mla.fused_linear(x, ws)
    for y, w in zip(ys, ws):
        want = x.double() @ w.double().T
        assert y.dtype == dtype and y.shape == want.shape and y.is_contiguous()
        assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-2


def test_fused_linear_cuda_graph_replay():
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(N, 512, device="cuda", dtype=torch.bfloat16) for N in (96, 40)]
    torch.ops.mla.fused_linear(x, ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = torch.ops.mla.fused_linear(x, ws)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        for y, w in zip(ys, ws):
            want = x.double() @ w.double().T
            assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-2


@pytest.mark.parametrize("sum_in_kernel", [None, False, True])
@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_linear_split_k(split_k, sum_in_kernel):
    """Split K summed by a second launch (False), by each row block's last program with counters of the call's
    own (True), or where scratch counters exist (None: here, on the default stream, the last program) - three
    calls in a row, so a counter not put back to 0 would break the next."""
    from mla_compile.kernels import scratch
    from mla_compile.kernels.linear import LinearConfig, linear_small_m

    g = torch.Generator(device="cuda").manual_seed(split_k)
    ws = [(torch.randn(N, 7168, device="cuda", generator=g) * 0.01).to(torch.bfloat16) for N in (1536, 576)]
    for _ in range(3):
        x = torch.randn(8, 7168, device="cuda", generator=g).to(torch.bfloat16)
        for y, w in zip(linear_small_m(x, ws, LinearConfig(16, 256, 4, 4, split_k), sum_in_kernel=sum_in_kernel), ws):
            want = x.double() @ w.double().T
            assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-2
    torch.cuda.synchronize()
    counters = scratch._buffer(torch.cuda.current_device()).counters
    if sum_in_kernel is None:
        assert counters is not None and not counters.any(), "every counter back at 0 after the launches"


def test_linear_split_k_on_a_side_stream_and_in_graphs():
    """Off the default stream (no scratch counters) the sum is a second launch; captured, both ways replay right
    (the per-call counters of sum_in_kernel=True are a captured memset)."""
    from mla_compile.kernels.linear import linear_small_m

    x = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
    ws = [(torch.randn(N, 7168, device="cuda") * 0.01).to(torch.bfloat16) for N in (1536, 576)]

    def check(ys):
        for y, w in zip(ys, ws):
            want = x.double() @ w.double().T
            assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-2

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ys = linear_small_m(x, ws)
    torch.cuda.current_stream().wait_stream(side)
    check(ys)
    for summed in (None, True):
        linear_small_m(x, ws, sum_in_kernel=summed)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = linear_small_m(x, ws, sum_in_kernel=summed)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            check(ys)


# --------------------------------------------------------------------------------------- linear_partials
@pytest.mark.parametrize("M,K,Ns,splits", [(8, 2048, [1536, 576], 4), (8, 8192, [2048], 4), (1, 300, [70, 9, 33], 4),
                                           (17, 256, [64], 2)])  # 17 rows: the torch definition
def test_linear_partials(M, K, Ns, splits):
    from mla_compile.ops.linear import split_ranges

    g = torch.Generator(device="cuda").manual_seed(K + M)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    ws = [(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16) for N in Ns]
    p = torch.ops.mla.linear_partials(x, ws, splits)
    W = torch.cat(ws).double()
    assert p.dtype == torch.float32 and p.shape == (splits, M, W.shape[0])
    for s, (lo, hi) in enumerate(split_ranges(K, splits)):
        want = x[:, lo:hi].double() @ W[:, lo:hi].T
        if lo == hi:
            assert not p[s].any()
        else:
            assert ((p[s].double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_linear_partials_cuda_graph_replay():
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(N, 1024, device="cuda", dtype=torch.bfloat16) for N in (96, 40)]
    torch.ops.mla.linear_partials(x, ws, 4)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p = torch.ops.mla.linear_partials(x, ws, 4)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        want = x.double() @ torch.cat(ws).double().T
        assert ((p.sum(0).double() - want).abs().max() / want.abs().max()).item() < 1e-5


# --------------------------------------------------------------------------------------- per_head_linear
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H", [(1, 16), (8, 16), (16, 128), (17, 16)])  # 17 rows: the bmm definition
@pytest.mark.parametrize("which", ["W_UV", "W_UK"])
def test_per_head_linear(which, B, H, dtype):
    """MLA's absorbed projections from a kv_b_proj weight [H * 256, 512]: W_UV (K = 512, linear layout) and W_UK
    (a transposed view) on a strided q_nope; float64 reference."""
    g = torch.Generator(device="cuda").manual_seed(B * H)
    w = (torch.randn(H, 256, 512, device="cuda", generator=g) * 0.05).to(dtype)
    if which == "W_UV":
        x, weight = torch.randn(B, H, 512, device="cuda", generator=g).to(dtype), w[:, 128:]
    else:
        q = torch.randn(B, 1, H * 192, device="cuda", generator=g).to(dtype)
        x, weight = q.view(B, H, 192)[:, :, :128], w[:, :128].transpose(1, 2)
    y = torch.ops.mla.per_head_linear(x, weight)
    want = torch.einsum("bhk,hnk->bhn", x.double(), weight.double())
    assert y.shape == want.shape and y.is_contiguous() and y.dtype == dtype
    assert _rel(y, want) < TOL[dtype]


def test_per_head_linear_cuda_graph_replay():
    x = torch.randn(8, 16, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 128, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    graph, y = capture(lambda: torch.ops.mla.per_head_linear(x, w))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(y, torch.einsum("bhk,hnk->bhn", x.double(), w.double())) < 2e-2



# ------------------------------------------------------------------------------------------------ Gluon decode
def gluon_config(b, H, kernel, sparse=False):
    """decode.py's config with the Gluon stage-1 `kernel` forced, after checking dispatch would choose it: as auto
    ("seesaw" on the TMA layout with rope 64, "wgmma" elsewhere) or as asked for."""
    from mla_compile.kernels import dispatch

    qn = torch.empty(1, H, 512, dtype=b.ckv_cache.dtype, device=DEV)
    qp = torch.empty(1, H, b.kpe_cache.shape[-1], dtype=b.ckv_cache.dtype, device=DEV)
    assert dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache, sparse, kernel=kernel).name == kernel
    return dispatch._config(qn, b.ckv_cache, sparse, kernel)


def assert_decodes(b, qn, qp, dtype, splits_list, new_lens, kernel, scale=0.08):
    """The Gluon stage-1 `kernel` at each split count vs the float64 reference; for bf16 also a CUDA graph of the
    policy's split count replayed once per lengths list in new_lens."""
    from mla_compile.kernels import decode as K

    cfg = gluon_config(b, qn.shape[1], kernel)
    want = ref_of(b, qn, qp, scale)
    for splits in splits_list:
        out, lse = K.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, scale, cfg=cfg,
                            splits=splits)
        assert_attention(out, lse, *want, dtype)
    if dtype == torch.bfloat16:
        lens = b.seq_lens.clone()
        graph, (out, lse) = capture(lambda: K.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, lens, scale,
                                                     cfg=cfg))
        assert_replays(graph, out, lse, lens, b, qn, qp, scale, new_lens)


@pytest.mark.parametrize("kernel", ["seesaw", "wgmma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,PS", [(128, 64), (64, 128), (96, 64)])
def test_wgmma_kernel(H, PS, dtype, kernel):
    # the many-head Gluon kernels on the TMA layout (the warp-specialised one, auto's choice here, and the
    # two-warpgroup one): lengths on and off tile edges, odd and even tile counts, several tiles per split (the
    # slots wrap), a partial head block (H=96), forced and policy split counts; unused cache slots hold NaN. Then a
    # CUDA graph replayed with new lengths; and torch.ops.mla.decode runs auto's choice
    from mla_compile.kernels import dispatch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    b, qn, qp = make_batch([0, 1, 63, 64, 65, 777, 4101, 0, 33, 256, 128, 192], H, 512, 64, PS, dtype, seed=H + PS)
    assert dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache).name == "seesaw"
    assert_decodes(b, qn, qp, dtype, (1, 2, 3, 40, None),
                   ([0, 1, 60, 64, 1, 700, 4000, 0, 0, 255, 127, 191], [0, 1, 5, 5, 5, 5, 5, 0, 5, 5, 5, 5]), kernel)
    out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.08)
    assert_attention(out, lse, *ref_of(b, qn, qp, 0.08), dtype)


@pytest.mark.parametrize("kernel", ["seesaw", "wgmma"])
def test_wgmma_kernel_large_logits(kernel):
    # scores far from 0 (q scaled up): the online softmax's running max must keep exp2 in range, and rows whose
    # first tiles hold the largest scores must still weigh later tiles right (in the seesaw kernel the two
    # warpgroups' maxima meet every pair of tiles)
    from mla_compile.kernels import decode as K

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    b, qn, qp = make_batch([2000, 130, 64], 128, 512, 64, 64, torch.bfloat16, seed=5)
    qn, qp = qn * 8, qp * 8
    want = ref_of(b, qn, qp, 0.1)
    out, lse = K.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1,
                        cfg=gluon_config(b, 128, kernel), splits=2)
    assert_attention(out, lse, *want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,PS", [(128, 1), (96, 16)])
def test_wgmma_gather_kernel(H, PS, dtype):
    # pages smaller than a tile: the Gluon gather kernel (16-byte async copies through the table), lengths on and
    # off tile edges, forced and policy splits, then a CUDA graph replayed with new lengths; unused slots hold NaN
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import dispatch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    b, qn, qp = make_batch([0, 1, 63, 64, 65, 777, 2101, 0, 33, 256], H, 512, 64, PS, dtype, seed=H + PS)
    assert not G.tma_layout(b.ckv_cache, b.kpe_cache, False)
    assert dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache).name == "wgmma"  # auto's choice here
    assert_decodes(b, qn, qp, dtype, (1, 3, None),
                   ([0, 1, 60, 64, 1, 700, 2000, 0, 0, 255], [0, 1, 5, 5, 5, 5, 5, 0, 5, 5]), "wgmma")


@pytest.mark.parametrize("splits", [1, 4, None])
def test_wgmma_gather_sparse(splits):
    # mla::sparse_decode at 128 heads on the gather kernel: index lists with -1 holes, a row with none, a list
    # longer than one split's tiles
    from mla_compile.kernels import decode as K
    from mla_compile.kernels import dispatch
    from mla_compile.ops.attention import token_slots

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    g = torch.Generator().manual_seed(7)
    b, qn, qp = make_batch([1500, 900, 10], 128, 512, 64, 64, torch.bfloat16, seed=3)
    slots = token_slots(b.block_table.cpu(), 64, 1500)
    idx = torch.full((3, 1024), -1, dtype=torch.int32)
    idx[0, :1000] = slots[0, torch.randperm(1500, generator=g)[:1000]].int()
    idx[1, torch.randperm(1024, generator=g)[:300]] = slots[1, torch.randperm(900, generator=g)[:300]].int()
    idx = idx.to(DEV)
    assert dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache, sparse=True).name == "wgmma"
    want = ref.ref_sparse_decode(qn.cpu(), qp.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(), idx.cpu(), 0.08)
    cfg = gluon_config(b, 128, "wgmma", sparse=True)
    out, lse = K.sparse_decode(qn, qp, b.ckv_cache, b.kpe_cache, idx, 0.08, cfg=cfg, splits=splits)
    assert_attention(out, lse, *want, torch.bfloat16)
    out, lse = torch.ops.mla.sparse_decode(qn, qp, b.ckv_cache, b.kpe_cache, idx, 0.08)  # auto: the same kernel
    assert_attention(out, lse, *want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,PS", [(16, 64), (1, 128), (12, 64), (32, 64), (40, 128)])
def test_swapab_kernel(H, PS, dtype, monkeypatch):
    # the few-head swap-AB Gluon kernel (tokens as the MMA's M, decode_swapab.py) on the TMA layout: one head, a
    # partial head block (12, 40: blocks of 16 / 32), one and two warpgroups; lengths on and off tile edges, empty
    # requests, several tiles per split (the two slots wrap), forced and policy split counts, unused slots NaN; then
    # a CUDA graph replayed with new lengths; and torch.ops.mla.decode runs it (auto's choice here: its plan is the
    # swap-AB kernel's, which dispatch once sent to the Triton kernels instead)
    from mla_compile.kernels import decode_swapab, dispatch
    from mla_compile.ops import attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    b, qn, qp = make_batch([0, 1, 63, 64, 65, 777, 4101, 0, 33, 256, 128, 192], H, 512, 64, PS, dtype, seed=H + PS)
    assert_decodes(b, qn, qp, dtype, (1, 2, 3, 40, None),
                   ([0, 1, 60, 64, 1, 700, 4000, 0, 0, 255, 127, 191], [0, 1, 5, 5, 5, 5, 5, 0, 5, 5, 5, 5]), "swapab")
    assert dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache, block_table=b.block_table).name == "swapab"
    made, real = [], decode_swapab.stage1_plan
    monkeypatch.setattr(decode_swapab, "stage1_plan", lambda *a, **k: made.append(1) or real(*a, **k))
    attention._DECODE_PLANS.clear()
    out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.08)
    assert made, "the op's plan is not the swap-AB kernel's"
    assert_attention(out, lse, *ref_of(b, qn, qp, 0.08), dtype)


def token_table_batch(lens, H, dtype, kind, seed, spare=64):
    """A page-size-1 cache [N, 1, width] under a token table (`gpu_util.token_table_rows`: "runs", "holes",
    "shuffled"); every row no token uses holds NaN."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    table, rows_of, N = token_table_rows(lens, kind, g, spare)
    B = len(lens)
    ckv = torch.full((N, 1, 512), float("nan"), dtype=dtype)
    kpe = torch.full((N, 1, 64), float("nan"), dtype=dtype)
    for n, rows in zip(lens, rows_of):
        ckv[rows, 0] = torch.randn(n, 512, generator=g).to(dtype)
        kpe[rows, 0] = torch.randn(n, 64, generator=g).to(dtype)
    q_nope = torch.randn(B, H, 512, generator=g).to(dtype).to(DEV)
    q_pe = torch.randn(B, H, 64, generator=g).to(dtype).to(DEV)
    b = SimpleNamespace(ckv_cache=ckv.to(DEV), kpe_cache=kpe.to(DEV), block_table=table.to(DEV),
                        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV))
    return b, q_nope, q_pe


@pytest.mark.parametrize("kind", ["runs", "holes", "shuffled"])
@pytest.mark.parametrize("H,dtype", [(16, torch.bfloat16), (40, torch.bfloat16), (16, torch.float16)])
def test_swapab_kernel_over_a_token_table(H, dtype, kind):
    # swapab's TOKENS form over a page-size-1 token table (the HF pass's; auto's choice at few heads on sm_90 when
    # switched on, MLA_COMPILE_SWAPAB_TOKENS=1): each tile's 64 entries are checked on the device: consecutive rows
    # at any offset are TMA boxes, tiles with a gap or shuffled rows 16-byte row copies; lengths on and off tile
    # edges, empty requests, forced and policy splits; a CUDA graph replayed with new lengths, then with the table
    # rewritten from runs to shuffled rows and back; the op (auto) on the same call
    from mla_compile.kernels import decode_swapab, dispatch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    lens = [0, 1, 63, 64, 65, 777, 2101, 0, 33, 256, 128, 191]
    b, qn, qp = token_table_batch(lens, H, dtype, kind, seed=H + len(kind))
    auto = dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache).name
    assert auto == ("swapab" if tuning.swapab_tokens(decode_swapab.TOKENS_IN_AUTO) else "triton")
    assert_decodes(b, qn, qp, dtype, (1, 2, 3, 40, None),
                   ([0, 1, 60, 64, 1, 700, 2000, 0, 0, 255, 127, 191], [0, 1, 5, 5, 5, 5, 5, 0, 5, 5, 5, 5]), "swapab")
    out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.08)
    assert_attention(out, lse, *ref_of(b, qn, qp, 0.08), dtype)
    if dtype != torch.bfloat16 or H != 16:
        return
    from mla_compile.kernels import decode as K

    cfg = gluon_config(b, H, "swapab")
    table = b.block_table.clone()
    graph, (out, lse) = capture(lambda: K.decode(qn, qp, b.ckv_cache, b.kpe_cache, table, b.seq_lens, 0.08,
                                                 cfg=cfg))
    for other in ("shuffled", "runs", kind):
        o = token_table_batch(lens, H, dtype, other, seed=H + len(kind))  # other rows (and values)
        b.ckv_cache.copy_(o[0].ckv_cache)
        b.kpe_cache.copy_(o[0].kpe_cache)
        table.copy_(o[0].block_table)
        graph.replay()
        torch.cuda.synchronize()
        want = ref.ref_decode(qn.cpu(), qp.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(), table.cpu(), b.seq_lens.cpu(),
                              0.08)
        assert_attention(out, lse, *want, dtype)


def one_buffer(b):
    """The batch's caches copied into the two column ranges of one [NP, PS, R + P] buffer (FlashMLA's K layout; vLLM's
    and SGLang's MLA caches): rows R + P elements apart, the same values, NaN where the batch had NaN."""
    from types import SimpleNamespace

    R = b.ckv_cache.shape[-1]
    buf = torch.cat((b.ckv_cache, b.kpe_cache), dim=-1)
    return SimpleNamespace(ckv_cache=buf[..., :R], kpe_cache=buf[..., R:], block_table=b.block_table,
                           seq_lens=b.seq_lens)


@pytest.mark.parametrize("H,PS,kernel", [(16, 64, "swapab"), (40, 1, "swapab"), (128, 64, "seesaw"),
                                         (128, 64, "wgmma")])
def test_tma_kernels_over_one_buffers_column_ranges(H, PS, kernel):
    # ckv / kpe as the column ranges of one buffer: rows 1152 bytes apart are TMA rows (descriptors at that stride),
    # so auto keeps the TMA kernels (swapab at few heads, page 64 or a token table; seesaw at 128 heads); forced and
    # policy splits, unused slots NaN, a CUDA graph replayed with new lengths
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_swapab, dispatch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    lens = [0, 1, 63, 64, 65, 777, 2101, 0, 33, 256, 128, 191]
    if PS == 1:
        b, qn, qp = token_table_batch(lens, H, torch.bfloat16, "holes", seed=H)
    else:
        b, qn, qp = make_batch(lens, H, 512, 64, PS, torch.bfloat16, seed=H)
    b = one_buffer(b)
    assert b.ckv_cache.stride(-2 if PS > 1 else 0) == 576
    assert G.tma_layout(b.ckv_cache, b.kpe_cache, False) or G.token_rows(b.ckv_cache, b.kpe_cache, False)
    auto = dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache).name
    tokens_off = PS == 1 and not tuning.swapab_tokens(decode_swapab.TOKENS_IN_AUTO)
    assert auto == ("triton" if tokens_off else "seesaw" if H >= 64 else "swapab")
    assert_decodes(b, qn, qp, torch.bfloat16, (1, 3, None),
                   ([0, 1, 60, 64, 1, 700, 2000, 0, 0, 255, 127, 191], [0, 1, 5, 5, 5, 5, 5, 0, 5, 5, 5, 5]), kernel)


def test_swapab_kernel_large_logits():
    # scores far from 0: the running max per head (a column of S^T) must keep exp2 in range across tiles and splits
    from mla_compile.kernels import decode as K

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA: sm_90 only")
    b, qn, qp = make_batch([2000, 130, 64], 16, 512, 64, 64, torch.bfloat16, seed=5)
    qn, qp = qn * 8, qp * 8
    want = ref_of(b, qn, qp, 0.1)
    for splits in (1, 2):
        out, lse = K.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1,
                            cfg=gluon_config(b, 16, "swapab"), splits=splits)
        assert_attention(out, lse, *want, torch.bfloat16)
