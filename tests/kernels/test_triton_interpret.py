"""The Triton kernels on the CPU under TRITON_INTERPRET=1, small shapes, against tests/reference.py (float64).

TRITON_INTERPRET must be set before triton is imported, and other test modules import triton normally, so
the checks run in ONE child process (this file run as a script) and each test reads its verdict.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import tree

# its module fixture runs once: every test here on one xdist worker (README's test command: --dist loadgroup)
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
              pytest.mark.xdist_group("test_triton_interpret")]

CHECKS = ["decode", "decode_tma", "decode_strided_q", "decode_fp32_odd_dims", "decode_multi_token", "sparse_decode",
          "split_launch_merging_itself",
          "merge_states", "flashmla_empty_rows", "flashmla_fp8_slots", "cache_write", "fp8_write", "indexer_topk",
          "k_only_indices", "fused_linear", "linear_partials", "per_head_linear"]


@pytest.fixture(scope="module")
def verdicts():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=tree.child_pythonpath())
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT ")]
    if not lines:
        pytest.fail(f"interpreter child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("VERDICT "):])


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_under_interpreter(verdicts, name):
    assert verdicts.get(name) == "ok", verdicts.get(name, "not run")


# ------------------------------------------------------------------------------------------ the child process
def _rel(a, b):
    import torch

    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check_attention(out, lse, ref_out, ref_lse, tol):
    import torch

    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in result"
    assert _rel(out, ref_out) < tol, f"out rel err {_rel(out, ref_out):.2e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "lse finiteness differs"
    assert (lse == float("-inf")).eq(ref_lse == float("-inf")).all(), "empty rows must give lse -inf"
    assert float((lse.double() - ref_lse)[fin].abs().sum()) < tol * 10 * max(int(fin.sum()), 1), "lse differs"
    assert float(out[~fin].abs().sum()) == 0, "empty rows must give out 0"


def _batch(lens, H, R, P, PS, dtype, gen):
    import torch

    from mla_compile import paged

    ckv = [torch.randn(n, R, generator=gen).to(dtype) for n in lens]
    kpe = [torch.randn(n, P, generator=gen).to(dtype) for n in lens]
    batch = paged.fill_paged(ckv, kpe, PS, shuffle=True, spare_pages=2, generator=gen)  # unused slots: NaN
    q_nope = torch.randn(len(lens), H, R, generator=gen).to(dtype)
    q_pe = torch.randn(len(lens), H, P, generator=gen).to(dtype)
    return batch, q_nope, q_pe


def _check_decode(H, R, P, PS, dtype, lens, splits, tol, tma=False, **cfg_kw):
    import torch

    import reference as ref
    from mla_compile.kernels import decode as K

    gen = torch.Generator().manual_seed(H * 7 + PS)
    bt, qn, qp = _batch(lens, H, R, P, PS, dtype, gen)
    scale = (R + P) ** -0.5
    want = ref.ref_decode(qn, qp, bt.ckv_cache, bt.kpe_cache, bt.block_table, bt.seq_lens, scale)
    for ns in splits:
        cfg = K.DecodeConfig(**{"block_h": 16, "block_n": 16, **cfg_kw}, tma=tma)
        assert K.tma_eligible(bt.ckv_cache, bt.kpe_cache, False, cfg) == tma
        out, lse = K.decode(qn, qp, bt.ckv_cache, bt.kpe_cache, bt.block_table, bt.seq_lens, scale, cfg=cfg, splits=ns)
        assert out.dtype == dtype and lse.dtype == torch.float32
        _check_attention(out, lse, *want, tol)


def check_decode():
    import torch

    # bf16, two head blocks (H=20 > BLOCK_H 16, masked tail), page sizes 1 and 16, a 0-length row, 1 and 3 splits
    _check_decode(20, 32, 16, 16, torch.bfloat16, [37, 0, 5], [1, 3], 2e-2)
    _check_decode(4, 32, 16, 1, torch.float16, [9, 3], [2], 5e-3)


def check_decode_tma():
    import torch

    # the TMA kernel: full tiles by descriptor, the partial tail by masked loads (unused slots hold NaN);
    # page 16 = one tile per page, page 32 = two; lengths on and off tile edges, a 0-length row
    _check_decode(20, 64, 16, 16, torch.bfloat16, [37, 0, 5, 48], [1, 3], 2e-2, tma=True)
    _check_decode(4, 32, 16, 32, torch.float32, [70, 16, 1], [1, 2], 1e-5, tma=True)


def check_decode_multi_token():
    """S query tokens per request folded into the kernel's rows (n_query): S 1..4, H 1 and 16, ragged lengths
    including ones below S (the early rows' limits <= 0: (0, -inf)) and 0, the causal [B] lengths and a [B, S]
    limits table, the default multi-token tiling (up to 64 rows a program; 3 splits) and 16-row blocks splitting a
    request's rows (each block its own token range; 1 split), fp32 (page 4) and bf16 (page 1) by turns."""
    import torch

    import reference as ref
    from mla_compile.kernels import decode as K

    R, P = 32, 16
    for S in (1, 2, 3, 4):
        for H in (1, 16):
            for PS, dtype, tol in [((4, torch.float32, 1e-5), (1, torch.bfloat16, 2e-2))[(S + H) % 2]]:
                gen = torch.Generator().manual_seed(S * 31 + H + PS)
                lens = [S + 37, 0, S, 1, 70 + S]  # 1 < S: rows 0 .. S-2 see nothing
                bt, qn, qp = _batch(lens, S * H, R, P, PS, dtype, gen)
                q4, p4 = qn.view(len(lens), S, H, R), qp.view(len(lens), S, H, P)
                lim = torch.tensor([[0, 5, 9, 40][:S], [0] * S, [1] * S, [0] * (S - 1) + [1], [3, 3, 50, 70][:S]],
                                   dtype=torch.int32)
                lim = torch.minimum(lim.cummax(1).values, bt.seq_lens[:, None])  # non-decreasing, within each request
                for lens_arg in (bt.seq_lens, lim):
                    want = ref.ref_decode_multi(q4, p4, bt.ckv_cache, bt.kpe_cache, bt.block_table, lens_arg, 0.2)
                    cfgs = [None] + ([K.DecodeConfig(block_h=16, block_n=16)] if S * H > 16 else [])
                    for cfg, ns in zip(cfgs, (3, 1)):
                        kw = dict(n_query=S) if S > 1 else {}
                        if S == 1 and lens_arg.dim() == 2:
                            lens_arg = lens_arg[:, 0].contiguous()
                        out, lse = K.decode(qn, qp, bt.ckv_cache, bt.kpe_cache, bt.block_table, lens_arg, 0.2,
                                            cfg=cfg, splits=ns, **kw)
                        assert out.shape == qn.shape and lse.shape == qn.shape[:2]
                        _check_attention(out.view_as(q4), lse.view(q4.shape[:-1]), *want, tol)


def check_decode_strided_q():
    import torch

    import reference as ref
    from mla_compile.kernels import decode as K

    # q as the HF pass hands it over: q_nope a transposed bmm output [H, B, R] -> [B, H, R], q_pe a slice of the
    # query's last dim; both kernels (pointer: page 1, TMA: page 16)
    gen = torch.Generator().manual_seed(5)
    for PS, tma in ((1, False), (16, True)):
        bt, _, _ = _batch([37, 0, 20], 20, 64, 16, PS, torch.float32, gen)
        qn = torch.randn(20, 3, 64, generator=gen).transpose(0, 1)
        qp = torch.randn(3, 20, 48, generator=gen)[..., 32:48]
        assert not qn.is_contiguous() and not qp.is_contiguous()
        want = ref.ref_decode(qn, qp, bt.ckv_cache, bt.kpe_cache, bt.block_table, bt.seq_lens, 0.1)
        cfg = K.DecodeConfig(block_h=16, block_n=16, tma=tma)
        assert K.tma_eligible(bt.ckv_cache, bt.kpe_cache, False, cfg) == tma
        out, lse = K.decode(qn, qp, bt.ckv_cache, bt.kpe_cache, bt.block_table, bt.seq_lens, 0.1, cfg=cfg, splits=2)
        _check_attention(out, lse, *want, 1e-5)
        assert out.is_contiguous()
        # lengths as a column of a wider tensor and a column-major table (what a flexible_layout op may get)
        lens = torch.stack([bt.seq_lens, bt.seq_lens + 7], 1)[:, 0]
        table = bt.block_table.T.contiguous().T
        assert lens.stride(0) != 1 and table.stride(-1) != 1
        out, lse = K.decode(qn, qp, bt.ckv_cache, bt.kpe_cache, table, lens, 0.1, cfg=cfg, splits=2)
        _check_attention(out, lse, *want, 1e-5)


def check_split_launch_merging_itself():
    """The Triton pointer kernel merging its own splits in one launch (kernels/merge.py; what eager calls on the
    default stream take): bitwise the two-launch result (the same merge code), float64's within tolerance, for
    paged decode (two head blocks, a 0-length request, page 1 and 16), several query tokens (a limits table) and
    sparse index lists (a row with no valid slot), with counters allocated per call (True) and from the default
    stream's scratch (None, the scratch made to think it is on that stream): those counters are all zero after
    every call, and a second call on the same buffer is right again."""
    import torch

    import reference as ref
    from mla_compile.kernels import _launch, scratch
    from mla_compile.kernels import decode as K
    from mla_compile.ops.attention import token_slots

    scratch._stream = lambda index: 0  # the default stream: Scratch hands out its buffer and counters
    made = scratch.Scratch.__init__

    def on_device_0(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.index = 0

    scratch.Scratch.__init__ = on_device_0
    launched, bound_call = [], _launch.Bound.__call__

    def recording(self, *args):
        launched.append(self.fast.jit_function.fn.__name__)
        return bound_call(self, *args)

    _launch.Bound.__call__ = recording
    try:
        gen = torch.Generator().manual_seed(11)
        cfg = K.DecodeConfig(block_h=16, block_n=16)
        cases = []
        for PS, dtype, tol in ((1, torch.float32, 1e-5), (16, torch.bfloat16, 2e-2)):
            bt, qn, qp = _batch([37, 0, 50], 20, 32, 16, PS, dtype, gen)
            want = ref.ref_decode(qn, qp, bt.ckv_cache, bt.kpe_cache, bt.block_table, bt.seq_lens, 0.2)
            cases.append((lambda m, bt=bt, qn=qn, qp=qp: K.decode(qn, qp, bt.ckv_cache, bt.kpe_cache, bt.block_table,
                                                                   bt.seq_lens, 0.2, cfg=cfg, splits=3,
                                                                   merge_in_kernel=m), want, tol, lambda o: o))
        S, H = 2, 8
        bt, qn, qp = _batch([41, 2, 30], S * H, 32, 16, 4, torch.float32, gen)
        lim = torch.tensor([[20, 41], [0, 2], [30, 30]], dtype=torch.int32)
        q4, p4 = qn.view(3, S, H, 32), qp.view(3, S, H, 16)
        want = ref.ref_decode_multi(q4, p4, bt.ckv_cache, bt.kpe_cache, bt.block_table, lim, 0.2)
        cases.append((lambda m: K.decode(qn, qp, bt.ckv_cache, bt.kpe_cache, bt.block_table, lim, 0.2, splits=3,
                                         n_query=S, merge_in_kernel=m), want, 1e-5, lambda o: o.view(q4.shape[:-1] +
                                                                                                     o.shape[-1:])
                      if o.dim() == 3 else o.view(q4.shape[:-1])))
        bt2, qn2, qp2 = _batch([40, 30], 4, 32, 16, 8, torch.float32, gen)
        idx = torch.full((2, 24), -1, dtype=torch.int32)
        idx[0, ::2] = token_slots(bt2.block_table, 8, 40)[0, torch.randperm(40, generator=gen)[:12]].int()
        want = ref.ref_sparse_decode(qn2, qp2, bt2.ckv_cache, bt2.kpe_cache, idx, 0.2)
        cases.append((lambda m: K.sparse_decode(qn2, qp2, bt2.ckv_cache, bt2.kpe_cache, idx, 0.2, cfg=cfg, splits=2,
                                                merge_in_kernel=m), want, 1e-5, lambda o: o))
        for call, want, tol, shaped in cases:
            launched.clear()
            two = call(False)
            assert launched[-1] == "_merge_kernel" and len(launched) == 2, launched
            for mode in (True, None, None):
                launched.clear()
                out, lse = call(mode)
                assert launched == ["_stage1_merged_kernel"], launched
                assert torch.equal(out, two[0]) and torch.equal(lse, two[1]), f"merge_in_kernel={mode}: not bitwise"
                _check_attention(shaped(out), shaped(lse), *want, tol)
                if mode is None:
                    counters = scratch._local.buffers[0].counters
                    assert counters is not None and not counters.any(), "counters left non-zero"
    finally:
        _launch.Bound.__call__ = bound_call
        scratch.Scratch.__init__ = made
        scratch._stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def check_decode_fp32_odd_dims():
    import torch

    _check_decode(3, 24, 8, 5, torch.float32, [11, 0, 20], [1, 4], 1e-5)  # R, P not powers of two, PS 5


def check_sparse_decode():
    import torch

    import reference as ref
    from mla_compile.kernels import decode as K

    gen = torch.Generator().manual_seed(3)
    bt, qn, qp = _batch([40, 30], 4, 32, 16, 8, torch.float32, gen)
    # per request: a few of its own slots, -1 holes, and one row with no valid slot
    idx = torch.full((2, 24), -1, dtype=torch.int32)
    from mla_compile.ops.attention import token_slots

    slots = token_slots(bt.block_table, 8, 40)
    idx[0, ::2] = slots[0, torch.randperm(40, generator=gen)[:12]].int()
    scale = 0.2
    want = ref.ref_sparse_decode(qn, qp, bt.ckv_cache, bt.kpe_cache, idx, scale)
    for ns in (1, 2):
        out, lse = K.sparse_decode(qn, qp, bt.ckv_cache, bt.kpe_cache, idx, scale,
                                   cfg=K.DecodeConfig(block_h=16, block_n=16), splits=ns)
        _check_attention(out, lse, *want, 1e-5)


def check_flashmla_empty_rows():
    """The rows of requests with seq_len 0 become (0, -inf) in place; every other row untouched, a +inf lse of
    a non-empty row (FlashMLA's NaN row) and NaN outs included."""
    import torch

    from mla_compile.kernels import flashmla as K

    gen = torch.Generator().manual_seed(6)
    for B, H, R, dtype in [(3, 16, 512, torch.bfloat16), (5, 7, 40, torch.float32), (9, 5, 512, torch.float16)]:
        out = torch.randn(B, H, R, generator=gen).to(dtype)
        lse = torch.randn(B, H, generator=gen)
        seq_lens = torch.randint(1, 50, (B,), generator=gen, dtype=torch.int32)
        seq_lens[::2] = 0  # empty requests across program boundaries (16 rows a program)
        lse[seq_lens == 0] = float("inf")
        lse[1, 0], out[1, 0] = float("inf"), float("nan")  # a non-empty row FlashMLA found NaN in: stays
        out[0, 1:3] = float("nan")  # an empty row's output is overwritten, never read
        empty = (seq_lens == 0)[:, None].expand(B, H)
        want_out = torch.where(empty[..., None], torch.zeros((), dtype=dtype), out)
        want_lse = torch.where(empty, float("-inf"), lse)
        K.empty_rows_to_contract(out, lse, seq_lens)
        assert torch.equal(out.isnan(), want_out.isnan()) and torch.equal(out.nan_to_num(), want_out.nan_to_num())
        assert torch.equal(lse, want_lse)


def check_flashmla_fp8_slots():
    """kernels/flashmla_fp8.py's two kernels: each request's token slots as an index list (-1 past its length,
    garbage table entries past its pages never read) against the plain-torch definition; rows with lse +inf
    become (0, -inf) in place, every other row untouched."""
    import torch

    import reference as ref
    from mla_compile.kernels import flashmla as FM
    from mla_compile.kernels import flashmla_fp8 as K

    gen = torch.Generator().manual_seed(7)
    for lens, PS in [([0, 1, 63, 64, 65, 300], 64), ([5, 0, 2000], 1), ([17, 40], 16)]:
        _, _, table, seq_lens, _ = ref.build_paged(lens, PS, (8, 2), generator=gen, extra_cols=2)
        got = K.token_slots(table, seq_lens, PS)
        width = -(-table.shape[1] * PS // 64) * 64  # whole 64-entry blocks
        assert got.shape == (len(lens), 1, width) and got.dtype == torch.int32
        for b, n in enumerate(lens):
            assert got[b, 0, :n].tolist() == ref.request_slots(table, PS, b, n), (lens, PS, b)
            assert bool((got[b, 0, n:] == -1).all())
    for B, H, dtype in [(3, 64, torch.bfloat16), (2, 128, torch.bfloat16)]:
        out = torch.randn(B, H, 512, generator=gen).to(dtype)
        lse = torch.randn(B, H, generator=gen)
        lse[0], lse[1, 5:40] = float("inf"), float("inf")
        out[0, :3] = float("nan")  # an empty row's output is overwritten, never read
        want_out = torch.where((lse == float("inf"))[..., None], torch.zeros((), dtype=dtype), out)
        want_lse = torch.where(lse == float("inf"), float("-inf"), lse)
        FM.empty_rows_to_contract(out, lse)  # no lengths: the rows FlashMLA gave lse +inf
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def check_merge_states():
    import torch

    import reference as ref
    from mla_compile.kernels import merge as K

    gen = torch.Generator().manual_seed(5)
    N, B, H, R = 5, 3, 2, 40
    outs = torch.randn(N, B, H, R, generator=gen)
    lses = torch.randn(N, B, H, generator=gen) * 3
    lses[1, 0, 0], lses[2, 0, 0], lses[3, 0, 0] = float("-inf"), float("nan"), float("inf")
    outs[1:4, 0, 0] = float("nan")  # parts that must weigh exactly 0
    lses[:, 1, 1] = float("-inf")  # all empty
    outs[:, 1, 1] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = K.merge_states(outs.to(dtype), lses)
        want_o, want_l = ref.ref_merge(outs.to(dtype), lses)
        _check_attention(out, lse, want_o, want_l, 1e-5 if dtype == torch.float32 else 1e-2)
    # more parts than one tile holds: the two-pass path
    outs = torch.randn(200, 1, 2, 8, generator=gen)
    lses = torch.randn(200, 1, 2, generator=gen)
    lses[::7] = float("nan")
    outs[::7] = float("nan")
    out, lse = K.merge_states(outs, lses)
    _check_attention(out, lse, *ref.ref_merge(outs, lses), 1e-5)


def check_cache_write():
    import torch

    from mla_compile.kernels import cache as K

    gen = torch.Generator().manual_seed(6)
    ckv_cache = torch.randn(4, 3, 20, generator=gen)
    kpe_cache = torch.randn(4, 3, 6, generator=gen)
    ckv, kpe = torch.randn(5, 20, generator=gen), torch.randn(5, 6, generator=gen)
    slots = torch.tensor([7, -1, 0, 11, -1], dtype=torch.int64)
    want_c, want_k = ckv_cache.clone(), kpe_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_c.view(-1, 20)[s] = ckv[t]
            want_k.view(-1, 6)[s] = kpe[t]
    K.cache_write(ckv_cache, kpe_cache, ckv, kpe, slots)
    assert torch.equal(ckv_cache, want_c) and torch.equal(kpe_cache, want_k)


def check_fp8_write():
    """The FP8 cache write's in-kernel quantization (kernels/cache.py `_e4m3_bits`, `_quantize_row`): the e4m3 byte of
    every e4m3 value, of every midpoint between neighbours and of the floats either side of it (ties to even),
    zeros, NaN and random values, as torch's cast gives it; then whole writes (R 128 and 384: a masked fourth group;
    rows of zeros, of subnormal-range values, strided rows, skipped slots; bf16 and fp32 rope) byte for byte as
    `fp8.quantize` + scatter, through the three views (`cache_write_fp8_plan`) and into the token buffer itself
    (`cache_write_fp8_tokens_plan`: the scales' and rope's addresses taken in the kernel); each with amax / 448 and
    with power-of-two ("ue8m0") scales (groups whose amax / 448 is a power of two, just above one, under the 1e-4
    floor)."""
    import torch
    import triton
    import triton.language as tl

    from mla_compile import fp8
    from mla_compile.kernels import cache as K

    globals()["_e4m3_bits"] = K._e4m3_bits  # a jit function resolves the names it calls among its module's globals

    @triton.jit
    def encode(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, _e4m3_bits(tl.load(X + offs, mask=offs < N, other=0.0)).to(tl.int32), mask=offs < N)  # noqa: F821

    gen = torch.Generator().manual_seed(11)
    e = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e = e[torch.isfinite(e)].sort().values
    mid = (e[1:] + e[:-1]) / 2
    x = torch.cat([e, mid, torch.nextafter(mid, torch.full_like(mid, 1e9)), torch.nextafter(mid, -torch.full_like(
        mid, 1e9)), torch.tensor([0.0, -0.0, float("nan"), -float("nan"), 1e-30, -2.0 ** -149]),
        (torch.rand(20000, generator=gen) * 2 - 1) * 448,
        torch.randn(20000, generator=gen) * 2.0 ** torch.randint(-20, 8, (20000,), generator=gen).float()])
    x = torch.where(torch.isnan(x), x, x.clamp(-448, 448))
    y = torch.empty(x.shape, dtype=torch.int32)
    encode[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8).int()
    assert torch.equal(y, want), f"{int((y != want).sum())} of {x.numel()} bytes differ"

    for R, P, rope in ((128, 16, torch.bfloat16), (384, 64, torch.bfloat16), (256, 8, torch.float32)):
        rows = torch.randn(6, R, generator=gen) * 3
        rows[1] = 0  # amax 0: scale 1
        rows[2] *= 1e-4  # values in e4m3's subnormal range after scaling by a larger group's amax
        rows[2, :5] = 7.0
        rows[3, :128] *= 56 / rows[3, :128].abs().max()  # amax / 448 = 2^-3 exactly
        rows[5, :128] *= 56.4375 / rows[5, :128].abs().max()  # just above it (a bf16 value)
        rows[5, 128:] *= 0.001  # amax / 448 under the 1e-4 floor
        ckv = rows.to(torch.bfloat16).t().contiguous().t()  # a strided [T, R] (column-major): the copy path
        kpe = torch.randn(6, P, generator=gen).to(rope)
        slots = torch.tensor([3, -1, 20, 9, -1, 0])
        for scale_fmt in (None, fp8.UE8M0):
            buf = fp8.allocate(4, 8, R, P, torch.device("cpu"), rope)[0]
            ref, views, tokens = buf.zero_().clone(), buf.zero_().clone(), buf.zero_().clone()
            rc, rs, rk = fp8.views(ref, R, rope)
            q, scales = fp8.quantize(ckv, scale_fmt)
            for t, slot in enumerate(slots.tolist()):
                if slot >= 0:
                    rc.view(-1, R)[slot], rs.view(-1, R // 128)[slot], rk.view(-1, P)[slot] = q[t], scales[t], kpe[t]
            c8, sc, kp = fp8.views(views, R, rope)
            K.cache_write_fp8_plan(c8, kp, sc, ckv, kpe, slots, scale_fmt)(c8, kp, sc, ckv, kpe, slots)
            assert torch.equal(views, ref), f"R {R} {scale_fmt}: {int((views != ref).sum())} bytes differ (views)"
            K.cache_write_fp8_tokens_plan(tokens, ckv, kpe, slots, scale_fmt)(tokens, ckv, kpe, slots)
            assert torch.equal(tokens, ref), f"R {R} {scale_fmt}: {int((tokens != ref).sum())} bytes differ (tokens)"


def check_indexer_topk():
    import torch

    import reference as ref
    from mla_compile.kernels import dsa as K

    gen = torch.Generator().manual_seed(8)
    B, Hi, Di, PS = 3, 4, 16, 4
    lens = [13, 0, 6]
    keys = [torch.randn(n, Di, generator=gen) for n in lens]
    from mla_compile import paged

    bt = paged.fill_paged(keys, keys, PS, shuffle=True, spare_pages=1, generator=gen)
    q = torch.randn(B, Hi, Di, generator=gen)
    w = torch.randn(B, Hi, generator=gen)
    for topk in (4, 10):
        got = K.indexer_topk(q, w, bt.ckv_cache, bt.block_table, bt.seq_lens, topk, 0.3)
        assert got.shape == (B, topk) and got.dtype == torch.int32
        for b in range(B):
            slots, scores = ref.ref_indexer_scores(q, w, bt.ckv_cache, bt.block_table, bt.seq_lens, 0.3, b)
            k = min(topk, len(slots))
            picked = got[b, :k].tolist()
            assert got[b, k:].eq(-1).all(), "entries beyond min(topk, len) must be -1"
            assert len(set(picked)) == k and set(picked) <= set(slots), "picked slots must be the request's own"
            mine = torch.tensor([float(scores[slots.index(s)]) for s in picked], dtype=torch.float64)
            best = torch.sort(scores, descending=True).values[:k]
            mine = torch.sort(mine, descending=True).values  # short rows come in token order
            assert torch.allclose(mine, best, atol=1e-4), "picked tokens are not the top-k by score"
            if len(slots) <= topk:  # fits in topk: logits skipped, identity (token-order) slots
                assert picked == ref.request_slots(bt.block_table, PS, b, len(slots)), "short row not identity"
    # mixed batch: the short row's logits are skipped, so a NaN query cannot disturb it
    q_poisoned = q.clone()
    q_poisoned[2] = float("nan")
    got = K.indexer_topk(q_poisoned, w, bt.ckv_cache, bt.block_table, bt.seq_lens, 10, 0.3)
    assert got[2].tolist() == ref.request_slots(bt.block_table, PS, 2, 6) + [-1] * 4, "short row read its logits"


def check_k_only_indices():
    import torch

    import reference as ref
    from mla_compile import paged
    from mla_compile.kernels import dsa as K

    gen = torch.Generator().manual_seed(9)
    table, _ = paged.make_block_table([5, 0, 12], 4, max_pages=4, generator=gen)
    lens = torch.tensor([5, 0, 12], dtype=torch.int32)
    for topk in (12, 20):
        assert torch.equal(K.k_only_indices(table, lens, 4, topk), ref.ref_k_only(table, lens, 4, topk))


def check_fused_linear():
    import torch

    from mla_compile.kernels.linear import LinearConfig, linear_small_m

    gen = torch.Generator().manual_seed(5)
    # (M, K, weight rows, config): a pair and a single weight; K on and off the K step (masked tail); row
    # counts off the row block; 1 and 16 tokens; a transposed (strided) x and weight
    cases = [(8, 96, [40, 24], LinearConfig(16, 32, 4, 2)), (1, 70, [17], LinearConfig(16, 32, 4, 2)),
             (16, 64, [16, 33], LinearConfig(32, 64, 4, 3)),
             # split K: fp32 partials + the summing launch; 3 splits of 32 over K=96, 2 over K=70 (short last)
             (8, 96, [40, 24], LinearConfig(16, 32, 4, 2, split_k=3)), (3, 70, [17], LinearConfig(16, 32, 4, 2, 2))]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for M, K, Ns, cfg in cases:
            x = torch.randn(M, K, generator=gen).to(dtype)
            ws = [torch.randn(N, K, generator=gen).to(dtype) for N in Ns]
            # split K both ways: summed by a second launch, and by each row block's last program (counters)
            for summed in (False, True) if cfg.split_k > 1 else (None,):
                for y, w in zip(linear_small_m(x, ws, cfg, sum_in_kernel=summed), ws):
                    want = x.double() @ w.double().T
                    assert y.dtype == dtype and y.shape == want.shape
                    assert _rel(y, want) < tol, (f"M={M} K={K} N={w.shape[0]} {dtype} summed={summed}: rel err "
                                                 f"{_rel(y, want):.2e}")
        for M, K, Ns in ((0, 32, [8, 4]), (4, 0, [8])):  # empty x, empty K: no launch, zeros
            ys = linear_small_m(torch.randn(M, K).to(dtype), [torch.randn(N, K).to(dtype) for N in Ns])
            assert [tuple(y.shape) for y in ys] == [(M, N) for N in Ns] and all(not y.any() for y in ys)
        xt = torch.randn(40, 6, generator=gen).to(dtype).T  # [6, 40], strides (1, 6)
        wt = torch.randn(40, 24, generator=gen).to(dtype).T  # [24, 40]
        (y,) = linear_small_m(xt, [wt], LinearConfig(16, 16, 4, 2))
        assert _rel(y, xt.double() @ wt.double().T) < tol, "strided x / weight"
    # the op's plans (kernels/dispatch.py): a flat x with one pair is the pair's plan itself; three weights (two
    # launches); x [B, S, K] viewed back to its lead dims; a K long enough to split (default config)
    from mla_compile.kernels import dispatch

    for lead, K, Ns in (((2,), 64, [24, 40]), ((3,), 48, [8, 16, 24]), ((2, 2), 64, [16, 8]), ((1,), 2048, [96, 32])):
        x = torch.randn(*lead, K, generator=gen).to(torch.bfloat16)
        ws = [torch.randn(N, K, generator=gen).to(torch.bfloat16) for N in Ns]
        plan, keep = dispatch.fused_linear_plan(x, ws)
        for _ in range(2):  # a plan serves every call of its signature
            ys = plan(x, *ws)
            assert keep and len(ys) == len(ws)
            for y, w in zip(ys, ws):
                want = x.double() @ w.double().T
                assert y.shape == want.shape and _rel(y, want) < 2e-2, f"lead {lead} K {K} N {w.shape[0]}"


def check_linear_partials():
    import torch

    from mla_compile.kernels.linear import LinearConfig, linear_partials
    from mla_compile.ops.linear import K_ALIGN, split_ranges

    gen = torch.Generator().manual_seed(6)
    # K 300 in 4 splits of 128: the third short (44), the fourth empty (zeros); a pair, a single weight, three
    # weights (two launches into one buffer); K on the 128 grid with 2 splits; 1 and 16 rows
    cases = [(8, 300, [40, 24], 4), (1, 300, [17], 4), (16, 256, [16, 33, 8], 2), (5, 130, [9, 9], 1)]
    for dtype in (torch.float32, torch.bfloat16):
        for M, K, Ns, splits in cases:
            x = torch.randn(M, K, generator=gen).to(dtype)
            ws = [torch.randn(N, K, generator=gen).to(dtype) for N in Ns]
            p = linear_partials(x, ws, splits, LinearConfig(16, 32, 4, 2), align=K_ALIGN)
            W = torch.cat(ws).double()
            assert p.dtype == torch.float32 and p.shape == (splits, M, W.shape[0])
            for s, (lo, hi) in enumerate(split_ranges(K, splits)):
                want = x[:, lo:hi].double() @ W[:, lo:hi].T
                if lo == hi:
                    assert not p[s].any(), f"empty split {s} is not zero"
                else:
                    assert _rel(p[s], want) < 1e-5, f"M={M} K={K} split {s} {dtype}: rel err {_rel(p[s], want):.2e}"


def check_per_head_linear():
    import torch

    from mla_compile.kernels.linear import per_head_linear

    gen = torch.Generator().manual_seed(8)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        # (M, H, K, N, block_n): W_UV-like (K on the 128 grid), W_UK-like (transposed weight view), a masked K tail,
        # rows off the row block, 1 and 16 tokens
        for M, H, K, N, block_n in ((8, 3, 256, 40, 32), (1, 2, 70, 17, 16), (16, 2, 128, 64, 16)):
            q = torch.randn(M, 1, H * (K + 24), generator=gen).to(dtype)  # x as HF's strided q_nope view
            x = q.view(M, H, K + 24)[:, :, :K]
            for w in (torch.randn(H, N, K, generator=gen).to(dtype),
                      torch.randn(H, K, N, generator=gen).to(dtype).transpose(1, 2)):
                y = per_head_linear(x, w, block_n=block_n)
                want = torch.einsum("bhk,hnk->bhn", x.double(), w.double())
                assert y.shape == (M, H, N) and y.is_contiguous() and y.dtype == dtype
                assert _rel(y, want) < tol, f"M={M} H={H} K={K} N={N} {dtype}: rel err {_rel(y, want):.2e}"
        y = per_head_linear(torch.randn(4, 2, 0).to(dtype), torch.randn(2, 5, 0).to(dtype))
        assert y.shape == (4, 2, 5) and not y.any()


def _patch_interpreter_for_numpy2():
    """mla_compile.kernels._util applies it on import under TRITON_INTERPRET=1; kept callable for the modules that
    import triton's interpreter before ours."""
    from mla_compile.kernels._util import patch_interpreter_for_numpy2

    patch_interpreter_for_numpy2()


def run_checks(namespace: dict, checks, tb_limit: int = 6) -> None:
    """In an interpreter child: run namespace["check_<name>"] for every name, print one VERDICT line (every check
    reported, not just the first failure)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import traceback

    _patch_interpreter_for_numpy2()

    import torch

    torch.set_num_threads(1)
    verdict = {}
    for name in checks:
        try:
            namespace["check_" + name]()
            verdict[name] = "ok"
        except Exception:
            verdict[name] = traceback.format_exc(limit=tb_limit)[-4000:]
    print("VERDICT " + json.dumps(verdict), flush=True)


def _child():
    run_checks(globals(), CHECKS)


if __name__ == "__main__":
    _child()
