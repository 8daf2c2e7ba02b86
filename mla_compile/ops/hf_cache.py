"""The ops our HF caches put into a graph: `mla_hf::gather_latent` (the full latent read back from our paged / DCP
caches, so HF's attention runs unchanged over it) and `mla_hf::all_selected` (the DSA dense-graph marker).

They live in the ops layer because the passes recognise them (`passes/attention_match.py`,
`passes/dsa_indexer.py`) and passes import ops, never integrations; `integrations/hf.py`'s caches emit them.
"""

from __future__ import annotations

import torch

from .. import fp8, layout
from . import _checks as C
from .attention import token_slots
from ._registry import define


# ---------------------------------------------------------------------------------- mla_hf::gather_latent

@define("mla_hf::gather_latent", mutates_args=(), device_types=None,
                         schema="(Tensor ckv_cache, Tensor kpe_cache, Tensor block_table, int max_len, int dcp_size, "
                                "int dcp_rank, str group_name, Tensor? ckv_scale=None, bool heads_sharded=False) "
                                "-> (Tensor, Tensor)")
def gather_latent(ckv_cache, kpe_cache, block_table, max_len, dcp_size, dcp_rank, group_name, ckv_scale=None,
                  heads_sharded=False):
    """The full latent of every request in token order: (ckv [B, 1, max_len, R], kpe [B, 1, max_len, P]).

    ckv_cache [NP, PS, R] / kpe_cache [NP, PS, P] hold THIS rank's tokens through block_table int32 [B, MP]
    (local token j at slot block_table[b, j // PS] * PS + j % PS). dcp_size > 1: all ranks' shards are
    all-gathered (one collective) and global token t = j * n + r is taken from rank r. Slots never written
    read as whatever the pages hold (zeros after allocation); HF's mask excludes them.

    An FP8 cache (mla_compile/fp8.py: ckv_cache float8_e4m3fn with its ckv_scale float32 [NP, PS, R / 128]) is read
    dequantized, `fp8.dequantize` rounded to kpe_cache's dtype (the model's: the latent HF's attention then sees).
    heads_sharded: a note for the attention pass, not used here: the model's attention heads over this latent are
    split across the DCP group (TP x DCP, `integrations.tp.shard_mla_heads`), so the pass emits
    `mla.tp_dcp_decode` instead of `mla.dcp_decode`.
    """
    _check_gather_args(ckv_cache, kpe_cache, block_table, max_len, dcp_size, dcp_rank, ckv_scale)
    B, MP = block_table.shape
    PS, R, P = ckv_cache.shape[1], ckv_cache.shape[2], kpe_cache.shape[2]
    cap = MP * PS
    slots = token_slots(block_table, PS, cap)
    kpe = kpe_cache.reshape(ckv_cache.shape[0] * PS, P)  # (not -1: P may be 0, the indexer keys' shard)
    if ckv_scale is None:
        ckv = ckv_cache.reshape(-1, R)[slots]
    else:
        ckv = fp8.dequantize(ckv_cache.reshape(-1, R)[slots], ckv_scale.reshape(-1, R // fp8.GROUP)[slots],
                             kpe_cache.dtype)
    local = torch.cat([ckv, kpe[slots].to(ckv.dtype)], -1)
    if dcp_size > 1:
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(local.contiguous(), dcp_size, group_name)
        gathered = torch.ops._c10d_functional.wait_tensor(gathered).view(dcp_size, B, cap, R + P)
        local = layout.interleave_shards(gathered)  # [B, global t, R+P]
    full = local[:, :max_len]
    return (full[..., :R].unsqueeze(1).contiguous(), full[..., R:].to(kpe_cache.dtype).unsqueeze(1).contiguous())


@C.once_per_signature
def _check_gather_args(ckv_cache, kpe_cache, block_table, max_len, dcp_size, dcp_rank, ckv_scale=None):
    C.check_tensor(ckv_cache, "ckv_cache", 3, C.FLOAT_DTYPES + (fp8.DTYPE,))
    C.check_tensor(kpe_cache, "kpe_cache", 3, C.FLOAT_DTYPES)
    C.check(kpe_cache.shape[:2] == ckv_cache.shape[:2], "kpe_cache",
            f"pages/page size {tuple(kpe_cache.shape[:2])} differ from ckv_cache {tuple(ckv_cache.shape[:2])}")
    C.check_tensor(block_table, "block_table", 2, torch.int32)
    C.check_ckv_scale(ckv_cache, ckv_scale)
    layout.check_group(dcp_size, dcp_rank)
    capacity = block_table.shape[1] * ckv_cache.shape[1] * dcp_size
    C.check(C.is_int(max_len) and 0 <= max_len <= capacity, "max_len",
            f"must be in [0, {capacity}] (block table pages x page size x dcp_size), got {max_len!r}")
    C.check_same_device(dict(ckv_cache=ckv_cache, kpe_cache=kpe_cache, block_table=block_table))


@gather_latent.register_fake
def _(ckv_cache, kpe_cache, block_table, max_len, dcp_size, dcp_rank, group_name, ckv_scale=None,
      heads_sharded=False):
    _check_gather_args(ckv_cache, kpe_cache, block_table, max_len, dcp_size, dcp_rank, ckv_scale)
    B = block_table.shape[0]
    dtype = ckv_cache.dtype if ckv_scale is None else kpe_cache.dtype
    return (ckv_cache.new_empty((B, 1, max_len, ckv_cache.shape[2]), dtype=dtype),
            kpe_cache.new_empty((B, 1, max_len, kpe_cache.shape[2])))


GATHER_OPS = {torch.ops.mla_hf.gather_latent.default, torch.ops.mla_hf.gather_latent}


# ------------------------------------------------------------------------ DSA: the dense-graph marker
@define("mla_hf::all_selected", device_types=None, schema="(Tensor keys, int topk) -> Tensor")
def all_selected(keys, topk):
    """The indexer keys, unchanged (a copy: custom ops cannot return aliases), carrying a promise: this graph
    is guarded by "every request's kv_len <= topk", so the indexer's top-k selects every valid token.

    Emitted by `DSADenseMixin.update_indexer` only while tracing (eager code never sees it). The pass
    (`passes.dsa_indexer`) replaces HF's index mask downstream of it by "all selected", which leaves the
    indexer's logits and top-k dead, and then removes the marker itself.
    """
    _check_all_selected_args(keys, topk)
    return keys.clone()


@C.once_per_signature
def _check_all_selected_args(keys, topk):
    if not isinstance(keys, torch.Tensor):
        raise ValueError(f"keys: expected a Tensor, got {type(keys).__name__}")
    if not (C.is_int(topk) and topk > 0):
        raise ValueError(f"topk: must be a positive int, got {topk!r}")


@all_selected.register_fake
def _(keys, topk):
    _check_all_selected_args(keys, topk)
    return torch.empty_like(keys)


ALL_SELECTED_OPS = {torch.ops.mla_hf.all_selected.default, torch.ops.mla_hf.all_selected}
