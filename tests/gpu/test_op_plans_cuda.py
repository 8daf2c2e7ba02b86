"""ops/_plans.py on the GPU: `mla.decode` / `mla.sparse_decode` keep one plan per call signature and replay its
launches on later calls; every replay must be the op's answer for the new tensors (float64 references), and any
change the plan depends on (alignment, the kernel asked for, shapes) must make a new plan, never reuse a stale one.
Skipped without a CUDA device."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

import mla_compile  # noqa: E402,F401  (registers the ops)
import reference as ref  # noqa: E402
from gpu_util import capture  # noqa: E402
from mla_compile import tuning  # noqa: E402
from mla_compile.ops import attention  # noqa: E402
from test_kernels_cuda import assert_attention, make_batch, ref_of  # noqa: E402

DT = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    monkeypatch.delenv(tuning.DECODE_KERNEL_ENV, raising=False)
    attention._DECODE_PLANS.clear()
    attention._SPARSE_PLANS.clear()
    yield
    attention._DECODE_PLANS.clear()
    attention._SPARSE_PLANS.clear()


def _plans(which=attention._DECODE_PLANS) -> int:
    return len(which._plans)


@pytest.mark.parametrize("H", [16, 128])
def test_one_plan_per_signature_replays_with_new_tensors(H):
    """Three batches of one signature (new caches, queries and lengths each time): one plan, three correct answers;
    on the GPU the second and third calls take the plan's bound launches (no key, no choice)."""
    # the same pages per request in another order: caches and block tables of one shape, other data and lengths
    lens_list = ([700, 0, 64, 1], [1, 700, 0, 64], [64, 1, 690, 0])
    keyed = []
    real = attention._DECODE_PLANS.lookup
    attention._DECODE_PLANS.lookup = lambda *a: keyed.append(1) or real(*a)
    try:
        for seed, lens in enumerate(lens_list):
            b, qn, qp = make_batch(lens, H, 512, 64, 64, DT, seed=seed, max_pages=20)
            out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
            assert_attention(out, lse, *ref_of(b, qn, qp, 0.1), DT)
    finally:
        del attention._DECODE_PLANS.lookup
    # the later calls found the plan by the C++ check of the recent signature, not by the key
    assert _plans() == 1 and len(attention._DECODE_PLANS._recent) == 1 and len(keyed) == 1


def test_a_misaligned_view_gets_its_own_plan():
    """Triton specializes on 16-byte alignment: q at an odd element offset (same shape and strides) must not replay
    the aligned call's kernel."""
    b, qn, qp = make_batch([300, 40], 16, 512, 64, 64, DT, seed=1)
    want = ref_of(b, qn, qp, 0.2)
    assert_attention(*torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.2),
                     *want, DT)
    buf = torch.empty(qn.numel() + 1, dtype=DT, device="cuda")
    odd = buf[1:].view(qn.shape)
    odd.copy_(qn)
    assert odd.stride() == qn.stride() and odd.data_ptr() % 16 != 0
    assert_attention(*torch.ops.mla.decode(odd, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.2),
                     *want, DT)
    assert _plans() == 2


