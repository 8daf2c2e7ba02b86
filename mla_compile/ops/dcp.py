"""`mla::dcp_decode`: decode context parallelism (DCP) over a token-cyclically sharded latent cache, and the
owner-write helpers that fill such a cache.

Data flow of one call on rank r of an n-rank group (DESIGN.md, "DCP layout"):

    local_lens = layout.local_lens(seq_lens, n, r)             # GLOBAL lengths in, this shard's lengths
    out, lse   = mla::decode(..., local_lens, ...)             # attention over this rank's tokens only
    packed     = cat(out, lse bit-cast to out.dtype)  [B,H,R+k] # k = 4 / out.element_size() (2 for bf16)
    chunk      = cat(packed.flatten(), trailer bit-cast)        # trailer: int32 seq_lens [B] (or [B, S]) + header [14]
    gathered   = _c10d_functional.all_gather_into_tensor(chunk) + wait_tensor   -> [n, chunk]
    out, lse   = mla::merge_states(gathered[:, packed][..., :R], gathered[:, packed][..., R:] as float32)
    verdict    = every rank sent the same signature and seq_lens (`dcp_consistency`): else a ValueError on
                 every rank (eagerly, where checks read values) or NaN rows (no host sync)

Packing: ONE collective per layer (per-collective latency dominates at decode sizes: ~9 us for the whole
(out, lse) of B=8, H=16 on NVLink). The float32 LSE is bit-cast into k extra columns of out's dtype rather
than upcasting out: the all-gather only copies bytes, so the LSE arrives bit-exact, and a bf16 out is not
doubled on the wire (R=512: 1028 bytes per head-row instead of 2052). vLLM's DCP all-to-all path packs the
same way. The consistency trailer rides in the same collective: 4 * (B + 14) bytes per rank.

Registration: `mla::dcp_decode` is a CompositeImplicitAutograd op (`torch.library.define` + `impl`).
Eagerly it runs the steps above. Dynamo records it as ONE node (fullgraph, no break: it is an OpOverload
whose meta comes from running the composite under fake tensors), and AOTAutograd decomposes it, so
Inductor's graph holds `mla.decode` -> `cat` -> `_c10d_functional.all_gather_into_tensor` ->
`_c10d_functional.wait_tensor` -> `mla.merge_states` (+ the verdict's few elementwise ops): the collective
is visible to Inductor (comm lowering, reordering) and, being an ordinary NCCL launch on the stream, is
captured by CUDA graphs. `dcp_size == 1` is exactly `mla::decode` (no collective, no merge, no copy).
"""

from __future__ import annotations

import torch

from .. import layout
from . import _checks as C
from . import dcp_consistency as agree
from .attention import check_decode_metadata, check_query_lens, query_limits, query_tokens

# ------------------------------------------------------------------------------------------------ schema
torch.library.define(
    "mla::dcp_decode",
    "(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor block_table, Tensor seq_lens, "
    "float sm_scale, int dcp_size, int dcp_rank, str group_name, bool check_lens=True, "
    "Tensor? ckv_scale=None) -> (Tensor, Tensor)",
)


# ------------------------------------------------------------------------------------------------ validation
def _resolve_group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001 - re-raised as the contract's ValueError
        raise ValueError(f"group_name: no process group named {group_name!r} is registered on this process "
                         f"(init torch.distributed and pass `group.group_name`): {e}") from None


def check_rank_args(dcp_size, dcp_rank) -> None:
    """dcp_size an int >= 1, dcp_rank an int in [0, dcp_size)."""
    C.check(C.is_int(dcp_size) and dcp_size >= 1, "dcp_size",
            f"must be an int >= 1, got {dcp_size!r}")
    C.check(C.is_int(dcp_rank) and 0 <= dcp_rank < dcp_size, "dcp_rank",
            f"must be an int in [0, dcp_size={dcp_size}), got {dcp_rank!r}")


def check_group_args(dcp_size, dcp_rank, group_name) -> None:
    """dcp_size / dcp_rank / group_name: ints in range, and (n > 1) a live group of that size and rank."""
    check_rank_args(dcp_size, dcp_rank)
    C.check(isinstance(group_name, str), "group_name", f"must be a str, got {type(group_name).__name__}")
    if dcp_size == 1:
        return  # no collective: the name is not used (may be "")
    C.check(len(group_name) > 0, "group_name", "must name a process group when dcp_size > 1")
    import torch.distributed as dist

    C.check(dist.is_available() and dist.is_initialized(), "group_name",
            f"dcp_size={dcp_size} needs an initialized torch.distributed (see mla_compile.distributed.init_dcp)")
    pg = _resolve_group(group_name)
    C.check(pg.size() == dcp_size, "dcp_size", f"is {dcp_size} but process group {group_name!r} has {pg.size()} ranks")
    C.check(pg.rank() == dcp_rank, "dcp_rank",
            f"is {dcp_rank} but this process is rank {pg.rank()} of process group {group_name!r}")


