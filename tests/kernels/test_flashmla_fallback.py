"""The optional FlashMLA backend on a machine without it (CI): `mla_compile.kernels.flashmla` imports, says it
is unavailable (never raises), and `decode` refuses with a reason. Its adapter logic (q concatenation, the K
cache in place or copied, the block table into a copy, the empty-row fix-up) runs here against a stand-in for
`flash_mla` that follows FlashMLA's documented dense-decode contract in float64, and is checked against the
float64 reference (tests/reference.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import reference as ref
from flashmla_stand_in import StandIn
from mla_compile.kernels import flashmla as FM

R, P, PS = 512, 64, 64
SCALE = 0.07
LENS = [0, 1, 63, 64, 65, 200, 0]


def test_module_imports_without_touching_flash_mla():
    code = ("import sys, mla_compile, mla_compile.kernels.flashmla as F, mla_compile.kernels.dispatch; "
            "assert 'flash_mla' not in sys.modules, 'imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unavailable_without_flash_mla_or_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # `import flash_mla` raises ImportError
    FM._flash_mla.cache_clear()
    try:
        assert FM._flash_mla() is None
        if not torch.cuda.is_available():
            assert FM.available() is False
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(FM, "_sm90", lambda device: True)
        assert FM.available() is False  # an SM90 GPU, but no flash_mla
    finally:
        FM._flash_mla.cache_clear()


def test_available_never_raises(monkeypatch):
    def boom():
        raise RuntimeError("driver gone")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    assert FM.available() is False


def test_unavailable_decode_refuses_with_a_reason():
    if FM.available():
        pytest.skip("flash_mla is usable here")
    qn, c = torch.randn(2, 4, R), torch.randn(3, PS, R)
    ok, why = FM.supported(qn, c, PS)
    assert not ok and "flash_mla" in why
    with pytest.raises(ValueError, match="flash_mla"):
        FM.decode(qn, torch.randn(2, 4, P), c, torch.randn(3, PS, P), torch.zeros(2, 1, dtype=torch.int32),
                  torch.ones(2, dtype=torch.int32), SCALE)


def test_ops_keep_working_on_cpu():
    # mla::decode's CPU impl never reaches the backends
    _, (c, k), table, lens, _ = ref.build_paged([5, 0, 70], PS, (R, P), generator=torch.Generator().manual_seed(0))
    qn, qp = torch.randn(3, 4, R), torch.randn(3, 4, P)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, table, lens, SCALE)
    ref_out, ref_lse = ref.ref_decode(qn, qp, c, k, table, lens, SCALE)
    assert torch.allclose(out.double(), ref_out, atol=1e-5) and torch.equal(lse == -math.inf, ref_lse == -math.inf)


# ------------------------------------------------------------------------- the adapter, on a stand-in FlashMLA
class FakeFlashMLA(StandIn):
    """`flash_mla`'s dense-decode API (use_legacy=True) as its docstring and C++ interface define it, in float64:
    q [B, 1, H, D], k_cache [NB, 64, 1, D] (D = 576 = latent | rope, or 512), head_dim_v 512 -> out [B, 1, H, dv]
    (q's dtype), lse float32 [B, H, 1], natural log. A row with seq_len 0: lse +inf and an unwritten output
    (NaN here), which the adapter must overwrite."""

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, use_legacy=False):
        assert use_legacy and not causal and num_splits is None
        self.fill(tile_scheduler_metadata)
        B, s_q, H, D = q.shape
        assert s_q == 1 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
        assert k_cache.shape[1:3] == (64, 1) and k_cache.shape[3] == D and head_dim_v == 512
        assert block_table.dtype == torch.int32 and block_table.shape[0] == B and block_table.stride(-1) == 1
        self.calls.append(dict(k_rows=k_cache.shape[0], D=D))
        self.last_q = q
        out = torch.full((B, 1, H, head_dim_v), math.nan, dtype=q.dtype)
        lse = torch.full((B, H, 1), math.inf, dtype=torch.float32)
        for b in range(B):
            n = int(cache_seqlens[b])
            if n == 0:
                continue
            rows = torch.stack([k_cache[int(block_table[b, t // 64]), t % 64, 0] for t in range(n)]).double()
            scores = softmax_scale * (q[b, 0].double() @ rows.T)  # [H, n]
            lse[b, :, 0] = torch.logsumexp(scores, dim=-1).float()
            out[b, 0] = (torch.softmax(scores, dim=-1) @ rows[:, :head_dim_v]).to(q.dtype)
        return out, lse


@pytest.fixture
def fake(monkeypatch):
    f = FakeFlashMLA()
    monkeypatch.setattr(FM, "_flash_mla", lambda: f)
    monkeypatch.setattr(FM, "supported", lambda *a, **k: (True, ""))  # the CPU stands in for an SM90 GPU
    return f


def _batch(layout, rope=P, seed=0):
    g = torch.Generator().manual_seed(seed)
    cols = max(-(-n // PS) for n in LENS) + 1
    extra = len(LENS) * cols + 4 if layout == "table" else 0
    # NaN in every unused slot, garbage (out-of-range, -1) in unused block-table entries
    _, (c, k), table, lens, num_pages = ref.build_paged(LENS, PS, (R, rope), generator=g, extra_pages=extra,
                                                        extra_cols=1)
    if layout == "fused":
        fc, fk = FM.fused_caches(num_pages, PS, R, rope, c.dtype, "cpu")
        fc.copy_(c)
        fk.copy_(k)
        c, k = fc, fk
    qn, qp = torch.randn(len(LENS), 3, R, generator=g), torch.randn(len(LENS), 3, rope, generator=g)
    return qn, qp, c, k, table, lens


@pytest.mark.parametrize("layout", ["pool", "table", "fused"])
def test_adapter_matches_the_reference(fake, layout):
    qn, qp, c, k, table, lens = _batch(layout)
    out, lse = FM.decode(qn, qp, c, k, table, lens, SCALE)
    ref_out, ref_lse = ref.ref_decode(qn, qp, c, k, table, lens, SCALE)
    assert out.shape == qn.shape and out.dtype == qn.dtype and lse.shape == qn.shape[:2] and lse.dtype == torch.float32
    empty = lens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and bool((lse[empty] == -math.inf).all())
    assert torch.allclose(out[~empty].double(), ref_out[~empty], atol=1e-5)
    assert torch.allclose(lse[~empty].double(), ref_lse[~empty], atol=1e-5)
    # what FlashMLA was handed: the pool in place, a copy of the pool, or a copy of just the table's pages
    want_rows = {"fused": c.shape[0], "pool": c.shape[0], "table": table.numel()}[layout]
    assert fake.calls == [dict(k_rows=want_rows, D=R + P)]
    assert (want_rows < c.shape[0]) == (layout == "table")


def test_adapter_rope_less_and_strided_q(fake):
    qn, qp, c, k, table, lens = _batch("pool", rope=0, seed=1)
    qn_t = qn.transpose(0, 1).contiguous().transpose(0, 1)  # the pass's transposed q
    out, lse = FM.decode(qn_t, qp, c, k, table, lens, SCALE)
    ref_out, ref_lse = ref.ref_decode(qn, qp, c, k, table, lens, SCALE)
    assert fake.calls == [dict(k_rows=c.shape[0], D=R)]  # the 512-wide head over the latent cache alone
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("joined", [True, False])
def test_adapter_hands_one_q_buffer_over_as_it_is(fake, joined, in_place, monkeypatch):
    """q_nope / q_pe as the two column ranges of one [B, H, R + P (+ pad)] buffer (SGLang's absorbed q, here with
    heads strided across batch rows) reach FlashMLA as that buffer, no copy, where `Q_IN_PLACE` allows; a gap
    between them, or two tensors, take the concatenation. Either way the result is the reference's."""
    monkeypatch.setattr(FM, "Q_IN_PLACE", in_place)
    joined = joined and in_place
    qn, qp, c, k, table, lens = _batch("fused", seed=2)
    buf = torch.randn(qn.shape[1], qn.shape[0], R + P + 8).transpose(0, 1)  # [B, H, 584], head-major memory
    gap = 0 if joined else 8
    buf[..., :R], buf[..., R + gap:R + gap + P] = qn, qp
    qn_v, qp_v = buf[..., :R], buf[..., R + gap:R + gap + P]
    assert (FM.joined_q(qn_v, qp_v).data_ptr() == buf.data_ptr()) == joined
    assert torch.equal(FM.joined_q(qn_v, qp_v), torch.cat((qn, qp), dim=-1))
    out, lse = FM.decode(qn_v, qp_v, c, k, table, lens, SCALE)
    assert (fake.last_q.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()) == joined
    ref_out, ref_lse = ref.ref_decode(qn, qp, c, k, table, lens, SCALE)
    live = lens > 0
    assert torch.allclose(out[live].double(), ref_out[live], atol=1e-5)
    assert torch.allclose(lse[live].double(), ref_lse[live], atol=1e-5)
    # two tensors, or q_pe ahead of q_nope in the row: never a view
    assert FM.joined_q(qn, qp).data_ptr() not in (qn.data_ptr(), qp.data_ptr())
    assert FM.joined_q(buf[..., P:P + R], buf[..., :P]).data_ptr() != buf.data_ptr()


def test_adapter_no_pages_means_all_empty(fake):
    out, lse = FM.decode(torch.randn(2, 3, R), torch.randn(2, 3, P), torch.randn(1, PS, R), torch.randn(1, PS, P),
                         torch.zeros(2, 0, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), SCALE)
    assert fake.calls == [] and not out.any() and bool((lse == -math.inf).all())


def test_shares_rows_only_for_one_buffer():
    c, k = FM.fused_caches(3, PS, R, P, torch.float32, "cpu")
    assert FM.shares_rows(c, k)
    assert not FM.shares_rows(c.clone(), k.clone())  # two allocations
    assert not FM.shares_rows(c[1:], k[:-1])  # same buffer, different pages
    buf = torch.empty(3, PS, R + P + 8)  # wider rows (a padded buffer): still one row per token
    assert FM.shares_rows(buf[..., :R], buf[..., R:R + P])
    assert not FM.shares_rows(buf[..., :R], buf[..., R + 8:R + 8 + P])  # a gap between latent and rope
