"""Optional FlashMLA backend for `mla::decode`: FlashMLA's SM90 dense decode (`pip install "mla-compile[flashmla]"`,
the `sgl-flash-mla` wheel; its `use_legacy=True` kernels are the SM90 ones).

What FlashMLA reads, and what that costs with our caches:
- K: one cache [num_blocks, 64, 1, R + P] with each token's latent (R = 512) and rope (P = 64) values adjacent:
  its TMA loads 64-column tiles of one 576-wide row. Page and row strides are free (it reads kcache.stride(0)
  and stride(1)), the last dim must be unit-stride. Our caches are two tensors, ckv [NP, PS, 512] and kpe
  [NP, PS, 64]; FlashMLA reads them in place only when they are the two column ranges of ONE buffer
  [NP, PS, 576] (`fused_caches` allocates such a pair, `shares_rows` recognises one). Otherwise every call
  first copies the pages into a fresh 576-wide buffer (`_copied_kv`: the smaller of the whole pool and the
  block table's B * MP pages). That copy moves more bytes than the attention reads; benchmarks/bench_ops.py
  times the adapter both ways (`flashmla_fused_graph_ms`, `flashmla_copied_graph_ms`) and the copy alone
  (`kv_copy_graph_ms`), so a backend choice can see it.
  Our own TMA kernels read the fused layout too: a column range's rows are 1152 bytes apart, a TMA stride
  (`_util.caches_view_as_slots`, `slot_stride`).
- q: [B, 1, H, R + P] with a unit last stride; its batch and head strides are read as given (FlashMLA's C++
  interface checks only the last stride and passes the others to the kernel). Where q_nope / q_pe are the two
  column ranges of one buffer (SGLang's absorbed q: the bmm written into the first R columns of a [B, H, R + P]
  tensor) that buffer can be handed over as it is (`joined_q`, while `Q_IN_PLACE`); otherwise q_nope | q_pe are
  concatenated (a copy of B * H * 576 elements: 19 MB read and written at B 128, H 128).
- P = 0 (rope-less MLA): FlashMLA's 512-wide head reads ckv alone, in place.
- Results: out [B, 1, H, 512] in q's dtype, lse float32 [B, H, 1], natural log. A row with seq_len 0 gets
  lse +inf (its output is no documented value); `_empty_rows_kernel` turns those rows into (0, -inf), our
  contract, in place: one launch that reads seq_lens and writes only the empty rows (an eager `seq_lens == 0`
  and two `torch.where` were three launches and a re-read and re-write of the whole output). FlashMLA also
  reports +inf for a row whose softmax sum is 0 or NaN (NaN in the cache): such a row is left as it is.
- Block-table entries past a request's pages are never used as pages; an empty request's first entry may be
  handed to a TMA load, which clips an out-of-range page (zero fill) instead of reading it.

CUDA graphs and torch.compile's cudagraph trees: each call hands FlashMLA a fresh, empty `FlashMLASchedMeta`
(`get_mla_metadata()` takes no tensors), so its C++ op runs the split-KV scheduler as a kernel on the current
stream, from the seq_lens tensor, in the same call: no host read of the lengths, and a captured graph
recomputes the schedule from the new lengths on every replay. Nothing is cached across calls: the schedule,
the split accumulators and the outputs come from the caching allocator per call (inside the graph's pool under
capture), the pattern the cudagraph trees' pool check accepts (FlashInfer's cached workspace broke it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import fast
from ._util import _INTERPRETED, cdiv, next_power_of_2

LATENT = 512  # R: FlashMLA's value / latent width
ROPE = 64  # P: the rope width of its 576-wide head (P = 0 uses its 512-wide head)
PAGE = 64  # FlashMLA's page_block_size
DTYPES = (torch.bfloat16, torch.float16)  # both instantiated in the SM90 dense kernel


@functools.lru_cache(maxsize=1)
def _flash_mla():
    """The `flash_mla` module with its SM90 ("legacy") kernels loaded, or None."""
    try:
        import flash_mla

        return flash_mla if flash_mla.has_legacy() else None
    except Exception:  # not installed, no CUDA torch, a broken install: the other backends serve every call
        return None


@functools.lru_cache(maxsize=None)
def _sm90(device: torch.device) -> bool:
    from ._util import is_sm90

    return is_sm90(device)


def available() -> bool:
    """FlashMLA imports and the current CUDA device is SM90 (what its dense decode kernel is built for). Never
    raises; the import is attempted once."""
    try:
        if not torch.cuda.is_available():
            return False
        return _sm90(torch.device("cuda", torch.cuda.current_device())) and _flash_mla() is not None
    except Exception:
        return False


def supported(q_nope, ckv_cache, page_size, kpe_cache=None) -> tuple[bool, str]:
    """(True, "") when `decode` can serve these shapes, else (False, why). Shapes and dtypes only (no data
    read): R 512, page size 64, bf16/fp16, a CUDA SM90 device, batch >= 1; P (from `kpe_cache`, when given)
    64 or 0."""
    if not available():
        return False, "flash_mla does not import (pip install mla-compile[flashmla]) or the GPU is not SM90"
    if not (q_nope.is_cuda and ckv_cache.is_cuda and _sm90(q_nope.device)):
        return False, f"q_nope: on {q_nope.device} (FlashMLA runs on an SM90 CUDA device)"
    if q_nope.dtype not in DTYPES or ckv_cache.dtype != q_nope.dtype:
        return False, f"q_nope: dtype {q_nope.dtype} with cache {ckv_cache.dtype} (FlashMLA takes bf16 / fp16)"
    if q_nope.dim() != 3 or q_nope.shape[-1] != LATENT or ckv_cache.shape[-1] != LATENT:
        return False, f"q_nope: latent width {q_nope.shape[-1]} (FlashMLA takes R = {LATENT})"
    if page_size != PAGE:
        return False, f"ckv_cache: page size {page_size} (FlashMLA takes {PAGE})"
    if q_nope.shape[0] < 1 or q_nope.shape[1] < 1:
        return False, f"q_nope: batch/heads {tuple(q_nope.shape[:2])} (FlashMLA needs both >= 1)"
    if ckv_cache.stride(-1) != 1:
        return False, f"ckv_cache: last-dim stride {ckv_cache.stride(-1)} (FlashMLA needs 1)"
    if kpe_cache is not None:
        if kpe_cache.shape[-1] not in (ROPE, 0):
            return False, f"kpe_cache: rope width {kpe_cache.shape[-1]} (FlashMLA takes P = {ROPE} or 0)"
        if kpe_cache.dtype != q_nope.dtype:
            return False, f"kpe_cache: dtype {kpe_cache.dtype} differs from q_nope's {q_nope.dtype}"
    return True, ""


def in_place(q_nope, ckv_cache, kpe_cache, page_size) -> bool:
    """FlashMLA takes this call and reads the caches without copying them (P = 0, or one shared buffer)."""
    if not supported(q_nope, ckv_cache, page_size, kpe_cache)[0]:
        return False
    return kpe_cache.shape[-1] == 0 or shares_rows(ckv_cache, kpe_cache)


def _tma_aligned(cache) -> bool:
    """Base address and page / row strides in 16-byte units, a unit last stride: what a TMA descriptor takes."""
    es = cache.element_size()
    return (cache.stride(-1) == 1 and cache.data_ptr() % 16 == 0 and (cache.stride(0) * es) % 16 == 0
            and (cache.stride(1) * es) % 16 == 0)


def _follows_in_rows(first: torch.Tensor, second: torch.Tensor) -> bool:
    """`second` is the column range right after `first`'s in the same rows of one buffer: unit last strides, the
    same leading strides and dtype, one storage, second's first element R = first.shape[-1] columns after first's
    (so a view over the rows at first's strides, R + P wide, reads first | second)."""
    return (first.stride(-1) == 1 and second.stride(-1) == 1 and first.stride()[:-1] == second.stride()[:-1]
            and first.dtype == second.dtype
            and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
            and second.data_ptr() == first.data_ptr() + first.shape[-1] * first.element_size())


def shares_rows(ckv_cache, kpe_cache) -> bool:
    """kpe_cache is the column range [R, R + P) of the rows ckv_cache is [0, R) of: one [NP, PS, >= R + P]
    buffer, 16-byte aligned, which FlashMLA reads as its K cache without a copy."""
    return (_tma_aligned(ckv_cache) and _follows_in_rows(ckv_cache, kpe_cache)
            and ckv_cache.stride(1) >= ckv_cache.shape[-1] + kpe_cache.shape[-1])


def fused_caches(num_pages: int, page_size: int, R: int, P: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ckv_cache [NP, PS, R], kpe_cache [NP, PS, P]) as the two column ranges of one [NP, PS, R + P] buffer:
    the layout FlashMLA reads in place (`shares_rows`). Uninitialised, like torch.empty."""
    buf = torch.empty(num_pages, page_size, R + P, dtype=dtype, device=device)
    return buf[..., :R], buf[..., R:]


def _kv_view(ckv_cache, kpe_cache) -> torch.Tensor:
    """[NP, PS, 1, R + P] over the buffer ckv_cache and kpe_cache share (`shares_rows` holds)."""
    NP, PS, R = ckv_cache.shape
    s0, s1 = ckv_cache.stride(0), ckv_cache.stride(1)
    return ckv_cache.as_strided((NP, PS, 1, R + kpe_cache.shape[-1]), (s0, s1, s1, 1))


def _copied_kv(ckv_cache, kpe_cache, block_table) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh [N, PS, 1, R + P] copy and the block table into it: the whole pool or, when the table lists
    fewer pages than the pool holds, just the table's B * MP pages (a static count: no length read)."""
    NP = ckv_cache.shape[0]
    B, MP = block_table.shape
    if NP <= B * MP:
        return torch.cat((ckv_cache, kpe_cache), dim=-1).unsqueeze(2), block_table
    # entries past a request's last page may hold anything (never read): clamp them to a real page
    pages = block_table.reshape(-1).clamp(0, NP - 1)
    kv = torch.cat((ckv_cache[pages], kpe_cache[pages]), dim=-1).unsqueeze(2)
    return kv, torch.arange(B * MP, dtype=torch.int32, device=block_table.device).view(B, MP)


def kv_cache(ckv_cache, kpe_cache, block_table) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(FlashMLA's K cache, the block table into it, copied?): in place when P = 0 or the caches share rows,
    else a copy (`_copied_kv`)."""
    if kpe_cache.shape[-1] == 0:  # FlashMLA's 512-wide head: the latent cache alone
        aligned = _tma_aligned(ckv_cache)
        return (ckv_cache if aligned else ckv_cache.contiguous()).unsqueeze(2), block_table, not aligned
    if shares_rows(ckv_cache, kpe_cache):
        return _kv_view(ckv_cache, kpe_cache), block_table, False
    return (*_copied_kv(ckv_cache, kpe_cache, block_table), True)


def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    """`mla::decode` through FlashMLA: (out [B, H, R] in q's dtype, lse float32 [B, H], natural log; a row with
    seq_len 0 gives (0, -inf)). Shapes as mla::decode (the op has validated them); raises ValueError naming the
    argument when FlashMLA does not take them (see `supported`). No host sync: CUDA-graph capturable."""
    ok, why = supported(q_nope, ckv_cache, ckv_cache.shape[1], kpe_cache)
    if not ok:
        raise ValueError(why)
    B, H, R = q_nope.shape
    if block_table.shape[1] == 0 or ckv_cache.shape[0] == 0:
        # no page to read: every row is empty (the op checked lengths <= capacity and used pages < NP)
        return q_nope.new_zeros(B, H, R), q_nope.new_full((B, H), float("-inf"), dtype=torch.float32)
    fm = _flash_mla()
    q = joined_q(q_nope, q_pe).unsqueeze(1)  # FlashMLA's [B, s_q = 1, H, R + P]
    kv, table, _ = kv_cache(ckv_cache, kpe_cache, block_table)
    sched, _ = fm.get_mla_metadata()  # empty: the call below fills it on the device (see the module docstring)
    seq_lens = seq_lens.contiguous()
    out, lse = fm.flash_mla_with_kvcache(q, kv, table.contiguous(), seq_lens, R, sched, softmax_scale=sm_scale,
                                         causal=False, use_legacy=True)
    out, lse = out.reshape(B, H, R), lse.reshape(B, H)  # views of the contiguous results
    empty_rows_to_contract(out, lse, seq_lens)
    return out, lse


# q handed to FlashMLA at its own strides (`joined_q`). FlashMLA's C++ interface checks only q's last stride and
# passes the batch / head strides to the kernel; tests/gpu/test_flashmla_cuda.py's one-buffer and strided
# rope-less cases check the installed build against the concatenated copy (bit for bit) and float64. False: every
# q concatenated, for a build that assumed a contiguous q
Q_IN_PLACE = True


def joined_q(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, R] | q_pe [B, H, P] as one [B, H, R + P] tensor with a unit last stride: with `Q_IN_PLACE` a
    view of the buffer they are the two column ranges of (rope right after the latent in every row, the same batch
    and head strides; P = 0: q_nope itself where its last stride is 1), else their contiguous concatenation."""
    if not q_pe.shape[-1]:
        return q_nope if Q_IN_PLACE and q_nope.stride(-1) == 1 else q_nope.contiguous()
    if Q_IN_PLACE and _follows_in_rows(q_nope, q_pe):
        B, H, R = q_nope.shape
        return q_nope.as_strided((B, H, R + q_pe.shape[-1]), (q_nope.stride(0), q_nope.stride(1), 1))
    return torch.cat((q_nope, q_pe), dim=-1)


@triton.jit
def _empty_rows_kernel(Out, Lse, SeqLens, rows, H, R: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BY_LSE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (b, h) rows
    live = offs < rows
    if BY_LSE:  # no lengths (index lists): FlashMLA's sparse kernel gives +inf exactly where its softmax sum is 0
        empty = live & (tl.load(Lse + offs, mask=live, other=0.0) == float("inf"))
    else:
        empty = live & (tl.load(SeqLens + offs // H, mask=live, other=1) == 0)
    tl.store(Lse + offs, tl.full([BLOCK_ROWS], float("-inf"), tl.float32), mask=empty)
    cols = tl.arange(0, BLOCK_R)
    zero = tl.zeros([BLOCK_ROWS, BLOCK_R], Out.dtype.element_ty)
    tl.store(Out + offs.to(tl.int64)[:, None] * R + cols[None, :], zero, mask=empty[:, None] & (cols < R)[None, :])


_ROWS_PER_PROGRAM = 16


def empty_rows_to_contract(out: torch.Tensor, lse: torch.Tensor, seq_lens: torch.Tensor | None = None) -> None:
    """In place: the rows of requests with seq_len 0 (FlashMLA: lse +inf, out undocumented) become out 0,
    lse -inf; every other row is left as FlashMLA wrote it (a row it found NaN in keeps its +inf lse: a fault
    stays visible). out [B, H, R] and lse float32 [B, H], both contiguous; seq_lens int32 [B], or None: the rows
    whose lse is +inf (FlashMLA's sparse FP8 kernel, kernels/flashmla_fp8.py: a row without a valid index)."""
    B, H, R = out.shape
    assert out.is_contiguous() and lse.is_contiguous() and lse.dtype == torch.float32 and lse.shape == (B, H)
    by_lse = seq_lens is None
    if not (out.is_cuda or _INTERPRETED):  # a CPU stand-in for flash_mla (tests): the same fix-up in torch
        empty = lse == float("inf") if by_lse else (seq_lens == 0)[:, None]
        out.masked_fill_(empty.unsqueeze(-1), 0)
        lse.masked_fill_(empty, float("-inf"))
    elif B * H:
        fast(_empty_rows_kernel)[(cdiv(B * H, _ROWS_PER_PROGRAM),)](
            out, lse, lse if by_lse else seq_lens, B * H, H, R=R, BLOCK_ROWS=_ROWS_PER_PROGRAM,
            BLOCK_R=next_power_of_2(max(R, 1)), BY_LSE=by_lse, num_warps=4)