def check_dcp_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, dcp_size, dcp_rank,
                          group_name, check_lens=True, ckv_scale=None) -> tuple[int, int]:
    """Decode's checks with GLOBAL seq_lens (each rank's LOCAL lengths must fit its block table); returns
    (num_pages, page_size) of this rank's shard.

    The capacity check reads THIS rank's block table (shards may differ in width: `paged.fill_sharded` gives
    each rank the pages it needs), so it can fail on one rank alone: inside the op such a failure is sent to
    the peers as a REJECT in the call's collective (`dcp_consistency`), and every rank raises."""
    check_group_args(dcp_size, dcp_rank, group_name)
    C.check(isinstance(check_lens, bool), "check_lens", f"must be a bool, got {check_lens!r}")
    # GLOBAL lengths [B], or with S query tokens (q 4-D) GLOBAL per-query-token limits [B, S]
    C.check_tensor(seq_lens, "seq_lens", 2 if seq_lens.dim() == 2 and q_nope.dim() == 4 else 1, torch.int32)
    num_pages, page_size = check_decode_metadata(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                                 ckv_scale=ckv_scale)
    if C.is_fake(seq_lens) or not C.data_checks_enabled(seq_lens.device) or not seq_lens.numel():
        return num_pages, page_size
    lo = int(seq_lens.min())
    C.check(lo >= 0, "seq_lens", f"lengths must be >= 0, got {lo}")
    if seq_lens.dim() == 2:
        C.check(bool((seq_lens[:, 1:] >= seq_lens[:, :-1]).all()), "seq_lens",
                "per-query-token limits must be non-decreasing over the query tokens (causal)")
    else:
        check_query_lens(seq_lens, query_tokens(q_nope))
    capacity = block_table.shape[1] * page_size
    local_max = int(layout.local_lens(seq_lens, dcp_size, dcp_rank).max())
    C.check(local_max <= capacity, "seq_lens",
            f"global length {int(seq_lens.max())} puts {local_max} tokens on dcp rank {dcp_rank} of {dcp_size}, "
            f"more than its block table holds ({block_table.shape[1]} pages x {page_size} = {capacity})")
    return num_pages, page_size


# ------------------------------------------------------------------------------------------------ packing
def pack_states(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(out [B,H,R], lse float32 [B,H]) -> [B,H,R+k] in out's dtype; lse bit-cast into the last k columns."""
    return torch.cat([out, lse.unsqueeze(-1).view(out.dtype)], dim=-1)


def unpack_states(packed: torch.Tensor, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R+k] -> (out [..., R], lse float32 [...]); the inverse of `pack_states`. Both are views of
    `packed` when the lse columns are 4-byte aligned (R even, the normal case), so no copy kernel runs."""
    tail = packed[..., R:]
    k = tail.shape[-1]
    # rows of R+k elements (possibly inside larger per-rank chunks): the float32 view needs the offset R and
    # every outer stride to be multiples of k elements
    aligned = k == 1 or (R % k == 0 and packed.stride(-1) == 1 and all(s % k == 0 for s in packed.stride()[:-1]))
    lse = (tail if aligned else tail.contiguous()).view(torch.float32)
    return packed[..., :R], lse.squeeze(-1)


def local_query_limits(seq_lens: torch.Tensor, S: int, dcp_size: int, dcp_rank: int) -> torch.Tensor:
    """int32 [B, S]: of the tokens query token j may see (the first seq_lens[b] - S + 1 + j, GLOBAL), how many this
    rank holds: `layout.local_lens` of each query token's global limit (non-decreasing in j, as mla::decode's
    limits table needs). Device ops only, no host sync; a length-0 request's limits clamp to 0."""
    return layout.local_lens(query_limits(seq_lens, S), dcp_size, dcp_rank).clamp_min(0)


def gather_states(out: torch.Tensor, lse: torch.Tensor, dcp_size: int, group_name: str):
    """ONE all-gather of every rank's (out, lse): -> (outs [n,B,H,R], lses float32 [n,B,H]), rank order.
    No consistency trailer (the bare communication, as the benchmarks time it)."""
    none = torch.empty(0, dtype=torch.int32, device=out.device)
    payloads, _ = agree.gather_with_trailer(pack_states(out, lse), none, dcp_size, group_name)
    return unpack_states(payloads, out.shape[-1])


