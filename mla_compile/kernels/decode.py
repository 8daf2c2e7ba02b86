"""Split-KV absorbed-MLA decode in Triton: `mla::decode` (paged) and `mla::sparse_decode` (index list).

Stage 1 (decode_stage1.py): one program per (request, block of BLOCK_H heads, KV split). The latent tile
[BLOCK_N, R] is loaded once and used by every head of the block for both products (q.ckv^T and p.ckv), which is
what makes MLA decode cheap: all heads share one KV head. Each split writes its normalised partial out and its
natural-log lse (-inf when the split holds no token).
Stage 2: the fused merge kernel of `merge.py` over the split axis (the same math as `mla::merge_states`).
With one split, stage 1 writes the final out/lse directly and stage 2 is skipped.

No host sync: the number of splits depends only on shapes (batch, heads, block-table capacity, SM count);
each program reads its request's length from device memory and computes its own token range, so a
captured CUDA graph stays valid when seq_lens change.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ._util import block, box_width, caches_view_as_slots, cdiv, has_tma, sm_count
from .decode_stage1 import _stage1_kernel, _stage1_merged_kernel, _stage1_tma_kernel  # noqa: F401 (benchmarks, tests)
from .stage1_launch import (_launch_pointer, _launch_tma, _pointer_stage1, _tma_stage1,  # noqa: F401 (benchmarks)
                            fp8_constexprs, pointer_constexprs, tma_constexprs)
from . import decode_fp8 as _fp8
from . import decode_fp8_swapab as _fp8_swapab
from . import decode_seesaw as _seesaw
from . import decode_swapab as _swapab
from . import decode_wgmma as _wgmma
from .scratch import Scratch, empty_maker
from .merge import merge_bound, merge_into, one_pass_parts  # noqa: F401 (merge_into: benchmarks time the stages apart)

@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Stage-1 tiling and split policy. `ctas_per_sm` sets how many stage-1 programs the split count aims for."""

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    ctas_per_sm: int = 2
    max_splits: int = 128
    min_split_tokens: int = 64
    tma: bool = False  # full tiles by TMA boxes where the layout allows (see tma_eligible)
    # the stage-1 kernel: "triton" (this file's, `tma` choosing its tiles), "wgmma" (decode_wgmma.py) or "seesaw"
    # (decode_seesaw.py), the Gluon many-head kernels, "swapab" (decode_swapab.py, few heads, tokens as the MMA's
    # M), or "fp8_swapab" (decode_fp8_swapab.py, an FP8 cache).
    # `dispatch.select_decode_kernel` chooses it for the call's shapes, device and layout; it is not re-checked here
    kernel: str = "triton"


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def default_config(H: int, R: int, page_size: int, dtype: torch.dtype = torch.bfloat16) -> DecodeConfig:
    """From H200 sweeps (benchmarks/decode_sweep.py, round JSON at commit 20a0395; RESULTS.md): many heads
    take the TMA kernel where the layout allows it, few heads the pointer kernel at every page size. The pointer
    kernel gets one more stage when a tile spans pages (a page-1 token table, page 16): its addresses then come
    from a per-token table load that the next tile's copy waits on (page 1, H=16: 2 stages 20% slower than 3).

    fp32 operands (twice the bytes of the tuned half-precision tiles) take the pointer kernel at 32 rows x 16 tokens:
    the half-precision tiling needs 396-432 KB of shared memory in fp32 at 64 rows (the H200 has 227 KB; it failed
    there with OutOfResources) and spills at 16 rows; the fp32 tiling builds in 88-124 KB with no spill (sm_90a,
    tools/aot.py; tests/kernels/test_kernel_codegen.py guards it)."""
    if dtype == torch.float32:
        return multi_token_config(H, page_size, dtype)
    stages = 2 if page_size % 64 == 0 else 3  # both configs use 64-token tiles
    if H >= 64 and R <= 512:
        # many heads (compute-bound): a 64-row tile reaches Hopper's warpgroup MMA and reads each KV tile for
        # 64 heads at once; TMA h64n64w8s2 253-279 TFLOP/s vs 206-215 for the pointer kernel (3 stages there:
        # 2-5% ahead of 2)
        # On an H200 the Gluon kernels take these shapes where they can (dispatch.select_decode_kernel); this
        # config is the Triton fallback (another GPU, no Gluon) and the split policy they share
        return DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=stages, ctas_per_sm=1, tma=True)
    # few heads (bandwidth-bound): the pointer kernel (16-byte async copies, ~220 registers, no spills) with
    # 64-token tiles: 0.79-0.92 of copy bandwidth at kv >= 32K vs 0.71-0.83 for the TMA kernel, whose q operand
    # spills (rounds 7-9); 256 splits: batch 1 at 128K 54 us. Page 64: 2 stages 1.5-6% ahead of 3.
    return DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=stages, max_splits=256)


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def multi_token_config(rows: int, page_size: int, dtype: torch.dtype = torch.bfloat16) -> DecodeConfig:
    """S > 1 query tokens per request (rows = S * H): the pointer kernel with up to 64 rows per program, so a KV tile
    is loaded once for all S tokens of up to 64 rows (H 16: S <= 4 in one program). The Gluon / TMA many-head
    kernels take one query token per request only. Sized from the sm_90a builds (tools/aot.py, R 512 / P 64):
    rows past 16 double the accumulator and q, so 8 warps keep them in registers (32 rows: 194 registers, 112 KB
    shared); 64 rows with 64-token tiles need 216-221 KB of shared memory (at the H200's 227 KB limit) and spill,
    32-token tiles 144 KB and no spill. fp32 operands (twice the bytes) stay at 32 rows and 16-token tiles (124 KB)."""
    if dtype == torch.float32:
        block_h = min(32, block(rows))
        return DecodeConfig(block_h=block_h, block_n=16, num_warps=4 if block_h <= 16 else 8, num_stages=2,
                            max_splits=256)
    block_h = min(64, block(rows))
    stages = 2 if page_size % 64 == 0 else 3
    if block_h <= 16:
        return DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=stages, max_splits=256)
    if block_h == 32:
        return DecodeConfig(block_h=32, block_n=64, num_warps=8, num_stages=stages, max_splits=256)
    return DecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=3, ctas_per_sm=1, max_splits=256)


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def fp8_config(rows: int, page_size: int, dtype: torch.dtype = torch.bfloat16, multi: bool = False,
               R: int = 512) -> DecodeConfig:
    """An FP8 latent cache (`multi`: S > 1 query tokens, rows = S * H). Sized from sm_90a builds (tools/aot.py,
    R 512 / P 64; tests/ops/test_fp8_cache.py guards them).

    bf16 / fp16 q (decode_fp8.py: scales folded into the products, fp16 MMAs, every tile an async copy). Timed
    (H200 2026-12-03, B 8-32 x 32K-128K, page 64, CUDA-graph replay): 16 rows x 64 tokens at 4 warps 171 / 627 us
    (B 8 / 32 at 32K) against 222 / 819 at 8 warps, though 4 warps spill 52-88 bytes there and 8 warps none
    (178-187 registers); at H 128, 32 rows x 32 tokens at 4 warps 858 us (B 8) against 1312 at 8 warps, 1047 for
    32 x 64 and 1161 for 16-row programs (each tile read 8 times); one page of 33408 tokens per request alike (168 /
    868 us at 4 warps, 234 / 1036 at 8). Token tables (page 1: what the HF pass hands every cache, DSAStaticCache's
    FP8 one too) and index lists take the 4-warp tilings as well, though they spill 100-220 bytes there: the HF
    step (H 16, B 8, 32K) took 1.37 ms with the 4-warp (bf16-MMA) kernel and 1.61 with the 8-warp fp16 one, whose
    stage 1 ran 329 us per call there against 168 at page 64 (H200 2026-12-03; the 4-warp fp16 kernel on token
    tables not yet timed). Several query tokens: 16 rows per program (32 rows spill 12 bytes at 8 warps).
    fp32 q (the pointer kernel dequantizing its tiles in registers, fp32 MMAs on the dequantized tile): 16 rows x
    16 tokens, 4 warps, 255 registers, 115 KB, no spill (32 rows spill 548-1820 bytes). R that is no multiple of
    128 or above 512 (the dequantizing kernel with q in half precision too): 32-token tiles (the float32
    dequantization of a tile doubles its registers), 16 rows at 4 warps (214-229 registers, 105 KB) or, for one
    query token, 32 rows at 8 warps (255 registers, 123 KB, no spill)."""
    if dtype == torch.float32:
        return DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2, max_splits=256)
    if _fp8.fits(R, dtype):
        if rows <= 16 or multi:
            return DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, max_splits=256)
        return DecodeConfig(block_h=32, block_n=32, num_warps=4, num_stages=2, max_splits=256)
    stages = 2 if page_size % 64 == 0 else 3
    if rows <= 16 or multi:
        return DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=stages, max_splits=256)
    return DecodeConfig(block_h=32, block_n=32, num_warps=8, num_stages=stages, max_splits=256)


