"""FlashMLA's FP8 decode (DeepSeek-V3.2's kernel, `sgl-flash-mla`'s legacy SM90 sparse decode, kv_format "V32") over
our FP8 latent cache, for `mla::sparse_decode` and `mla::decode` at 64 or 128 heads when asked for
(`decode_kernel="flashmla"`), and auto's at 128 heads over caches promised to hold power-of-two scales
(`Tuning.fp8_scale_fmt="ue8m0"`, written with scale_fmt "ue8m0").

Why it can read our cache in place: mla_compile/fp8.py's token IS V3.2's (512 e4m3 values, 4 float32 scales, one per
128 channels, 64 bf16 rope values: 656 bytes). FlashMLA takes it as one [NP, PS, 1, 656] byte tensor whose token
stride is 656 (its check: `kv.stride(1) == bytes_per_token`); the three views of one buffer written by
`fp8.allocate` / the HF FP8 cache are exactly that (`one_buffer`), so nothing is copied.

What it computes: FlashMLA dequantizes each token to bf16 and runs bf16 MMAs with fp32 accumulation. With DeepSeek's
own power-of-two (ue8m0) scales the dequantization is exact (H100 2026-12-06: lse within 1e-3 of float64 over the
dequantized cache); with amax / 448 scales (mla_compile/fp8.py's default) it rounds in bf16 (the scale and the
product; not reproduced by rounding value x scale alone: benchmarks/lab/flashmla_fp8_scales.py): lse off by 0.04-0.09
at scores ~20, a bf16 cache's error, more than our own FP8 kernels (scales folded into fp32 products) allow. So auto
takes it only under the power-of-two promise (measured there 1.45-1.52x faster than our FP8 kernel at H 128, 32K);
asked for over other scales, it is V3.2's production numerics.

What it needs: an SM90 GPU with flash_mla's legacy kernels (kernels/flashmla.py `available`), bf16 q, R 512 / P 64,
H 64 or 128 (its two instantiations), the three views of one buffer (`one_buffer`). FlashMLA takes index lists
only: `sparse_decode` hands it the call's indices ([B, S, K], S query tokens as its s_q; -1 is its only invalid
index, as ours); `decode` writes each request's slots (page * page_size + offset, -1 past its length) into a fresh
[B, 1, capacity] index list on the device (`_slots_kernel`: 4 bytes a token against the 656 the attention reads);
the lengths cannot go in as FlashMLA's `topk_length` (its V3.2 kernel asserts "V3.2 does not support dynamic topk
length", sgl-flash-mla 1.0.0 on an H100), so the -1 entries past a length are what ends a request. Its split-KV
schedule is made in the call from an empty `FlashMLASchedMeta` (as kernels/flashmla.py does for the dense kernel): no
host sync, CUDA-graph capturable.
Results: out [B, H, 512] bf16, lse float32 [B, H], natural log. A row without a valid index gets lse +inf from
FlashMLA (its softmax sum is 0); kernels/flashmla.py `empty_rows_to_contract` makes those (0, -inf), our
contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import fp8
from . import flashmla as _flashmla
from ._launch import fast
from ._util import _INTERPRETED, cdiv

R, P = _flashmla.LATENT, _flashmla.ROPE
HEADS = (64, 128)  # FlashMLA's SM90 sparse decode instantiations
TOKEN = fp8.token_bytes(R, P)  # 656
KV_FORMAT = "V32"
# index-list lengths FlashMLA's sparse decode takes: whole blocks of its 64-token tile (vLLM asserts the same before
# calling it); shorter lists are padded with -1
TOPK_MULTIPLE = 64


def one_buffer(ckv_cache, kpe_cache, ckv_scale) -> bool:
    """The three FP8 views (fp8.views: e4m3 [NP, PS, 512], float32 scales [NP, PS, 4], bf16 rope [NP, PS, 64]) are
    column ranges of one [NP, PS, 656] byte buffer with tokens packed at 656 bytes (any page stride, a multiple of 16
    bytes, and a 16-byte aligned base): FlashMLA's V3.2 K cache, read in place."""
    if ckv_scale is None or not (ckv_cache.dtype == fp8.DTYPE and ckv_scale.dtype == fp8.SCALE_DTYPE
                                 and kpe_cache.dtype == fp8.ROPE_DTYPE):
        return False
    if not (ckv_cache.dim() == ckv_scale.dim() == kpe_cache.dim() == 3 and ckv_cache.shape[-1] == R
            and ckv_scale.shape[-1] == R // fp8.GROUP and kpe_cache.shape[-1] == P
            and ckv_cache.shape[:2] == ckv_scale.shape[:2] == kpe_cache.shape[:2]):
        return False
    strides = [_byte_strides(t) for t in (ckv_cache, ckv_scale, kpe_cache)]
    pages, tokens = strides[0]
    base = ckv_cache.data_ptr()
    return (strides[0] == strides[1] == strides[2] and tokens in (TOKEN, None) and (pages or 0) % 16 == 0
            and base % 16 == 0 and ckv_cache.stride(2) == ckv_scale.stride(2) == kpe_cache.stride(2) == 1
            and ckv_scale.data_ptr() == base + R and kpe_cache.data_ptr() == base + R + 4 * (R // fp8.GROUP)
            and ckv_scale.untyped_storage().data_ptr() == kpe_cache.untyped_storage().data_ptr()
            == ckv_cache.untyped_storage().data_ptr())


def _byte_strides(t: torch.Tensor) -> tuple:
    """A view's page and token strides in bytes, None for a dimension of size 1 (its stride is never used: the HF
    pass's [N, 1, width] token views carry arbitrary ones there)."""
    return tuple(None if n == 1 else s * t.element_size() for n, s in zip(t.shape[:2], t.stride()[:2]))


def _on_sm90(t: torch.Tensor) -> bool:
    return t.is_cuda and _flashmla._sm90(t.device)


def supported(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale) -> tuple[bool, str]:
    """(True, "") when FlashMLA's FP8 kernel serves these tensors, else (False, why). Shapes, dtypes, strides and
    storage pointers only."""
    if not _flashmla.available():
        return False, "flash_mla does not import (pip install mla-compile[flashmla]) or the GPU is not SM90"
    if not (_on_sm90(q_nope) and _on_sm90(ckv_cache)):
        return False, f"q_nope: on {q_nope.device} (FlashMLA runs on an SM90 CUDA device)"
    if q_nope.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16:
        return False, f"q_nope: dtype {q_nope.dtype} (FlashMLA's FP8 kernel takes bf16 q)"
    if q_nope.dim() != 3 or q_nope.shape[1] not in HEADS:
        return False, f"q_nope: {q_nope.shape[1] if q_nope.dim() == 3 else '?'} heads (FlashMLA's FP8 kernel: {HEADS})"
    if q_nope.shape[-1] != R or q_pe.shape[-1] != P:
        return False, f"q_nope / q_pe: widths {q_nope.shape[-1]} / {q_pe.shape[-1]} (FlashMLA's FP8 kernel: {R} / {P})"
    if not one_buffer(ckv_cache, kpe_cache, ckv_scale):
        return False, ("ckv_cache: FlashMLA reads the FP8 cache as one [pages, page_size, 656] buffer (fp8.views of "
                       "one buffer, 16-byte aligned, tokens packed)")
    return True, ""


def _kv(ckv_cache) -> torch.Tensor:
    """[NP, PS, 1, 656] e4m3 bytes over the buffer the three views share (`one_buffer` holds)."""
    NP, PS, _ = ckv_cache.shape
    return ckv_cache.as_strided((NP, PS, 1, TOKEN), (ckv_cache.stride(0) if NP > 1 else PS * TOKEN, TOKEN, TOKEN, 1))


def _run(q_nope, q_pe, ckv_cache, indices, sm_scale):
    """FlashMLA's call: q [B, S, H, *] (S query tokens a request), indices [B, S, K] int32, K >= 1 -> out
    [B, S, H, R], lse [B, S, H] (contiguous, our contract for rows without a valid index)."""
    fm = _flashmla._flash_mla()
    sched, _ = fm.get_mla_metadata()  # empty: filled on the device during the call
    q = torch.cat((q_nope, q_pe), dim=-1)  # [B, S, H, 576], contiguous
    out, lse = fm.flash_mla_with_kvcache(q, _kv(ckv_cache), None, None, R, sched, softmax_scale=sm_scale,
                                         causal=False, is_fp8_kvcache=True, indices=indices,
                                         use_legacy=True, kv_format=KV_FORMAT)
    lse = lse.transpose(1, 2)  # FlashMLA's [B, H, S]
    lse = lse if lse.is_contiguous() else lse.contiguous()
    _flashmla.empty_rows_to_contract(out.view(-1, q.shape[-2], R), lse.view(-1, q.shape[-2]))
    return out, lse


def _nothing(q_nope):
    return q_nope.new_zeros(q_nope.shape), q_nope.new_full(q_nope.shape[:-1], float("-inf"), dtype=torch.float32)


def run_sparse(q_nope, q_pe, ckv_cache, indices, sm_scale):
    """`sparse_decode` without its checks (a plan's call): q_nope [B, H, R] with indices [B, K], or q_nope
    [B, S, H, R] with indices [B, S, K] (S query tokens a request, each its own index list)."""
    if indices.shape[-1] == 0 or ckv_cache.shape[0] * ckv_cache.shape[1] == 0:
        return _nothing(q_nope)
    one = q_nope.dim() == 3  # one query token a request: FlashMLA's s_q = 1
    idx = indices.unsqueeze(1) if one else indices
    pad = -idx.shape[-1] % TOPK_MULTIPLE
    if pad:  # a copy: FlashMLA reads whole 64-entry blocks
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
    out, lse = _run(q_nope.unsqueeze(1) if one else q_nope, q_pe.unsqueeze(1) if one else q_pe, ckv_cache,
                    idx if idx.stride(-1) == 1 else idx.contiguous(), sm_scale)
    return (out.squeeze(1), lse.squeeze(1)) if one else (out, lse)


def sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, ckv_scale, sm_scale):
    """`mla::sparse_decode` over an FP8 cache through FlashMLA: indices [B, K] int32 physical slots (page * page_size
    + offset), -1 ignored. Raises ValueError naming the argument where FlashMLA does not take the call."""
    ok, why = supported(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale)
    if not ok:
        raise ValueError(why)
    return run_sparse(q_nope, q_pe, ckv_cache, indices, sm_scale)