# ------------------------------------------------------------------------------------------------ the op
@torch.library.impl("mla::dcp_decode", "CompositeImplicitAutograd")
def dcp_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, dcp_size, dcp_rank,
               group_name, check_lens=True, ckv_scale=None):
    """Absorbed-MLA decode over a DCP-sharded latent cache; the merged result is identical on every rank.

    Shapes as `mla::decode`, but `seq_lens` int32 [B] are GLOBAL lengths while ckv_cache / kpe_cache /
    block_table hold THIS rank's shard (token t of a request lives on rank t % dcp_size at local position
    t // dcp_size, see `mla_compile.layout`). `group_name` names the DCP process group
    (`group.group_name`); its size must be dcp_size and this process's rank in it dcp_rank.
    Returns out [B, H, R] (q's dtype) and lse float32 [B, H] over ALL ranks' tokens; a request with
    length 0 gives (0, -inf). dcp_size 1 is `mla::decode` (group_name unused).

    S query tokens per request: q_nope [B, S, H, R], q_pe [B, S, H, P] -> out [B, S, H, R], lse [B, S, H]; the
    GLOBAL seq_lens count the S new tokens (query token j sees global tokens t < seq_lens[b] - S + 1 + j, every
    length 0 or >= S), and each rank attends to its share of each query token's tokens (`local_query_limits`).
    One all-gather as for S = 1 (S folded into the head rows). Or seq_lens int32 [B, S]: GLOBAL per-query-token
    limits (query token j sees global tokens t < seq_lens[b, j]; >= 0, non-decreasing in j), each rank's share
    `layout.local_lens` of them (the attention pass's form: masks whose rows are not one length apart).

    Every rank must make the same call (`dcp_consistency`): shapes, sm_scale and, with check_lens, seq_lens
    are compared across ranks on the call's own all-gather. A disagreement, or a rank whose checks fail,
    is a ValueError on EVERY rank where checks read values (CPU, MLA_COMPILE_CHECK_DATA=1), else NaN (out
    and lse) in the rows of the requests concerned. check_lens=False is for callers whose seq_lens differ
    across ranks by design (the attention pass passes each rank's own count of masked-in tokens times n).

    FP8 shards (mla_compile/fp8.py): ckv_cache float8_e4m3fn with this shard's ckv_scale; each rank's local
    decode reads them (`mla::decode`), the exchanged partials and the merge stay in out's dtype / float32.
    """
    with agree.dcp_call(group_name, dcp_size, q_nope, seq_lens) as call:
        check_dcp_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, dcp_size,
                              dcp_rank, group_name, check_lens, ckv_scale)
        if dcp_size == 1:
            return torch.ops.mla.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                        ckv_scale)
        if q_nope.dim() == 4:
            sig, out, lse = _local_decode_tokens(call, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens,
                                                 sm_scale, dcp_size, dcp_rank, check_lens, ckv_scale)
        else:
            sig = agree.signature(call, agree.OP_DCP, q_nope, q_pe, sm_scale, dcp_size, check_lens, lens=seq_lens)
            local = layout.local_lens(seq_lens, dcp_size, dcp_rank)
            out, lse = torch.ops.mla.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, local, sm_scale,
                                            ckv_scale)
    header = agree.data_header(sig, seq_lens)
    payloads, trails = agree.gather_with_trailer(pack_states(out, lse), agree.trailer(seq_lens, header), dcp_size,
                                                 group_name)
    ok = agree.verdict(call, trails, header, sig)  # the same on every rank: a ValueError, or rows to keep
    out, lse = agree.poison(*torch.ops.mla.merge_states(*unpack_states(payloads, out.shape[-1])), ok)
    if q_nope.dim() == 4:
        return out.view(q_nope.shape), lse.view(q_nope.shape[:-1])
    return out, lse