def num_splits(batch: int, heads: int, capacity: int, device: torch.device, cfg: DecodeConfig,
               R: int = 512) -> int:
    """Splits from shapes only: as many as fit in one wave of `ctas_per_sm` programs per SM, never splits shorter
    than min_split_tokens. One wave, not more: H200 probe 2026-12-01 (benchmarks/RESULTS.md): H=16 B=32
    8 splits (256 programs) 88.9 / 310 us at 8K / 32K vs 98.5 / 318 for the ~2-wave 16; B=128 2 splits 316 vs
    4 323 at 8K; H=128 B=8 8 splits 269 / 1043 vs 16 279 / 1057 at 32K / 128K. The empty splits (a split is whole
    tiles) are dropped where they would cost the merge a second pass (B=1 H=128: 66 -> 64); B=8 H=16 keeps 33 (32
    filled), 35.4 us at 8K against 37.3 for 32 (H200 2026-12-03, one run)."""
    programs = max(batch * cdiv(heads, cfg.block_h), 1)
    sms = sm_count(device)
    cap = max(1, min(cdiv(max(capacity, 1), cfg.min_split_tokens), cfg.max_splits))
    ns = max(1, min(cfg.ctas_per_sm * sms // programs, cap))
    # the kernels round a split to whole tiles (`_split_range`, `_gluon.split_bounds`), so a request at full
    # capacity fills `filled` of them; past the merge's one-pass width the empty ones cost a second pass:
    # H 128 batch 1, 66 splits (64 filled) 24.3 / 42.3 us at 8K / 32K against 20.2 / 38.0 for 64 (H200 2026-12-03)
    split_len = cdiv(cdiv(max(capacity, 1), ns), cfg.block_n) * cfg.block_n
    filled = cdiv(max(capacity, 1), split_len)
    return filled if filled <= one_pass_parts(batch * heads, R, sms) < ns else ns


def tma_eligible(ckv_cache, kpe_cache, sparse: bool, cfg: DecodeConfig) -> bool:
    """The TMA kernel needs an sm_90+ GPU (or the interpreter), whole tiles inside a page, the latent in two
    power-of-two halves <= 256 wide (a TMA box side is at most 256), a power-of-two rope width, and caches
    that view as [slots, width]."""
    if sparse or not has_tma(ckv_cache.device):
        return False
    NP, PS, R = ckv_cache.shape
    P = kpe_cache.shape[2]
    return tma_tiles_fit(cfg, PS, R, P) and caches_view_as_slots(ckv_cache, kpe_cache)


def tma_tiles_fit(cfg: DecodeConfig, page_size: int, R: int, P: int) -> bool:
    """The shape half of `tma_eligible`: TMA asked for, whole tiles inside a page, boxes of powers of two <= 256."""
    return cfg.tma and page_size % cfg.block_n == 0 and R % 2 == 0 and box_width(R // 2) and box_width(P)


def _unit_inner_stride(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


class AttendPlan:
    """One decode call's work with everything its signature fixes decided once: the kernel, tiling and splits, the
    output and partial shapes, the launches bound to their grids and compile-time arguments and the numbers they
    take. Calling it runs the kernels on that call's tensors: the allocations, the stream and the launches only.

    The signature: the shapes, strides, dtypes and device of every tensor argument, whether each is 16-byte aligned
    (Triton specializes on it), the scalars, and the config asked for (the op's impl keys its plans on it,
    ops/attention.py; any other caller builds a plan per call, which costs what the unplanned path did).

    `merge_in_kernel`: a split call of the Triton pointer kernel or the swap-AB Gluon kernel merges its splits in the
    stage-1 launch itself (`_stage1_merged_kernel`, `decode_swapab._swapab_merged_kernel`: one launch, not two;
    kernels/merge.py) where zeroed counters are at hand (None: on the legacy default stream, kernels/scratch.py, so
    eager calls and default-mode compiled graphs; CUDA-graph capture and side streams keep the two launches, so graph
    replays are unchanged), always (True: zeroed counters allocated per call) or never (False). Either way only where
    the kernel has that build and the launch fits one wave (`merge.merge_work`, `decode_swapab.merged_plan`); the
    other stage-1 kernels, and calls past one wave, take two launches."""

    def __init__(self, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, indices, sm_scale, capacity,
                 cfg: DecodeConfig | None, splits: int | None, n_query: int = 1, ckv_scale=None, outer=None,
                 merge_in_kernel: bool | None = None):
        B, H, R = q_nope.shape  # H: rows per request (n_query * heads)
        self.device, self.out_shape, self.lse_shape = q_nope.device, q_nope.shape, (B, H)
        self.sparse, self.n_query = indices is not None, n_query
        self.empty = B * H == 0
        self.merged, self.merge_in_kernel = None, merge_in_kernel
        # the outputs: contiguous out in q's dtype, float32 lse (`scratch.empty_maker`: a template's empty_like), in
        # the caller's shape where q is a row-folded view (`outer`, [B, S, heads, R]: the same bytes, no view a call)
        out_shape = q_nope.shape if outer is None else outer
        self.fresh_out = empty_maker(out_shape, q_nope.dtype, q_nope.device)
        self.fresh_lse = empty_maker(out_shape[:-1], torch.float32, q_nope.device)
        if self.empty:
            self.run = self._runner()
            return
        # q is read with any batch/head strides; the ops are flexible_layout, so Inductor may also hand over strided
        # lengths / tables. The kernels need unit inner strides only: copy just what lacks them
        self.copies = any(t is not None and t.stride(-1) != 1 for t in (q_nope, q_pe, seq_lens, block_table,
                                                                         indices))
        q_nope, q_pe, seq_lens, block_table, indices = map(_unit_inner_stride, (q_nope, q_pe, seq_lens, block_table,
                                                                                 indices))
        for t, name in ((ckv_cache, "ckv_cache"), (kpe_cache, "kpe_cache"), (ckv_scale, "ckv_scale")):
            if t is not None and t.stride(-1) != 1:
                raise ValueError(f"{name}: last dim must be contiguous for the Triton kernel, strides {t.stride()}")
        # an index list (sparse_decode) gathers every token through a table load, as a page-1 token table does
        page_size = 1 if self.sparse else ckv_cache.shape[1]
        multi = n_query > 1
        fp8 = ckv_scale is not None
        cfg = cfg or (fp8_config(H, page_size, q_nope.dtype, multi, R) if fp8 else
                      multi_token_config(H, page_size, q_nope.dtype) if multi else
                      default_config(H, R, page_size, q_nope.dtype))
        self.ns = ns = splits or num_splits(B, H, capacity, q_nope.device, cfg, R)
        self.partial_shapes = ((ns, B, H, R), (ns, B, H))
        # strides of what the kernels write: the final out / lse with one split, else the partials
        meta = torch.device("meta")
        final = torch.empty(self.out_shape, device=meta), torch.empty(self.lse_shape, device=meta)
        o, l = final if ns == 1 else (torch.empty(self.partial_shapes[0], device=meta),
                                      torch.empty(self.partial_shapes[1], device=meta))
        s_on, s_ln = (0, 0) if ns == 1 else (o.stride(0), l.stride(0))
        wants_merged = ns > 1 and merge_in_kernel is not False  # a build that merges its own splits, if it has one
        # several query tokens: the pointer kernel or a Gluon one (their rows carry per-token limits; the Triton TMA
        # kernel takes one limit per request)
        if fp8:  # the FP8 Gluon kernel (decode_fp8_swapab.py) or the pointer kernels' FP8 paths (`_pointer_stage1`)
            self.kind = "fp8_swapab" if cfg.kernel == "fp8_swapab" else "pointer"
        elif cfg.kernel in ("seesaw", "wgmma", "swapab"):
            if cfg.kernel == "swapab" and (multi or self.sparse):  # dispatch never asks; a direct caller may
                raise ValueError("cfg: the swapab kernel takes one query token of a paged cache")
            self.kind = cfg.kernel
        elif not multi and tma_eligible(ckv_cache, kpe_cache, self.sparse, cfg):
            self.kind = "tma"
        else:
            self.kind = "pointer"
        if self.kind == "tma":  # launched as the Gluon TMA kernel is: same arguments in the same order
            self.stage1 = _tma_stage1(q_nope, q_pe, ckv_cache, kpe_cache, block_table, sm_scale, o, l, s_on, s_ln, ns,
                                      cfg)
        elif self.kind == "pointer":
            table = indices if self.sparse else block_table
            self.stage1, self.numbers, self.merged = _pointer_stage1(q_nope, q_pe, ckv_cache, kpe_cache, table,
                                                                     self.sparse, seq_lens, sm_scale, o, l, s_on,
                                                                     s_ln, ns, cfg, n_query, ckv_scale,
                                                                     final if wants_merged else None)
        elif self.kind == "fp8_swapab":
            self.stage1 = _fp8_swapab.stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale, block_table, sm_scale,
                                                  o, l, s_on, s_ln, ns)
        elif self.kind == "swapab":
            tiling = _swapab.Tiling(cfg.block_h, cfg.num_warps)
            self.stage1 = _swapab.stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, sm_scale, o, l, s_on,
                                              s_ln, ns, tiling)
            if wants_merged:
                self.merged = _swapab.merged_plan(self.stage1, q_nope, ckv_cache, ns, *final, tiling)
        elif self.kind == "seesaw":
            self.stage1 = _seesaw.stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o,
                                              l, s_on, s_ln, ns, n_query)
        else:
            self.stage1 = _wgmma.stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l,
                                             s_on, s_ln, ns, indices, n_query)
        if ns > 1:
            self.merge = merge_bound(o, l, *final, q_nope.device)
            # float32 partial outs: q's half precision halves their bytes but was slower at short split shapes and
            # no faster elsewhere (H200 2026-12-03, two runs whose peers agreed within 2% there: H 16 B 32 1K 20.9
            # -> 28.9 us, H 128 B 32 1K 40.5 -> 58.8, H 128 B 8 1K 19.0 -> 25.7)
            counters = self.merged[2] if self.merged is not None and merge_in_kernel is None else 0
            self.partials = Scratch(self.partial_shapes, q_nope.device, counters=counters)
        self.run = self._runner()

    def __call__(self, q_nope, q_pe, ckv_cache, kpe_cache, table, seq_lens=None, ckv_scale=None):
        """(out, lse) of this signature's call: `table` the block table (decode), or the index list of a sparse
        plan (seq_lens None then); in the op's own argument order. `run` is the same call without this frame (what
        the op's impl keeps as its plan: kernels/dispatch.py `decode_plan`)."""
        return self.run(q_nope, q_pe, ckv_cache, kpe_cache, table, seq_lens, ckv_scale)

    def _stage1_launch(self):
        """`launch(q_nope, q_pe, ckv_cache, kpe_cache, table, seq_lens, ckv_scale, o, l)`: this plan's stage 1 into
        o / l (the final out / lse with one split, else the partials)."""
        stage1, sparse = self.stage1, self.sparse
        if self.kind == "pointer":  # a sparse call's indices stand in for the lengths too (unread there)
            numbers = self.numbers
            return lambda qn, qp, ckv, kpe, table, lens, scale, o, l: stage1(
                qn, qp, ckv, kpe, table, table if sparse else lens, o, l, o if scale is None else scale, *numbers)
        if self.kind == "fp8_swapab":
            return lambda qn, qp, ckv, kpe, table, lens, scale, o, l: _fp8_swapab.run_stage1(
                stage1, qn, qp, ckv, kpe, scale, table, lens, o, l)
        if sparse:  # the Gluon gather kernel over an index list
            return lambda qn, qp, ckv, kpe, table, lens, scale, o, l: _wgmma.run_stage1(
                stage1, qn, qp, ckv, kpe, None, None, o, l, table)
        # the TMA kernels (Triton's, Gluon's) and the Gluon gather kernel
        return lambda qn, qp, ckv, kpe, table, lens, scale, o, l: _wgmma.run_stage1(
            stage1, qn, qp, ckv, kpe, table, lens, o, l)

    def _runner(self):
        """The call as one closure over what this plan fixed: two allocations, the scratch partials, the launches.
        Every eager call pays this path, so it reads no attribute and takes no branch a signature decides (one
        frame fewer per launch than a method reading the plan's fields: benchmarks/lab/host_cpu.py)."""
        fresh_out, fresh_lse = self.fresh_out, self.fresh_lse
        if self.empty:
            return lambda qn, qp, ckv, kpe, table, lens=None, scale=None: (fresh_out(), fresh_lse())
        launch, copies = self._stage1_launch(), self.copies
        if self.ns == 1:
            def run(qn, qp, ckv, kpe, table, lens=None, scale=None):
                out, lse = fresh_out(), fresh_lse()
                if copies:
                    qn, qp, lens, table = map(_unit_inner_stride, (qn, qp, lens, table))
                launch(qn, qp, ckv, kpe, table, lens, scale, out, lse)
                return out, lse

            return run
        # the default stream's scratch where it is safe, else fresh buffers (kernels/scratch.py)
        partials, (merge, merge_numbers) = self.partials.get, self.merge
        if self.merged is not None:
            return self._merged_runner(launch)

        def run_split(qn, qp, ckv, kpe, table, lens=None, scale=None):
            out, lse = fresh_out(), fresh_lse()
            if copies:
                qn, qp, lens, table = map(_unit_inner_stride, (qn, qp, lens, table))
            o, l = partials()
            launch(qn, qp, ckv, kpe, table, lens, scale, o, l)
            merge(o, l, out, lse, *merge_numbers)
            return out, lse

        return run_split

    def _merged_launch(self):
        """`launch(q_nope, q_pe, ckv_cache, kpe_cache, table, seq_lens, ckv_scale, o, l, counters, out, lse)`: the
        build that merges its own splits (`self.merged`), launched as `_stage1_launch`'s stage 1 with the counters,
        the final out / lse and the merge's numbers after stage 1's arguments."""
        merged, tail, _ = self.merged
        if self.kind == "swapab":  # run_stage1's order: the caches twice (the descriptors' bases, then pointers)
            numbers = self.stage1[2]
            return lambda qn, qp, ckv, kpe, table, lens, scale, o, l, counters, out, lse: merged(
                qn, qp, ckv, kpe, ckv, kpe, table, lens, o, l, *numbers, counters, out, lse, *tail)
        numbers, sparse = self.numbers, self.sparse  # the pointer kernel, in `_stage1_launch`'s order
        return lambda qn, qp, ckv, kpe, table, lens, scale, o, l, counters, out, lse: merged(
            qn, qp, ckv, kpe, table, table if sparse else lens, o, l, o if scale is None else scale, *numbers,
            counters, out, lse, *tail)

    def _merged_runner(self, launch):
        """`_runner`'s split call where stage 1 merges its splits itself (`merge_in_kernel`): one launch; with
        counters from the scratch (None) two launches where it hands none out."""
        fresh_out, fresh_lse, copies, partials = self.fresh_out, self.fresh_lse, self.copies, self.partials.get
        merge, merge_numbers = self.merge
        launch_merged, slots = self._merged_launch(), self.merged[2]

        if self.merge_in_kernel:  # always: zeroed counters of its own per call (a memset, which graphs capture)
            zeroed = functools.partial(torch.zeros, slots, dtype=torch.int32, device=self.device)

            def run_merged(qn, qp, ckv, kpe, table, lens=None, scale=None):
                out, lse = fresh_out(), fresh_lse()
                if copies:
                    qn, qp, lens, table = map(_unit_inner_stride, (qn, qp, lens, table))
                o, l = partials()
                launch_merged(qn, qp, ckv, kpe, table, lens, scale, o, l, zeroed(), out, lse)
                return out, lse

            return run_merged

        def run_auto(qn, qp, ckv, kpe, table, lens=None, scale=None):
            out, lse = fresh_out(), fresh_lse()
            if copies:
                qn, qp, lens, table = map(_unit_inner_stride, (qn, qp, lens, table))
            o, l, counters = partials()
            if counters is None:
                launch(qn, qp, ckv, kpe, table, lens, scale, o, l)
                merge(o, l, out, lse, *merge_numbers)
            else:
                launch_merged(qn, qp, ckv, kpe, table, lens, scale, o, l, counters, out, lse)
            return out, lse

        return run_auto


def decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, *, cfg=None, splits=None,
                n_query: int = 1, ckv_scale=None, outer=None, merge_in_kernel: bool | None = None) -> AttendPlan:
    """`decode`'s plan for these tensors' signature: `plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table,
    seq_lens, ckv_scale)` runs it on any tensors of that signature. `outer`: q's own shape [B, S, heads, R] where
    q_nope / q_pe here are row-folded views of it; the plan then takes q in that shape (the kernels read q by data
    pointer and the strides fixed here) and returns out [B, S, heads, R] / lse [B, S, heads]. `merge_in_kernel`:
    `AttendPlan`'s."""
    capacity = block_table.shape[1] * ckv_cache.shape[1]  # the longest a request can be: shape-only
    return AttendPlan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, None, sm_scale, capacity, cfg, splits,
                      n_query, ckv_scale, outer, merge_in_kernel)


def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, *, cfg=None, splits=None,
           n_query: int = 1, ckv_scale=None, merge_in_kernel: bool | None = None):
    """`mla::decode` on the GPU (or under TRITON_INTERPRET=1): (out [B, H, R] q dtype, lse float32 [B, H]).

    n_query = S > 1: S query tokens per request folded into the rows, q [B, S * H, R] with row j * H + h = head h
    of query token j (what q [B, S, H, R].reshape(B, S * H, R) gives), out / lse likewise. seq_lens int32 [B]
    counts the S new tokens (token j sees t < seq_lens[b] - S + 1 + j), or int32 [B, S] gives each query token's
    limit itself (DCP's per-rank counts). The pointer kernel, each KV tile loaded once for all S tokens.
    ckv_scale: an FP8 ckv_cache's scales (mla_compile/fp8.py): bf16 / fp16 q take decode_fp8.py's kernel (scales
    folded into the products), fp32 q the pointer kernel dequantizing its tiles in registers."""
    plan = decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, cfg=cfg, splits=splits,
                       n_query=n_query, ckv_scale=ckv_scale, merge_in_kernel=merge_in_kernel)
    return plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, ckv_scale)


def sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, *, cfg=None, splits=None,
                       ckv_scale=None, outer=None, merge_in_kernel: bool | None = None) -> AttendPlan:
    """`sparse_decode`'s plan: `plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, None, ckv_scale)`; `outer` as in
    `decode_plan` (q [B, S, H, R] and indices [B, S, K] folded to B*S requests by views)."""
    return AttendPlan(q_nope, q_pe, ckv_cache, kpe_cache, None, None, indices, sm_scale, indices.shape[1], cfg, splits,
                      ckv_scale=ckv_scale, outer=outer, merge_in_kernel=merge_in_kernel)


def sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, *, cfg=None, splits=None, ckv_scale=None,
                  merge_in_kernel: bool | None = None):
    """`mla::sparse_decode`: attention over the physical slots in indices [B, K] (-1 ignored)."""
    plan = sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, cfg=cfg, splits=splits,
                              ckv_scale=ckv_scale, merge_in_kernel=merge_in_kernel)
    return plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, None, ckv_scale)


def flops(batch: int, heads: int, kv_len: int, R: int, P: int) -> float:
    """Matrix FLOPs of one decode: q.[ckv|kpe]^T and p.ckv per head and token."""
    return 2.0 * batch * heads * kv_len * (R + P + R)


def kv_bytes(batch: int, kv_len: int, R: int, P: int, itemsize: int) -> float:
    return float(batch) * kv_len * (R + P) * itemsize

