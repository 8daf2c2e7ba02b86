"""Split-KV decode that merges its own splits in one launch (kernels/merge.py, "a split launch that merges itself"):
what an eager `mla.decode` / `mla.sparse_decode` call on the default stream takes for the Triton pointer kernel and
the swap-AB Gluon kernel. Checked against the two-launch path (stage 1, then `_merge_kernel`) and float64; the
counters are back at zero after every call; other streams and CUDA-graph capture keep two launches. Skipped without
a CUDA device."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

import mla_compile  # noqa: E402,F401  (registers the ops)
import reference as ref  # noqa: E402
from gpu_util import capture, rel, token_table_rows  # noqa: E402
from mla_compile import paged  # noqa: E402
from mla_compile.kernels import _launch, scratch  # noqa: E402
from mla_compile.kernels import decode as D  # noqa: E402
from mla_compile.kernels import dispatch  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def _own_kernels(monkeypatch):
    monkeypatch.delenv("MLA_COMPILE_DECODE_BACKEND", raising=False)


@pytest.fixture
def launched(monkeypatch):
    """The names of the kernels every bound launch runs, in order."""
    names, call = [], _launch.Bound.__call__

    def recording(self, *args):
        names.append(self.fast.jit_function.fn.__name__)
        return call(self, *args)

    monkeypatch.setattr(_launch.Bound, "__call__", recording)
    return names


def _paged(lens, H, PS, seed):
    g = torch.Generator().manual_seed(seed)
    ckv = [torch.randn(n, 512, generator=g).to(BF16).to(DEV) for n in lens]
    kpe = [torch.randn(n, 64, generator=g).to(BF16).to(DEV) for n in lens]
    b = paged.fill_paged(ckv, kpe, PS, shuffle=True, spare_pages=3, generator=g)  # unused slots: NaN
    qn = torch.randn(len(lens), H, 512, generator=g).to(BF16).to(DEV)
    qp = torch.randn(len(lens), H, 64, generator=g).to(BF16).to(DEV)
    return b, qn, qp


def _token_table(lens, H, kind, seed):
    g = torch.Generator().manual_seed(seed)
    table, rows_of, N = token_table_rows(lens, kind, g)
    ckv = torch.full((N, 1, 512), float("nan"), dtype=BF16)
    kpe = torch.full((N, 1, 64), float("nan"), dtype=BF16)
    for rows in rows_of:
        ckv[rows, 0] = torch.randn(len(rows), 512, generator=g).to(BF16)
        kpe[rows, 0] = torch.randn(len(rows), 64, generator=g).to(BF16)
    qn = torch.randn(len(lens), H, 512, generator=g).to(BF16)
    qp = torch.randn(len(lens), H, 64, generator=g).to(BF16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEV) for t in (qn, qp, ckv, kpe, table, lens_t)]


def _counters_zero():
    torch.cuda.synchronize()
    buf = scratch._local.buffers.get(torch.cuda.current_device())
    return buf is not None and buf.counters is not None and not bool(buf.counters.any())


def _decode_cases():
    """(id, the op's call, the two-launch call, the float64 reference, the stage-1 kernel's name)."""
    cases = []
    # B 1 and few splits: one launch (stage 1 and the merge items fit one wave); B 4 4K: 132 stage-1 programs, two
    for lens, H, PS in (([1000], 16, 64), ([4000], 16, 64), ([4000, 0, 77, 2500], 16, 64), ([3000], 40, 64),
                        ([900, 64], 8, 16)):
        b, qn, qp = _paged(lens, H, PS, seed=sum(lens) + H)
        args = (qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.07)
        cases.append((f"paged H{H} PS{PS} {lens}", args, False))
    for kind in ("runs", "shuffled"):
        qn, qp, ckv, kpe, table, lens = _token_table([1500, 3000], 16, kind, seed=7)
        cases.append((f"token table {kind}", (qn, qp, ckv, kpe, table, lens, 0.07), False))
    from mla_compile.ops.attention import token_slots

    g = torch.Generator().manual_seed(3)
    b, qn, qp = _paged([2000, 300], 16, 64, seed=11)
    phys = token_slots(b.block_table.cpu(), 64, 2000)  # [B, 2000] each logical token's physical slot
    idx = torch.full((2, 512), -1, dtype=torch.int32)  # request 1: 212 of its tokens, then -1 holes
    idx[0] = phys[0, torch.randperm(2000, generator=g)[:512]].int()
    idx[1, :212] = phys[1, torch.randperm(300, generator=g)[:212]].int()
    cases.append(("sparse H16 K512", (qn, qp, b.ckv_cache, b.kpe_cache, idx.to(DEV), 0.07), True))
    return cases


CASES = _decode_cases() if torch.cuda.is_available() else []


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_eager_call_merges_its_splits_in_one_launch(case, launched):
    name, args, sparse = CASES[case]
    op = torch.ops.mla.sparse_decode if sparse else torch.ops.mla.decode
    qn, qp, ckv, kpe = args[:4]
    cfg = dispatch.own_decode_config(qn, qp, ckv, kpe, sparse)
    if sparse:
        want = ref.ref_sparse_decode(qn.cpu(), qp.cpu(), ckv.cpu(), kpe.cpu(), args[4].cpu(), args[5])
        two = D.sparse_decode(*args, cfg=cfg, merge_in_kernel=False)
    else:
        want = ref.ref_decode(*(a.cpu() if torch.is_tensor(a) else a for a in args))
        two = D.decode(*args, cfg=cfg, merge_in_kernel=False)
    plan = (D.sparse_decode_plan(*args, cfg=cfg) if sparse else D.decode_plan(*args, cfg=cfg))
    assert plan.ns > 1, f"{name}: one split, nothing to merge"
    launched.clear()
    out, lse = op(*args)
    torch.cuda.synchronize()
    if plan.merged is None:  # more than one wave: the second launch stays
        assert len(launched) == 2 and launched[1] == "_merge_kernel", launched
    else:
        assert len(launched) == 1 and launched[0].endswith("_merged_kernel"), launched
        assert _counters_zero(), "counters left non-zero"
    if plan.merged is None:  # the same two launches: bitwise
        assert torch.equal(out, two[0]) and torch.equal(lse, two[1])
    else:  # the same arithmetic; the merge's column blocks (one wave) or its Gluon layout may order sums otherwise
        assert rel(out, two[0]) < 1e-3 and float((lse - two[1]).abs().nan_to_num().max()) < 1e-5
        assert torch.equal(lse == float("-inf"), two[1] == float("-inf"))
    assert rel(out, want[0]) < 2e-2
    fin = torch.isfinite(want[1])
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    if fin.any():
        assert float((lse.cpu().double() - want[1])[fin].abs().max()) < 2e-2
    assert float(out.cpu()[~fin].abs().sum()) == 0


@pytest.mark.skipif(not SM90, reason="the swap-AB kernel is sm_90's")
def test_one_request_on_sm90_takes_the_swapab_merged_kernel(launched):
    b, qn, qp = _paged([1000], 16, 64, seed=5)  # 16 splits
    launched.clear()
    torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
    assert launched == ["_swapab_merged_kernel"]
    b, qn, qp = _paged([4000], 16, 64, seed=5)  # 64 splits: over decode_swapab.MERGED_MAX_SPLITS
    launched.clear()
    torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
    assert launched == ["_swapab_kernel", "_merge_kernel"]
    b, qn, qp = _paged([4000] * 4, 16, 64, seed=5)  # 132 stage-1 programs: no room for merge items in one wave
    launched.clear()
    torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.1)
    assert launched == ["_swapab_kernel", "_merge_kernel"]


def test_back_to_back_calls_of_several_plans_keep_the_counters_right():
    """Calls queued without a sync, alternating three plans (different groups, splits and merge items): every
    result right, the counters zero at the end."""
    calls, wants = [], []
    for i, (name, args, sparse) in enumerate(CASES[:2] + CASES[-2:]):
        op = torch.ops.mla.sparse_decode if sparse else torch.ops.mla.decode
        calls.append((op, args))
        wants.append(op(*args))
    torch.cuda.synchronize()
    outs = [None] * len(calls)
    for rep in range(50):
        for i, (op, args) in enumerate(calls):
            outs[i] = op(*args)
    torch.cuda.synchronize()
    for (out, lse), (w_out, w_lse) in zip(outs, wants):
        assert torch.equal(out, w_out) and torch.equal(lse, w_lse)
    assert _counters_zero()


def test_side_stream_and_graph_capture_keep_two_launches(launched):
    name, args, _ = CASES[1]
    want = torch.ops.mla.decode(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    launched.clear()
    with torch.cuda.stream(s):
        out, lse = torch.ops.mla.decode(*args)
    torch.cuda.current_stream().wait_stream(s)
    assert len(launched) == 2 and launched[1] == "_merge_kernel", launched
    assert rel(out, want[0]) < 1e-3
    launched.clear()
    graph, (g_out, g_lse) = capture(lambda: torch.ops.mla.decode(*args))
    assert not any(n.endswith("_merged_kernel") for n in launched), launched
    graph.replay()
    torch.cuda.synchronize()
    assert rel(g_out, want[0]) < 1e-3