def _local_decode_tokens(call, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, dcp_size,
                         dcp_rank, check_lens, ckv_scale=None):
    """S query tokens per request (q [B, S, H, *]): (signature, out [B, S*H, R], lse [B, S*H]) of this rank's
    decode. Past the local decode every (query token, head) row merges on its own, so S is folded into the head
    rows for the gather, the merge and the consistency signature (whose heads field is then S*H: the payload size
    every rank must agree on)."""
    B, S, H, R = q_nope.shape
    rows = (B, S * H)
    sig = agree.signature(call, agree.OP_DCP, q_nope.reshape(*rows, R), q_pe.reshape(*rows, q_pe.shape[-1]),
                          sm_scale, dcp_size, check_lens, tokens=S, lens=seq_lens)
    local = local_query_limits(seq_lens, S, dcp_size, dcp_rank)
    out, lse = torch.ops.mla.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, local, sm_scale, ckv_scale)
    return sig, out.reshape(*rows, R), lse.reshape(rows)


# ------------------------------------------------------------------------------------------------ owner writes
def _check_write(block_table, page_size, dcp_size, dcp_rank):
    C.check_tensor(block_table, "block_table", 2, torch.int32)
    C.check(C.is_int(page_size) and page_size > 0, "page_size", f"must be a positive int, got {page_size!r}")
    C.check(C.is_int(dcp_size) and dcp_size >= 1, "dcp_size", f"must be an int >= 1, got {dcp_size!r}")
    C.check(C.is_int(dcp_rank) and 0 <= dcp_rank < dcp_size, "dcp_rank",
            f"must be an int in [0, dcp_size={dcp_size}), got {dcp_rank!r}")


def write_slots(block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, page_size: int,
                dcp_size: int = 1, dcp_rank: int = 0) -> torch.Tensor:
    """Owner write slots (int64 [T]) of T new tokens: request req_indices[i], GLOBAL position positions[i].

    The physical slot in THIS rank's shard where rank dcp_rank owns the token, -1 where another rank does
    (`mla::cache_write` skips -1): `layout.owner_slots`, which on CPU (or with MLA_COMPILE_CHECK_DATA=1) raises
    for a negative position, a request outside the block table or an owned token beyond the rank's block
    table instead of writing it onto a wrong slot. No host sync on CUDA, so a decode step's write can live
    inside a CUDA graph.
    """
    _check_write(block_table, page_size, dcp_size, dcp_rank)
    C.check(req_indices.dim() == 1 and positions.dim() == 1 and req_indices.shape == positions.shape, "positions",
            f"req_indices {tuple(req_indices.shape)} and positions {tuple(positions.shape)} must be 1-D, same length")
    check = not C.is_fake(positions) and C.data_checks_enabled(positions.device)
    return layout.owner_slots(block_table, req_indices, positions, page_size, dcp_size, dcp_rank, check=check)


def decode_write_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, dcp_size: int = 1,
                       dcp_rank: int = 0) -> torch.Tensor:
    """Slots for a decode step's new token of every request: the token goes to GLOBAL position
    seq_lens[b] (the length BEFORE the step), owned by rank seq_lens[b] % n. int64 [B], -1 off-owner."""
    req = torch.arange(seq_lens.shape[0], device=seq_lens.device)
    return write_slots(block_table, req, seq_lens, page_size, dcp_size, dcp_rank)


def prefill_write_slots(block_table: torch.Tensor, req_index: int, start: int, length: int, page_size: int,
                        dcp_size: int = 1, dcp_rank: int = 0) -> torch.Tensor:
    """Slots for a prefill chunk: tokens start .. start+length-1 of request req_index. int64 [length]."""
    C.check_tensor(block_table, "block_table", 2, torch.int32)
    C.check(C.is_int(req_index) and 0 <= req_index < block_table.shape[0],
            "req_index", f"must be an int in [0, {block_table.shape[0]}) (rows of block_table), got {req_index!r}")
    C.check(C.is_int(start) and start >= 0, "start", f"must be an int >= 0, got {start!r}")
    C.check(C.is_int(length) and length >= 0, "length", f"must be an int >= 0, got {length!r}")
    device = block_table.device
    positions = torch.arange(start, start + length, device=device)
    return write_slots(block_table, torch.full_like(positions, req_index), positions, page_size, dcp_size, dcp_rank)


def owner_cache_write(ckv_cache, kpe_cache, ckv, kpe, block_table, req_indices, positions, dcp_size: int = 1,
                      dcp_rank: int = 0) -> None:
    """Write T new tokens (ckv [T,R], kpe [T,P] at GLOBAL positions) into this rank's shard, in place.

    Every rank calls it with the same tokens (pure DCP computes them replicated); only each token's owner
    writes it (others get slot -1, skipped by `mla::cache_write`).
    """
    slots = write_slots(block_table, req_indices, positions, ckv_cache.shape[1], dcp_size, dcp_rank)
    torch.ops.mla.cache_write(ckv_cache, kpe_cache, ckv, kpe, slots)