def run_decode(q_nope, q_pe, ckv_cache, block_table, seq_lens, sm_scale):
    """`decode` without its checks (a plan's call)."""
    if block_table.shape[1] == 0 or ckv_cache.shape[0] == 0:
        return _nothing(q_nope)
    lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    out, lse = _run(q_nope.unsqueeze(1), q_pe.unsqueeze(1), ckv_cache,
                    token_slots(block_table, lens, ckv_cache.shape[1]), sm_scale)
    return out.squeeze(1), lse.squeeze(1)


def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, ckv_scale, sm_scale):
    """`mla::decode` (one query token a request) over an FP8 cache through FlashMLA: each request's slots written as
    an index list, -1 past its length (module docstring)."""
    ok, why = supported(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale)
    if not ok:
        raise ValueError(why)
    return run_decode(q_nope, q_pe, ckv_cache, block_table, seq_lens, sm_scale)


@triton.jit
def _slots_kernel(Table, Lens, Idx, s_tb, K, PS, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(Lens + b)
    live = t < n
    page = tl.load(Table + b.to(tl.int64) * s_tb + t // PS, mask=live, other=0)
    tl.store(Idx + b.to(tl.int64) * K + t, tl.where(live, page * PS + t % PS, -1), mask=t < K)


_SLOTS_BLOCK = 1024


def token_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, 1, K] int32, K = MP * page_size rounded up to TOPK_MULTIPLE: request b's token t at slot
    block_table[b, t // page_size] * page_size + t % page_size for t < seq_lens[b], -1 after (entries past a
    request's pages never read)."""
    B, MP = block_table.shape
    K = -(-MP * page_size // TOPK_MULTIPLE) * TOPK_MULTIPLE
    idx = torch.empty(B, 1, K, dtype=torch.int32, device=block_table.device)
    if not (idx.is_cuda or _INTERPRETED):  # CPU tensors (the tests' stand-in FlashMLA): the same in torch
        t = torch.arange(K, device=idx.device)
        live = t[None, :] < seq_lens[:, None].long()
        pages = block_table.long().gather(1, (t // page_size).clamp(max=max(MP - 1, 0)).expand(B, K))
        idx[:, 0] = torch.where(live, pages * page_size + t % page_size, -1).int()
    elif B * K:
        fast(_slots_kernel)[(B, cdiv(K, _SLOTS_BLOCK))](block_table, seq_lens, idx, block_table.stride(0), K,
                                                        page_size, BLOCK=_SLOTS_BLOCK, num_warps=4)
    return idx
