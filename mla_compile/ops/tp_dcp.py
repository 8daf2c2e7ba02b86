"""`mla::tp_dcp_decode`: TP x DCP decode (SGLang / vLLM style) — heads tensor-parallel, KV context-parallel.

Each of the n ranks of a DCP group holds a DIFFERENT contiguous slice of the attention heads (rank r owns
heads [r*H_local, (r+1)*H_local), H = n*H_local) and the token-cyclic shard of every request's latent KV
(`mla_compile.layout`: token t on rank t % n). Data flow of one call on rank r (DESIGN.md, "DCP layout"):

    q        = cat(q_nope, q_pe)                         [B, H_local, R+P]
    q_all    = all_gather_into_tensor(q, trailer) + wait [n, B, H_local, R+P] -> [B, H, R+P]  (heads r-major)
    verdict  = every rank sent the same signature and seq_lens (trailer: `dcp_consistency`)
    out, lse = mla::decode(q_all, this shard, local_lens) [B, H, R], f32 [B, H]   (ALL heads, MY tokens)
    send     = pack_states(out, lse) split by head owner  [n, B, H_local, R+k]   (send[j] = rank j's heads)
    recv     = all_to_all_single(send) + wait_tensor      [n, B, H_local, R+k]   (recv[i] = rank i's partial)
    out, lse = mla::merge_states(unpack_states(recv))     [B, H_local, R], f32 [B, H_local]

Two collectives per layer, both packed: q_nope and q_pe travel together, and the float32 lse rides bit-cast in
k = 4 / out.element_size() extra columns of out (`dcp.pack_states`, the same packing as `mla::dcp_decode`).
The consistency trailer (int32 seq_lens [B] + a 12-word header, 4 * (B + 12) bytes per rank) rides on the q
all-gather, the call's first collective: every rank sees every rank's trailer there, before any decode
work, so all reach the same verdict before the all-to-all (whose pairing then follows).

The "LSE-corrected reduce-scatter" is an all-to-all followed by `mla::merge_states`, not a literal
reduce-scatter: a reduce-scatter of lse-rescaled outputs needs the global lse first (an all-gather of
[B, H] lse, then the rescale, then the reduce-scatter: two collectives where one does), and it would put a
second copy of the merge math (max-shift, -inf / NaN parts contributing exactly 0, all-empty -> (0, -inf))
outside `mla::merge_states`, its one home. The all-to-all moves the same bytes a reduce-scatter does
((n-1)/n of B*H*(R+k) per rank) and the merge is the op every other DCP path uses. vLLM's DCP a2a backend
takes the same route.

Registration: CompositeImplicitAutograd + `_c10d_functional` collectives, exactly like `mla::dcp_decode`:
Dynamo records one node (fullgraph), AOTAutograd decomposes it into `all_gather_into_tensor` ->
`wait_tensor` -> `mla.decode` -> `all_to_all_single` -> `wait_tensor` -> `mla.merge_states`, visible to
Inductor and capturable by CUDA graphs. `dcp_size == 1` is exactly `mla::decode` (H_local = H).
"""

from __future__ import annotations

import torch

from .. import layout
from . import _checks as C
from . import dcp_consistency as agree
from .dcp import check_dcp_decode_args, local_query_limits, pack_states, unpack_states

# ------------------------------------------------------------------------------------------------ schema
torch.library.define(
    "mla::tp_dcp_decode",
    "(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor block_table, Tensor seq_lens, "
    "float sm_scale, int dcp_size, int dcp_rank, str group_name, bool check_lens=True, "
    "Tensor? ckv_scale=None) -> (Tensor, Tensor)",
)


def check_tp_dcp_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, dcp_size,
                             dcp_rank, group_name, check_lens=True, ckv_scale=None) -> None:
    """`dcp_decode`'s checks (group, shapes, GLOBAL seq_lens fitting this rank's block table) plus H_local >= 1,
    and the block-table data checks `mla::decode` would make after the q all-gather, made before it so that a
    failure on one rank reaches its peers in that gather (a REJECT) instead of leaving them in the all-to-all."""
    num_pages, page_size = check_dcp_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                                 dcp_size, dcp_rank, group_name, check_lens, ckv_scale)
    C.check(q_nope.shape[-2] >= 1, "q_nope", f"needs at least one head on this rank (H_local >= 1), got shape "
            f"{tuple(q_nope.shape)}")
    # per-query-token limits [B, S] (non-decreasing, checked above): the last token's limit is the request's length
    lens = seq_lens.amax(-1) if seq_lens.dim() == 2 else seq_lens
    C.check_block_table_data(block_table, layout.local_lens(lens, dcp_size, dcp_rank), num_pages, page_size)


# ------------------------------------------------------------------------------------------------ collectives
def gather_heads(q_nope: torch.Tensor, q_pe: torch.Tensor, dcp_size: int, group_name: str, trail: torch.Tensor):
    """ONE all-gather of every rank's head slice and consistency trailer (int32 [W]): (q_nope [B,Hl,R],
    q_pe [B,Hl,P]) -> ([B, n*Hl, R], [B, n*Hl, P], trails int32 [n, W]); head r*Hl + h of the result is rank
    r's head h."""
    B, Hl, R = q_nope.shape
    packed = torch.cat([q_nope, q_pe], dim=-1)  # [B, Hl, R+P]
    gathered, trails = agree.gather_with_trailer(packed, trail, dcp_size, group_name)  # [n, B, Hl, R+P]
    q = gathered.transpose(0, 1).reshape(B, dcp_size * Hl, -1)
    return q[..., :R].contiguous(), q[..., R:].contiguous(), trails


