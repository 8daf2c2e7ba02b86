"""CUDA entry points of the ops. Each picks a kernel backend; the ops have already validated the inputs.

Registration: the ops stay `custom_op` + `register_kernel("cuda")` (not `triton_op` + `wrap_triton`). Each
op is then one opaque extern node to Inductor, which is what a hand-tuned attention kernel wants (nothing
to fuse across it), the impl may pick a backend at run time (Triton or FlashInfer, which is no Triton
kernel and could not be traced by `triton_op`), and CUDA graphs capture the launches as they are since no
impl syncs with the host.

`mla::decode` backend: env MLA_COMPILE_DECODE_BACKEND = auto | triton | flashinfer. FlashInfer runs only
eagerly (its plan() syncs; see flashinfer_mla.py); under CUDA-graph capture every choice uses Triton.
`auto` = Triton: see `_AUTO_PREFERS_FLASHINFER` for why.
"""

from __future__ import annotations

import os

import torch

from ..ops.linear import few_token_rows
from . import cache as _cache
from . import decode as _decode
from . import dsa as _dsa
from . import flashinfer_mla as _fi
from . import linear as _linear
from . import merge as _merge

# benchmarks/RESULTS.md ops table, H200 2026-12-01: at H=16 and kv_len >= 8K our Triton kernel takes
# 0.38-1.02x FlashInfer 0.5.3's time under CUDA graphs (eagerly more: ~100 us more host cost per call); at H=128
# (the Gluon kernel, decode_wgmma.py) FlashInfer is 1.12-1.33x faster. But `auto` must be safe under
# torch.compile's CUDA-graph trees: their warm-up
# runs the op eagerly inside the graph pool, and FlashInfer's cached wrapper/workspace allocated there broke the
# pool check ("tensors in the cudagraph pool not tracked as outputs", H200 2026-11-30). So auto = Triton;
# MLA_COMPILE_DECODE_BACKEND=flashinfer is the faster choice for purely eager serving with many heads.
_AUTO_PREFERS_FLASHINFER = False


def decode_backend(q_nope, ckv_cache) -> str:
    choice = os.environ.get("MLA_COMPILE_DECODE_BACKEND", "auto").lower()
    if choice not in ("auto", "triton", "flashinfer"):
        raise ValueError(f"MLA_COMPILE_DECODE_BACKEND: expected auto, triton or flashinfer, got {choice!r}")
    wants_fi = choice == "flashinfer" or (choice == "auto" and _AUTO_PREFERS_FLASHINFER)
    return "flashinfer" if wants_fi and _fi.usable(q_nope, ckv_cache) else "triton"


# Rope-less MLA (P = 0: glm5_next, mistral_large4's no_rope_layers). The kernels are written and tuned for P > 0
# (a rope tile of width block(P), TMA boxes of P columns), so a P = 0 call is handed to them as P = 1 with a zero
# rope column: q_pe and kpe become stride-0 views of ONE zero element. Exactly equivalent (every score gains
# q_pe . kpe = 0 * 0 = +0, and kpe is never NaN), and cheap: one 1-element fill, no cache-sized copy, no host
# sync (CUDA graphs keep working), and the Triton kernels' speed instead of the plain-torch reference, which would
# gather the whole block-table capacity in fp32. The cost: P = 1 is no TMA box width, so every P = 0 call takes
# the pointer kernel (not TMA / Gluon: slower at >= 64 heads), and FlashInfer (built for P = 64) is skipped.
def rope_less(q_pe: torch.Tensor) -> bool:
    return q_pe.shape[-1] == 0


def zero_rope_column(zero: torch.Tensor, *lead: int) -> torch.Tensor:
    """[*lead, 1] view of the one-element tensor `zero`: strides 0 but a unit last stride (the kernels require
    it), so any number of rows costs one element."""
    return zero.as_strided((*lead, 1), (0,) * len(lead) + (1,))


def _with_zero_rope(q_nope, ckv_cache):
    """(q_pe [B, H, 1], kpe_cache [NP, PS, 1]) of zeros, both views of one fresh zero element."""
    zero = q_nope.new_zeros(1)
    return zero_rope_column(zero, *q_nope.shape[:2]), zero_rope_column(zero, *ckv_cache.shape[:2])


def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, n_query=1):
    """n_query = S > 1: S query tokens per request folded into q's rows ([B, S*H, *], see kernels/decode.py
    `decode`): the Triton pointer kernel only (FlashInfer and the many-head kernels take one token per request)."""
    if rope_less(q_pe):  # see above: the Triton kernel with a zero rope column
        q_pe, kpe_cache = _with_zero_rope(q_nope, ckv_cache)
        return _decode.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, n_query=n_query)
    if n_query == 1 and decode_backend(q_nope, ckv_cache) == "flashinfer":
        return _fi.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)
    return _decode.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, n_query=n_query)


def sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    if rope_less(q_pe):
        q_pe, kpe_cache = _with_zero_rope(q_nope, ckv_cache)
    return _decode.sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)


def merge_states(outs, lses):
    return _merge.merge_states(outs, lses)


def cache_write(ckv_cache, kpe_cache, ckv, kpe, slots):
    if rope_less(kpe):
        # P = 0: nothing to write for the rope part; the kernel (which always writes both) copies a zero element
        # onto itself instead of touching a zero-width (possibly null) buffer
        zero = ckv.new_zeros(1)
        kpe_cache, kpe = zero_rope_column(zero, *ckv_cache.shape[:2]), zero_rope_column(zero, ckv.shape[0])
    _cache.cache_write(ckv_cache, kpe_cache, ckv, kpe, slots)


def indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    return _dsa.indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)


def k_only_indices(block_table, seq_lens, page_size, topk):
    return _dsa.k_only_indices(block_table, seq_lens, page_size, topk)


def fused_linear(x, weights):
    """Up to 16 rows in fp16/bf16: the few-token kernel, one launch per pair of weights (benchmarks/
    linear_sweep.py, H200: q_a + kv_a 6.6 vs 11.7 us as two cuBLAS GEMMs, gate + up 18.4 vs 21.5, a lone
    K=8192 weight 12.2 vs 13.8; a lone weight with a short K is ~5% slower than cuBLAS, which is why the pass
    does not send those here). Otherwise F.linear per weight."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if not few_token_rows(x2.shape[0], x2.dtype):
        return [torch.nn.functional.linear(x, w) for w in weights]
    outs = []
    for i in range(0, len(weights), 2):
        outs += _linear.linear_small_m(x2, weights[i:i + 2])
    return [y.view(*lead, y.shape[-1]) for y in outs]


def linear_partials(x, weights, splits):
    """Up to 16 rows in fp16/bf16: the few-token kernel writes the partials (one launch per pair of weights);
    otherwise the op's definition in torch ops."""
    if not few_token_rows(x.shape[0], x.dtype):
        from ..ops.linear import _partials

        return _partials(x, weights, splits)
    return _linear.linear_partials(x, weights, splits)


def per_head_linear(x, weight):
    """Up to 16 rows in fp16/bf16: one few-token launch over (head, row block) writing [B, H, N] directly;
    otherwise the op's definition (bmm over heads)."""
    if not few_token_rows(x.shape[0], x.dtype):
        from ..ops.linear import _per_head

        return _per_head(x, weight)
    return _linear.per_head_linear(x, weight)