def test_the_kernel_asked_for_makes_a_new_plan(monkeypatch):
    """The decode backend switch (environment and tuning) is part of the key: the same tensors, another kernel."""
    from mla_compile.kernels import dispatch

    b, qn, qp = make_batch([500, 64, 0], 128, 512, 64, 64, DT, seed=2)
    want = ref_of(b, qn, qp, 0.1)
    made = []
    real = dispatch.decode_plan
    monkeypatch.setattr(dispatch, "decode_plan",
                        lambda *a, **k: made.append(dispatch.decode_kernel(*a[:4], block_table=a[4]).name)
                        or real(*a, **k))
    call = (qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
    assert_attention(*torch.ops.mla.decode(*call), *want, DT)
    monkeypatch.setenv(tuning.DECODE_KERNEL_ENV, "triton")
    assert_attention(*torch.ops.mla.decode(*call), *want, DT)
    monkeypatch.delenv(tuning.DECODE_KERNEL_ENV)
    with tuning.use(tuning.Tuning(decode_kernel="triton")):
        assert_attention(*torch.ops.mla.decode(*call), *want, DT)
    assert_attention(*torch.ops.mla.decode(*call), *want, DT)  # back to auto: its plan again
    assert made[1:] == ["triton", "triton"] and _plans() == 3


def test_bad_input_still_raises_after_a_plan():
    """A plan skips the check only for its own signature: a call of another (bad) signature is checked."""
    b, qn, qp = make_batch([10], 16, 512, 64, 64, DT, seed=3)
    torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens.long(), 0.1)
    with pytest.raises(ValueError, match="sm_scale"):
        torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, float("nan"))


def test_planned_call_captures_in_a_cuda_graph():
    """A plan made eagerly, then replayed inside a CUDA-graph capture: the graph's replays follow new lengths."""
    b, qn, qp = make_batch([900, 30, 0, 64], 16, 512, 64, 64, DT, seed=4)
    torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
    lens = b.seq_lens.clone()
    graph, (out, lse) = capture(lambda: torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, lens,
                                                             0.1))
    for new in ([10, 30, 3, 0], [900, 1, 0, 64]):  # within each request's pages (the rest hold NaN)
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.ref_decode(qn.cpu(), qp.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(), b.block_table.cpu(),
                              lens.cpu(), 0.1)
        assert_attention(out, lse, *want, DT)
    assert _plans() == 1