def exchange_states(out: torch.Tensor, lse: torch.Tensor, dcp_size: int, group_name: str):
    """ONE all-to-all: this rank's partial (out [B,H,R], lse [B,H]) over ALL heads -> every rank's partial for
    THIS rank's heads: (outs [n,B,Hl,R], lses float32 [n,B,Hl]), index i = rank i's tokens."""
    B, H, R = out.shape
    Hl = H // dcp_size
    packed = pack_states(out, lse)  # [B, H, R+k]
    send = packed.view(B, dcp_size, Hl, -1).transpose(0, 1).contiguous()  # [n, B, Hl, R+k]: send[j] -> rank j
    splits = [1] * dcp_size  # dim 0 of send / recv is the rank
    recv = torch.ops._c10d_functional.all_to_all_single(send, splits, splits, group_name)
    recv = torch.ops._c10d_functional.wait_tensor(recv)
    return unpack_states(recv, R)


# ------------------------------------------------------------------------------------------------ the op
@torch.library.impl("mla::tp_dcp_decode", "CompositeImplicitAutograd")
def tp_dcp_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, dcp_size, dcp_rank,
                  group_name, check_lens=True, ckv_scale=None):
    """TP x DCP absorbed-MLA decode: this rank's heads, attended over ALL ranks' tokens.

    q_nope [B, H_local, R], q_pe [B, H_local, P]: this rank's heads, rank r owning global heads
    [r*H_local, (r+1)*H_local). ckv_cache [NP, PS, R] / kpe_cache [NP, PS, P] / block_table int32 [B, MP]:
    THIS rank's token-cyclic KV shard (token t on rank t % dcp_size at local position t // dcp_size).
    seq_lens int32 [B]: GLOBAL lengths. `group_name` names the DCP process group (size dcp_size, this
    process rank dcp_rank in it).
    Returns out [B, H_local, R] (q's dtype) and lse float32 [B, H_local] (natural log): exactly what
    single-process `mla::decode` over the whole cache gives for this rank's heads; a request of length 0
    gives (0, -inf). Collectives: one all-gather of q, one all-to-all of (out, lse). dcp_size 1 is
    `mla::decode` (group_name unused). Cross-rank consistency (shapes, sm_scale, seq_lens with check_lens)
    as `mla::dcp_decode`, checked on the q all-gather: a ValueError on every rank, or NaN rows.

    S query tokens per request: q_nope [B, S, H_local, R], q_pe [B, S, H_local, P] -> out [B, S, H_local, R],
    lse [B, S, H_local]; GLOBAL seq_lens count the S new tokens (query token j sees global tokens
    t < seq_lens[b] - S + 1 + j, every length 0 or >= S). The same two collectives (S rides in the batch rows).
    Or seq_lens int32 [B, S]: GLOBAL per-query-token limits, as `mla::dcp_decode` takes them (the attention pass's
    form for verification steps with the heads split), each rank's share `layout.local_lens` of them.
    An FP8 shard: ckv_scale passed through to the local decode, as `mla::dcp_decode`.
    """
    with agree.dcp_call(group_name, dcp_size, q_nope, seq_lens) as call:
        check_tp_dcp_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, dcp_size,
                                 dcp_rank, group_name, check_lens, ckv_scale)
        if dcp_size == 1:
            return torch.ops.mla.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                        ckv_scale)
        tokens = q_nope.dim() == 4  # S query tokens per request: [B, S, Hl, *]
        B, S, Hl, R = q_nope.shape if tokens else (q_nope.shape[0], 1, *q_nope.shape[1:])
        # the signature sees q as [B, S*Hl, *]: batch B, as the trailer's B lengths, and the same payload size
        sig = agree.signature(call, agree.OP_TP, q_nope.reshape(B, S * Hl, R) if tokens else q_nope,
                              q_pe.reshape(B, S * Hl, q_pe.shape[-1]) if tokens else q_pe, sm_scale, dcp_size,
                              check_lens, tokens=S, lens=seq_lens)  # lens: [B, S] limits ride as B * S words
    header = agree.data_header(sig, seq_lens)
    if tokens:  # the collectives move [B*S, Hl, *] rows: S rides in the batch rows, heads stay per-rank slices
        q_nope, q_pe = q_nope.reshape(B * S, Hl, R), q_pe.reshape(B * S, Hl, q_pe.shape[-1])
    q_all, qpe_all, trails = gather_heads(q_nope, q_pe, dcp_size, group_name, agree.trailer(seq_lens, header))
    ok = agree.verdict(call, trails, header, sig)  # the same on every rank, before any decode work
    if tokens:
        H = dcp_size * Hl
        local = local_query_limits(seq_lens, S, dcp_size, dcp_rank)
        out, lse = torch.ops.mla.decode(q_all.view(B, S, H, R), qpe_all.view(B, S, H, -1), ckv_cache, kpe_cache,
                                        block_table, local, sm_scale, ckv_scale)
        out, lse = out.view(B * S, H, R), lse.view(B * S, H)
        ok = None if ok is None else ok.repeat_interleave(S)  # request b's verdict for each of its S rows
    else:
        local = layout.local_lens(seq_lens, dcp_size, dcp_rank)
        out, lse = torch.ops.mla.decode(q_all, qpe_all, ckv_cache, kpe_cache, block_table, local, sm_scale,
                                        ckv_scale)
    outs, lses = exchange_states(out, lse, dcp_size, group_name)
    out, lse = agree.poison(*torch.ops.mla.merge_states(outs, lses), ok)
    if tokens:
        return out.view(B, S, Hl, R), lse.view(B, S, Hl)
    return out, lse
