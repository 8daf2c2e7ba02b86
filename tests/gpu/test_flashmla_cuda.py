"""The FlashMLA backend (`mla_compile.kernels.flashmla`) against the float64 references on an SM90 GPU: shuffled
pages with NaN in every unused slot and garbage in unused block-table entries, ragged lengths with empty rows,
both cache layouts (two tensors: copied per call; one fused buffer: read in place), CUDA-graph capture and replay
with changed lengths, and under torch.compile's cudagraph trees. Skipped unless `flash_mla` imports on SM90."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
from gpu_util import capture, rel
from mla_compile.kernels import flashmla as FM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not FM.available(), reason="needs flash_mla on an SM90 GPU")]

DEV = "cuda"
R, P, PS = 512, 64, 64
SCALE = 192 ** -0.5
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # out: relative norm error vs float64
LSE_TOL = 1e-3  # lse: absolute (scores accumulate in fp32 from the same half-precision inputs)
LENS = {1: [2500], 8: [0, 1, 63, 64, 65, 1000, 4097, 0]}  # on and off page edges, empty rows


def build(lens, H, dtype, layout, seed, rope=P):
    """(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens) on the GPU. layout: "pool" / "table" (two
    tensors, copied per call: the whole pool or the table's pages, whichever is smaller), "fused" (views of one
    [NP, PS, R + P] buffer, read in place)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    cols = max(-(-n // PS) for n in lens) + 1
    # "table": a pool larger than the table's B * MP pages, so the copy takes the table's pages
    extra = B * cols + 8 if layout == "table" else 0
    _, (ckv, kpe), table, seq_lens, num_pages = ref.build_paged(lens, PS, (R, rope), dtype, generator=g,
                                                               extra_pages=extra, extra_cols=1)
    for b in range(B):  # an empty request's first entry: out of range (build_paged) or -1, alternating
        if lens[b] == 0 and b % 2:
            table[b, 0] = -1
    if layout == "fused":
        c, k = FM.fused_caches(num_pages, PS, R, rope, dtype, DEV)
        c.copy_(ckv)
        k.copy_(kpe)
    else:
        c, k = ckv.to(DEV), kpe.to(DEV)
    qn = torch.randn(B, H, R, generator=g).to(dtype).to(DEV)
    qp = torch.randn(B, H, rope, generator=g).to(dtype).to(DEV)
    return qn, qp, c, k, table.to(DEV), seq_lens.to(DEV)


def want(qn, qp, c, k, table, lens):
    return ref.ref_decode(qn.cpu(), qp.cpu(), c.cpu(), k.cpu(), table.cpu(), lens.cpu(), SCALE)


def assert_contract(out, lse, ref_out, ref_lse, q_nope):
    """Our decode contract exactly: shapes, dtypes, contiguity, empty rows (0, -inf) and only they, values."""
    B, H, _ = q_nope.shape
    assert out.shape == (B, H, R) and out.dtype == q_nope.dtype and out.is_contiguous()
    assert lse.shape == (B, H) and lse.dtype == torch.float32 and lse.is_contiguous()
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in result"
    empty = ref_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty), "empty rows (and only they) must give lse -inf"
    assert not (lse == math.inf).any(), "FlashMLA's +inf must not leak"
    assert float(out[empty].abs().sum()) == 0, "empty rows must give out 0"
    if (~empty).any():
        assert rel(out[~empty], ref_out[~empty]) < TOL[q_nope.dtype]
        assert float((lse.double() - ref_lse)[~empty].abs().max()) < LSE_TOL


@pytest.mark.parametrize("layout", ["pool", "table", "fused"])
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("H", [16, 128])
def test_decode_matches_float64_reference(H, B, layout):
    qn, qp, c, k, table, lens = build(LENS[B], H, torch.bfloat16, layout, seed=H + B)
    kv, kv_table, copied = FM.kv_cache(c, k, table)
    assert copied == (layout != "fused")
    if layout == "table":
        assert kv.shape[0] == table.numel() < c.shape[0] and kv_table.shape == table.shape
    out, lse = FM.decode(qn, qp, c, k, table, lens, SCALE)
    assert_contract(out, lse, *want(qn, qp, c, k, table, lens), qn)


@pytest.mark.parametrize("layout", ["pool", "fused"])
def test_decode_fp16(layout):
    qn, qp, c, k, table, lens = build(LENS[8], 128, torch.float16, layout, seed=3)
    assert_contract(*FM.decode(qn, qp, c, k, table, lens, SCALE), *want(qn, qp, c, k, table, lens), qn)


def test_decode_all_rows_empty():
    qn, qp, c, k, table, lens = build([0, 0, 0], 16, torch.bfloat16, "pool", seed=5)
    out, lse = FM.decode(qn, qp, c, k, table, lens, SCALE)
    assert torch.equal(out.cpu(), torch.zeros(3, 16, R, dtype=torch.bfloat16))
    assert bool((lse == -math.inf).all())


def test_decode_strided_q():
    # the attention pass hands q over as a transposed bmm output ([H, B, R] memory, [B, H, R] shape)
    qn, qp, c, k, table, lens = build(LENS[8], 128, torch.bfloat16, "fused", seed=9)
    qn_t, qp_t = qn.transpose(0, 1).contiguous().transpose(0, 1), qp.transpose(0, 1).contiguous().transpose(0, 1)
    assert not qn_t.is_contiguous()
    assert_contract(*FM.decode(qn_t, qp_t, c, k, table, lens, SCALE), *want(qn, qp, c, k, table, lens), qn)


def test_decode_one_q_buffer(monkeypatch):
    # q_nope / q_pe as column ranges of one padded [B, H, R + P + 8] buffer (SGLang's absorbed q): FlashMLA reads it
    # in place at its batch / head strides (`joined_q` with Q_IN_PLACE), bit for bit what the concatenated copy gives
    monkeypatch.setattr(FM, "Q_IN_PLACE", True)
    qn, qp, c, k, table, lens = build(LENS[8], 128, torch.bfloat16, "fused", seed=11)
    buf = torch.empty(qn.shape[1], qn.shape[0], R + P + 8, dtype=qn.dtype, device=DEV).transpose(0, 1)
    buf[..., :R], buf[..., R:R + P] = qn, qp
    assert FM.joined_q(buf[..., :R], buf[..., R:R + P]).data_ptr() == buf.data_ptr()
    out, lse = FM.decode(buf[..., :R], buf[..., R:R + P], c, k, table, lens, SCALE)
    copied = FM.decode(qn, qp, c, k, table, lens, SCALE)
    assert torch.equal(out, copied[0]) and torch.equal(lse, copied[1])
    assert_contract(out, lse, *want(qn, qp, c, k, table, lens), qn)


def test_decode_rope_less(monkeypatch):
    # P = 0: FlashMLA's 512-wide head over the latent cache alone, in place
    qn, qp, c, k, table, lens = build(LENS[8], 128, torch.bfloat16, "pool", seed=13, rope=0)
    assert FM.supported(qn, c, PS, k) == (True, "")
    assert not FM.kv_cache(c, k, table)[2]
    assert_contract(*FM.decode(qn, qp, c, k, table, lens, SCALE), *want(qn, qp, c, k, table, lens), qn)
    # a transposed q reaches FlashMLA as it is with Q_IN_PLACE (no copy: P = 0 needs no concatenation)
    monkeypatch.setattr(FM, "Q_IN_PLACE", True)
    qn_t = qn.transpose(0, 1).contiguous().transpose(0, 1)
    assert FM.joined_q(qn_t, qp).data_ptr() == qn_t.data_ptr()
    assert_contract(*FM.decode(qn_t, qp, c, k, table, lens, SCALE), *want(qn, qp, c, k, table, lens), qn)


# built with these lengths, replayed with shorter ones (each slot below a new length then holds a real token)
GRAPH_LENS = [700, 300, 1000, 64, 129, 1000, 4097, 200]
REPLAY_LENS = ([5, 0, 1000, 64, 1, 0, 3000, 128], [0] * 8, [700, 1, 999, 63, 65, 1000, 4097, 0], GRAPH_LENS)


@pytest.mark.parametrize("layout", ["pool", "table", "fused"])
def test_cuda_graph_replay_with_changed_lengths(layout):
    # the split-KV schedule is made inside the call, so a captured graph follows the new lengths on replay
    qn, qp, c, k, table, lens = build(GRAPH_LENS, 128, torch.bfloat16, layout, seed=21)
    graph, (out, lse) = capture(lambda: FM.decode(qn, qp, c, k, table, lens, SCALE))
    for new in REPLAY_LENS:
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_contract(out, lse, *want(qn, qp, c, k, table, lens), qn)


torch.library.define("flashmla_test::decode", "(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, "
                     "Tensor block_table, Tensor seq_lens, float sm_scale) -> (Tensor, Tensor)")


SEEN_IN_PLACE = []  # per eager run of the op below (warm-up, recording): did FlashMLA read the caches in place?


@torch.library.impl("flashmla_test::decode", "cuda")
def _decode_op(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    SEEN_IN_PLACE.append(FM.shares_rows(ckv_cache, kpe_cache))
    return FM.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)


@torch.library.register_fake("flashmla_test::decode")
def _(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    B, H, _ = q_nope.shape
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty((B, H), dtype=torch.float32)


@pytest.mark.parametrize("layout", ["pool", "fused"])
def test_cudagraph_trees(layout, cudagraph_recordings):
    # an opaque op around FM.decode (as mla::decode's CUDA impl will call it) under mode="reduce-overhead": the
    # warm-up runs it eagerly inside the graph pool, then one recording replays for new lengths
    qn, qp, c, k, table, lens = build(GRAPH_LENS, 16, torch.bfloat16, layout, seed=34)
    for t in (c, k):  # a model's caches are buffers at fixed addresses: not copied into the graph's inputs
        torch._dynamo.mark_static_address(t)
    SEEN_IN_PLACE.clear()

    def step(qn, qp, c, k, table, lens):
        out, lse = torch.ops.flashmla_test.decode(qn, qp, c, k, table, lens, SCALE)
        return out * 1, lse + 0  # Inductor kernels around it, like a model's

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for new in REPLAY_LENS:
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out, lse = compiled(qn, qp, c, k, table, lens)
        torch.cuda.synchronize()
        assert_contract(out.clone(), lse.clone(), *want(qn, qp, c, k, table, lens), qn)
    assert len(set(cudagraph_recordings)) == 1, f"re-recorded: {cudagraph_recordings}"
    # the fused layout survives compilation: the op still sees two views of one buffer
    assert SEEN_IN_PLACE and set(SEEN_IN_PLACE) == {layout == "fused"}


@pytest.mark.parametrize("case", ["page32", "R256", "fp32", "cpu"])
def test_unsupported_shapes_say_why(case):
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    width, ps = (256 if case == "R256" else R), (32 if case == "page32" else PS)
    dev = "cpu" if case == "cpu" else DEV
    qn = torch.randn(2, 16, width, dtype=dtype, device=dev)
    c = torch.randn(4, ps, width, dtype=dtype, device=dev)
    ok, why = FM.supported(qn, c, ps)
    assert not ok and why.split(":")[0] in ("q_nope", "ckv_cache")
    with pytest.raises(ValueError, match=why.split(":")[0]):
        FM.decode(qn, torch.randn(2, 16, P, dtype=dtype, device=dev), c, torch.randn(4, ps, P, dtype=dtype, device=dev),
                  torch.zeros(2, 1, dtype=torch.int32, device=dev), torch.ones(2, dtype=torch.int32, device=dev), 0.1)


def test_auto_takes_flashmla_on_a_fused_rows_cache_from_256k_tokens():
    """MLAPagedCache(fused_rows=True)'s layer buffers are FlashMLA's K layout: auto runs FlashMLA there at many heads
    and >= 256K tokens per call (dispatch.FLASHMLA_MIN_TOKENS), ours below; both match the float64 reference."""
    from mla_compile.kernels import dispatch

    H, B, pages = 128, 2, 2048  # 2 x 2048 pages x 64 tokens: 256K tokens of capacity
    g = torch.Generator(device=DEV).manual_seed(3)
    rows = torch.randn(B * pages, PS, R + P, dtype=torch.bfloat16, device=DEV, generator=g)
    ckv, kpe = rows[..., :R], rows[..., R:]
    table = torch.randperm(B * pages, device=DEV, generator=g).int().view(B, pages)
    lens = torch.tensor([1000, 70000], dtype=torch.int32, device=DEV)
    qn = torch.randn(B, H, R, dtype=torch.bfloat16, device=DEV, generator=g)
    qp = torch.randn(B, H, P, dtype=torch.bfloat16, device=DEV, generator=g)
    assert dispatch.decode_kernel(qn, qp, ckv, kpe, block_table=table).name == "flashmla"
    assert dispatch.decode_kernel(qn, qp, ckv, kpe, block_table=table[:, :pages // 2]).name != "flashmla"
    for t in (table, table[:, :pages // 2].contiguous()):
        n = lens.clamp(max=t.shape[1] * PS)
        out, lse = torch.ops.mla.decode(qn, qp, ckv, kpe, t, n, SCALE)
        assert_contract(out, lse, *want(qn, qp, ckv, kpe, t, n), qn)