@pytest.mark.parametrize("H", [16, 128])
def test_sparse_decode_plans(H):
    """H 16: the Triton pointer kernel; H 128: the Gluon gather kernel, its launch bound in the plan too."""
    b, qn, qp = make_batch([400, 200], H, 512, 64, 64, DT, seed=5)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        idx = torch.full((2, 64), -1, dtype=torch.int32)
        for r, n in enumerate((400, 200)):
            slots = ref.request_slots(b.block_table.cpu(), 64, r, n)
            pick = torch.randperm(n, generator=g)[:50]
            idx[r, :50] = torch.tensor([slots[int(i)] for i in pick], dtype=torch.int32)
        want = ref.ref_sparse_decode(qn.cpu(), qp.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(), idx, 0.1)
        got = torch.ops.mla.sparse_decode(qn, qp, b.ckv_cache, b.kpe_cache, idx.cuda(), 0.1)
        assert_attention(*got, *want, DT)
    assert _plans(attention._SPARSE_PLANS) == 1


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _fresh(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, dtype=DT: (torch.randn(*shape, generator=g) / shape[-1] ** 0.25).to(dtype).cuda()


def _merge(rnd):
    outs, lses = rnd(3, 2, 16, 512, dtype=torch.float32), rnd(3, 2, 16, dtype=torch.float32)
    w = torch.softmax(lses.double(), 0)
    return torch.ops.mla.merge_states(outs, lses), ((w[..., None] * outs.double()).sum(0),
                                                     torch.logsumexp(lses.double(), 0))


def _fused(rnd, K):
    x, wa, wb = rnd(3, K), rnd(1536, K), rnd(576, K)
    return torch.ops.mla.fused_linear(x, [wa, wb]), [x.double() @ wa.double().T, x.double() @ wb.double().T]


def _partials(rnd):
    x, wa, wb = rnd(2, 2048), rnd(256, 2048), rnd(64, 2048)
    got = torch.ops.mla.linear_partials(x, [wa, wb], 4)
    return (got.sum(0),), (x.double() @ torch.cat([wa, wb]).double().T,)


def _per_head(rnd):
    x, w = rnd(4, 16, 128), rnd(16, 512, 128)
    return (torch.ops.mla.per_head_linear(x, w),), (torch.einsum("bhk,hnk->bhn", x.double(), w.double()),)


def _experts(rnd):
    x, w = rnd(5, 256), rnd(8, 128, 256)
    ids = torch.randint(0, 8, (5,)).cuda()
    return (torch.ops.mla.expert_linear(x, w, ids),), (torch.einsum("soi,si->so", w[ids].double(), x.double()),)


def _cache_write(rnd):
    ckv_cache, kpe_cache = torch.zeros(4, 16, 512, dtype=DT).cuda(), torch.zeros(4, 16, 64, dtype=DT).cuda()
    ckv, kpe, slots = rnd(3, 512), rnd(3, 64), torch.randperm(64)[:3].cuda()
    torch.ops.mla.cache_write(ckv_cache, kpe_cache, ckv, kpe, slots)
    return (ckv_cache.view(64, 512)[slots], kpe_cache.view(64, 64)[slots]), (ckv, kpe)


@pytest.mark.parametrize("op", ["merge_states", "fused_linear_split_k", "fused_linear_one_pass", "linear_partials",
                                "per_head_linear", "expert_linear", "cache_write"])
def test_every_planned_op_replays_with_new_tensors(op):
    """Every op with plans, called three times with new tensors of one signature: each answer is the float64 one
    for those tensors (a plan that kept a tensor or a stale argument of its first call would fail here)."""
    make = {"merge_states": _merge, "fused_linear_split_k": lambda r: _fused(r, 2048),
            "fused_linear_one_pass": lambda r: _fused(r, 256), "linear_partials": _partials,
            "per_head_linear": _per_head, "expert_linear": _experts, "cache_write": _cache_write}[op]
    for seed in range(3):
        got, want = make(_fresh(seed))
        for g, w in zip(got, want):
            assert _rel(g, w) < (1e-5 if g.dtype == torch.float32 else 1e-2), (op, seed)


def test_split_partials_reuse_the_default_stream_scratch_and_not_a_side_stream(monkeypatch):
    """kernels/scratch.py: on the default stream a split decode's partials are the thread's scratch buffer (reused
    call after call, answers still each call's own); on a side stream fresh buffers, answers equally right."""
    import threading

    from mla_compile.kernels import scratch

    monkeypatch.setattr(scratch, "_local", threading.local())
    buffer = scratch._buffer(torch.cuda.current_device())
    for seed in range(2):
        b, qn, qp = make_batch([3000, 5, 2000], 16, 512, 64, 64, DT, seed=10 + seed, max_pages=60)
        assert_attention(*torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1),
                         *ref_of(b, qn, qp, 0.1), DT)
    assert buffer.data is not None and buffer.generation == 1  # made once, reused by the second call
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b, qn, qp = make_batch([2500, 700, 64], 16, 512, 64, 64, DT, seed=12, max_pages=60)
        out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
    torch.cuda.current_stream().wait_stream(side)
    assert_attention(out, lse, *ref_of(b, qn, qp, 0.1), DT)
    assert buffer.generation == 1


def test_output_templates_are_made_on_the_default_stream_only(monkeypatch):
    """`scratch.empty_maker` makes its one-element template outside any CUDA-graph pool: on the legacy default stream.
    On a side stream (where cudagraph trees warm up and record) it allocates with torch.empty instead and keeps no
    tensor; either way the outputs are fresh, row-major and on the device."""
    from mla_compile.kernels import scratch

    monkeypatch.setattr(scratch, "_SCALARS", {})
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fresh = scratch.empty_maker((4, 16), torch.float16, torch.device("cuda"))
        out = fresh()
    assert scratch._SCALARS == {} and out.shape == (4, 16) and out.is_cuda and out.is_contiguous()
    fresh = scratch.empty_maker((4, 16), torch.float16, torch.device("cuda"))
    a, b = fresh(), fresh()
    assert len(scratch._SCALARS) == 1 and a.data_ptr() != b.data_ptr() and a.stride() == (16, 1) and a.is_cuda
