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
    lens_list = ([700, 0, 64, 1], [5, 900, 0, 300], [1024, 1024, 3, 77])
    for seed, lens in enumerate(lens_list):
        b, qn, qp = make_batch(lens, H, 512, 64, 64, DT, seed=seed, max_pages=20)
        out, lse = torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
        assert_attention(out, lse, *ref_of(b, qn, qp, 0.1), DT)
    assert _plans() == 1


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
    for new in ([10, 500, 3, 0], [900, 30, 0, 64]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.ref_decode(qn.cpu(), qp.cpu(), b.ckv_cache.cpu(), b.kpe_cache.cpu(), b.block_table.cpu(),
                              lens.cpu(), 0.1)
        assert_attention(out, lse, *want, DT)
    assert _plans() == 1


def test_sparse_decode_plans():
    b, qn, qp = make_batch([400, 200], 16, 512, 64, 64, DT, seed=5)
    for seed in range(2):
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
