"""`dsa.indexer_topk` on the GPU: the order keys kernel, the radix select kernel or torch.topk and the slots kernel
(kernels/dsa.py), one plan
per call signature (ops/_plans.py), against the op's CPU impl EXACTLY. Small-integer inputs make every score exact
whatever the summation order (tests/kernels/test_indexer_kernels.py `tied_inputs`), so CPU and GPU compute the same
keys and select the same slots, ties going to the lower token index. Also the key math as compiled for the GPU vs
`topk_order.order_keys` bit for bit, and CUDA-graph capture / replay with changed lengths, tables and keys.
Skipped without a CUDA device."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

import mla_compile  # noqa: E402,F401  (registers the ops)
from gpu_util import capture  # noqa: E402
from mla_compile import topk_order  # noqa: E402
from mla_compile.kernels import dsa as K  # noqa: E402
from mla_compile.ops import dsa as dsa_ops  # noqa: E402
from test_indexer_kernels import (SPECIAL_BITS, floats_of_bits, keys_of, special_score_inputs, strided,  # noqa: E402
                                  tied_inputs)

DEV = "cuda"
SCALE = 0.5


@pytest.fixture(autouse=True)
def _fresh_plans():
    dsa_ops._PLANS.clear()
    yield
    dsa_ops._PLANS.clear()


def _cuda(args):
    return tuple(t.to(DEV) for t in args)


def _lens(topk: int, cap: int) -> list[int]:
    """One row of each kind: empty, short, exactly topk, one past topk, the whole table."""
    return [min(n, cap) for n in (0, max(topk - 1, 1), topk, topk + 1, cap)]


def _cpu(args, topk):
    return torch.ops.dsa.indexer_topk(*[t.cpu() for t in args], topk, SCALE)


def test_key_math_compiled_for_the_gpu_is_order_keys():
    """`_order_key` as the GPU runs it (no fast-math folding of -0.0, NaN compares kept) vs the definition."""
    g = torch.Generator().manual_seed(0)
    bits = SPECIAL_BITS * 4 + torch.randint(0, 2**32, (4000,), generator=g).tolist()
    score = floats_of_bits(bits)
    index = torch.randint(0, 2**32, (len(bits),), generator=g)
    index[:5] = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1])
    want = topk_order.order_keys(score, index, torch.ones_like(index, dtype=torch.bool))
    assert torch.equal(keys_of(score.to(DEV), index.to(DEV)).cpu(), want)


def test_logits_kernel_keys_are_order_keys_of_its_scores():
    args, topk = special_score_inputs()
    dev = _cuda(args)
    scores = K.indexer_scores(*dev, 1.0, topk).cpu()
    lens = args[-1]
    valid = (torch.arange(scores.shape[1])[None, :] < lens[:, None]) & (lens[:, None] > topk)
    s = scores[valid]
    assert (s == float("inf")).any() and (s == float("-inf")).any() and (s == 0).any()
    want = topk_order.order_keys(scores, torch.arange(scores.shape[1]), valid)
    assert torch.equal(K.indexer_keys(*dev, 1.0, topk).cpu(), want)
    assert torch.equal(K.indexer_keys(*strided(*dev), 1.0, topk).cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("PS", [1, 16, 64])
@pytest.mark.parametrize("topk", [16, 64, 2048])
def test_cuda_op_equals_cpu_op(topk, PS, dtype):
    MP = -(-3000 // PS)
    args = tied_inputs(_lens(topk, MP * PS), PS, MP, 64, 128, dtype, seed=topk + PS)
    want = _cpu(args, topk)
    dev = _cuda(args)
    got = torch.ops.dsa.indexer_topk(*dev, topk, SCALE)
    assert got.shape == want.shape and got.dtype == torch.int32
    assert torch.equal(got.cpu(), want)
    assert torch.equal(torch.ops.dsa.indexer_topk(*strided(*dev), topk, SCALE).cpu(), want)


@pytest.mark.parametrize("select", ["radix", "torch"])
@pytest.mark.parametrize("tokens", [1000, 8192, 20000])
def test_both_top_k_selects_equal_cpu_op(select, tokens):
    """The radix select kernel and torch.topk + slots, each asked for, on rows of up to 20K tokens with many tied
    scores (auto takes radix up to RADIX_MAX_TOKENS): the CPU op's slots exactly."""
    topk, PS = 256 if tokens == 1000 else 2048, 64
    args = tied_inputs(_lens(topk, tokens), PS, -(-tokens // PS), 8, 64, torch.bfloat16, seed=tokens)
    got = K.indexer_topk(*_cuda(args), topk, SCALE, select)
    assert torch.equal(got.cpu(), _cpu(args, topk))


@pytest.mark.parametrize("dcp_size,dcp_rank", [(1, 0), (2, 1), (4, 3)])
def test_dcp_local_candidates_compile_for_cuda(dcp_size, dcp_rank):
    """`dsa::dcp_indexer_topk` decomposes under torch.compile; its per-rank step (order keys of an arange-derived
    global index) compiled for CUDA gives the eager keys exactly (exact small-integer scores). It failed to compile
    once: Inductor folded 2^32 - 1 - index into an int32 index expression."""
    from mla_compile.ops.dcp_dsa import local_candidates

    args = _cuda(tied_inputs([300, 40, 0], 16, 20, 8, 64, torch.bfloat16, seed=dcp_size))
    want = local_candidates(*args, 32, SCALE, dcp_size, dcp_rank)
    got = torch.compile(local_candidates, dynamic=False)(*args, 32, SCALE, dcp_size, dcp_rank)
    assert torch.equal(got, want)


@pytest.mark.parametrize("select", ["radix", "torch"])
@pytest.mark.parametrize("dcp_size,dcp_rank", [(2, 1), (4, 0)])
def test_dcp_local_candidates_cuda_equals_cpu_op(select, dcp_size, dcp_rank):
    """`dsa::dcp_local_candidates` on CUDA (the logits kernel with the global index, then each select) against its
    CPU impl exactly: shards shorter than topk (all their keys, NONE-padded), longer ones, an empty one."""
    topk, PS = 2048, 64
    args = tied_inputs([0, 100, topk, topk + 1, 6000], PS, -(-6000 // PS), 8, 64, torch.bfloat16, seed=dcp_size)
    want = torch.ops.dsa.dcp_local_candidates(*args, topk, SCALE, dcp_size, dcp_rank)
    got = K.candidate_keys_plan(*_cuda(args), topk, SCALE, dcp_size, dcp_rank, select)(*_cuda(args))
    assert torch.equal(got.cpu(), want)
    op = torch.ops.dsa.dcp_local_candidates(*_cuda(args), topk, SCALE, dcp_size, dcp_rank)
    assert torch.equal(op.cpu(), want)


def test_narrow_table_and_empty_batch():
    """A table of at most topk tokens (the slots kernel alone) and B = 0."""
    args = tied_inputs([0, 5, 64], 16, 4, 8, 64, seed=1)
    assert torch.equal(torch.ops.dsa.indexer_topk(*_cuda(args), 64, SCALE).cpu(), _cpu(args, 64))
    empty = tuple(t[:0] if i != 2 else t for i, t in enumerate(_cuda(args)))
    assert torch.ops.dsa.indexer_topk(*empty, 64, SCALE).shape == (0, 64)


def test_one_plan_per_signature_replays_new_inputs():
    """Three input sets of one signature (new keys, queries, tables, lengths): one plan, three exact answers."""
    for seed, lens in enumerate(([900, 0, 64, 65], [5, 1024, 64, 300], [1024, 1024, 1024, 1024])):
        args = tied_inputs(lens, 64, 16, 64, 128, torch.bfloat16, seed=seed)
        assert torch.equal(torch.ops.dsa.indexer_topk(*_cuda(args), 64, SCALE).cpu(), _cpu(args, 64))
    assert len(dsa_ops._PLANS._plans) == 1


def test_a_misaligned_query_gets_its_own_plan():
    args = _cuda(tied_inputs([700, 3], 16, 64, 16, 128, torch.bfloat16, seed=2))
    want = _cpu(args, 32)
    assert torch.equal(torch.ops.dsa.indexer_topk(*args, 32, SCALE).cpu(), want)
    q = args[0]
    odd = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEV)[1:].view(q.shape)
    odd.copy_(q)
    assert odd.data_ptr() % 16 != 0
    assert torch.equal(torch.ops.dsa.indexer_topk(odd, *args[1:], 32, SCALE).cpu(), want)
    assert len(dsa_ops._PLANS._plans) == 2


def test_bad_input_still_raises_after_a_plan():
    args = _cuda(tied_inputs([100, 3], 16, 8, 16, 128, seed=3))
    torch.ops.dsa.indexer_topk(*args, 32, SCALE)
    with pytest.raises(ValueError, match="seq_lens"):
        torch.ops.dsa.indexer_topk(*args[:4], args[4].long(), 32, SCALE)
    with pytest.raises(ValueError, match="sm_scale"):
        torch.ops.dsa.indexer_topk(*args, 32, float("nan"))


def test_multi_token_query_matches_cpu():
    """q [B, S, Hi, Di]: one row per query token (a plan per call), as the CPU op."""
    S, topk = 3, 16
    q, w, k_cache, table, lens = tied_inputs([200, 0, 18, 3], 16, 16, 8, 64, seed=4)
    g = torch.Generator().manual_seed(5)
    q4 = torch.randint(-1, 2, (4, S, 8, 64), generator=g).float()
    w4 = torch.randint(-2, 3, (4, S, 8), generator=g).float()
    args = (q4, w4, k_cache, table, lens)
    assert torch.equal(torch.ops.dsa.indexer_topk(*_cuda(args), topk, SCALE).cpu(), _cpu(args, topk))


def test_cuda_graph_replays_new_lengths_tables_and_keys():
    """The op captured once (its plan made in the warm-up), replayed after copying in other inputs of the same
    shapes: every replay equals the CPU op on those inputs (no host sync, shapes only from shapes)."""
    PS, MP, topk = 16, 64, 128
    sets = [tied_inputs(lens, PS, MP, 64, 128, torch.bfloat16, seed=i) for i, lens in
            enumerate(([900, 0, 128, 129], [1024, 1024, 5, 0], [0, 0, 0, 0], [127, 300, 1000, 128]))]
    static = [t.clone() for t in _cuda(sets[0])]
    graph, out = capture(lambda: torch.ops.dsa.indexer_topk(*static, topk, SCALE))
    for args in sets[1:] + sets[:1]:
        for dst, src in zip(static, args):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), _cpu(args, topk))
    assert len(dsa_ops._PLANS._plans) == 1
