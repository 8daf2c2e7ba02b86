"""Optional FlashInfer backend for `mla::decode` (`BatchMLAPagedAttentionWrapper`, fa3 on SM90).

CUDA graphs: FlashInfer's `plan()` copies the lengths to the host (a sync) and schedules work from their
values, so a plan captured once would be wrong after the lengths change. We therefore use FlashInfer only
eagerly and only when asked for (`dispatch.select_decode_kernel`: never auto's choice): `usable()` is False
while the current stream is capturing, and dispatch then runs auto's choice (torch.compile's cudagraph trees
capture that kernel). Eager calls plan on every call (the lengths may differ each step); the wrapper, its
workspace and the JIT module are cached per shape.

Each request gets its whole block-table row as its page list (kv_indptr = arange * MP), so the page list
needs no data-dependent compaction; FlashInfer reads only the pages its kv_len covers.
"""

from __future__ import annotations

import functools

import torch

_WORKSPACE_BYTES = 128 * 1024 * 1024


@functools.lru_cache(maxsize=1)
def _flashinfer():
    try:
        import flashinfer.mla  # noqa: F401

        return flashinfer
    except Exception:  # not installed, or a broken install: Triton serves every call
        return None


def available() -> bool:
    return _flashinfer() is not None


def usable(q_nope, ckv_cache) -> bool:
    """FlashInfer's MLA kernels are built for R=512 / P=64 in half precision, on a CUDA device, outside capture,
    and (0.5.3's fa3 kernel) for a latent pool under 2^31 elements: past that every request read wrong pages
    (benchmarks/RESULTS.md, the decode peers table)."""
    return (available() and q_nope.is_cuda and q_nope.dtype in (torch.float16, torch.bfloat16)
            and q_nope.shape[-1] == 512 and ckv_cache.stride(-1) == 1 and ckv_cache.numel() < 2 ** 31
            and not torch.cuda.is_current_stream_capturing())


@functools.lru_cache(maxsize=None)
def _wrapper(device: torch.device):
    fi = _flashinfer()
    backend = "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"
    workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.int8, device=device)
    return fi.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)


@functools.lru_cache(maxsize=64)
def _indptrs(B: int, MP: int, device: torch.device):
    qo = torch.arange(B + 1, dtype=torch.int32, device=device)
    return qo, qo * MP


def plan(q_nope, q_pe, ckv_cache, block_table, seq_lens, sm_scale):
    """Plan FlashInfer for these lengths (host sync). Returns run(q_nope, q_pe, ckv_cache, kpe_cache) -> (out, lse)."""
    B, H, R = q_nope.shape
    num_pages, PS = ckv_cache.shape[0], ckv_cache.shape[1]
    w = _wrapper(q_nope.device)
    qo_indptr, kv_indptr = _indptrs(B, block_table.shape[1], q_nope.device)
    # a row with no tokens gets one clamped, in-range token; its result is overwritten below
    kv_len = seq_lens.clamp(min=1)
    kv_indices = block_table.reshape(-1).clamp(0, num_pages - 1)
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_len, H, R, q_pe.shape[-1], PS, False, sm_scale,
           q_nope.dtype, ckv_cache.dtype)
    empty = (seq_lens == 0)[:, None]

    def run(q_nope, q_pe, ckv_cache, kpe_cache):
        out, lse = w.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True, return_lse_base_on_e=True)
        return torch.where(empty[..., None], 0, out), torch.where(empty, float("-inf"), lse)

    # FlashInfer's own cost, without our empty-row fix-up (what the benchmark compares against)
    run.raw = lambda q_nope, q_pe, ckv_cache, kpe_cache: w.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True,
                                                               return_lse_base_on_e=True)
    return run


def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    """`mla::decode` through FlashInfer (eager only; see the module docstring). q may come as strided views
    (the pass hands over the absorbed q transposed); FlashInfer gets row-major copies."""
    q_nope, q_pe = q_nope.contiguous(), q_pe.contiguous()
    return plan(q_nope, q_pe, ckv_cache, block_table, seq_lens, sm_scale)(q_nope, q_pe, ckv_cache, kpe_cache)
