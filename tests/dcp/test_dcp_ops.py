"""Single-process tests of `mla::dcp_decode` (dcp_size 1, validation, packing), the owner-write helpers and
`DCPCache`; the multi-rank merge math simulated in one process. The real multi-process runs (gloo) are in
test_dcp_gloo.py."""

from __future__ import annotations

import math

import pytest
import torch

import mla_compile  # noqa: F401
from mla_compile import layout, paged
from mla_compile.distributed import DCPCache, DCPGroup, init_dcp
from mla_compile.ops import dcp
from mla_compile.ops import dcp_consistency as agree

from reference import ref_decode

R, P, PS, H = 16, 8, 4, 3


def _tokens(lens, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ckv = [torch.randn(n, R, generator=g).to(dtype) for n in lens]
    kpe = [torch.randn(n, P, generator=g).to(dtype) for n in lens]
    return ckv, kpe


def _q(B, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, R, generator=g).to(dtype), torch.randn(B, H, P, generator=g).to(dtype)


# ----------------------------------------------------------------------------------------- dcp_size == 1
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_size_one_is_decode(dtype):
    lens = [0, 1, 7, 13]
    ckv, kpe = _tokens(lens, dtype)
    pb = paged.fill_paged(ckv, kpe, PS, generator=torch.Generator().manual_seed(3))
    q, qp = _q(len(lens), dtype)
    args = (q, qp, pb.ckv_cache, pb.kpe_cache, pb.block_table, pb.seq_lens, 0.25)
    o1, l1 = torch.ops.mla.decode(*args)
    o2, l2 = torch.ops.mla.dcp_decode(*args, 1, 0, "")
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert o2.dtype == dtype and l2.dtype == torch.float32 and bool((l2[0] == -math.inf).all())


def test_size_one_opcheck():
    ckv, kpe = _tokens([5, 0, 9])
    pb = paged.fill_paged(ckv, kpe, PS)
    q, qp = _q(3)
    torch.library.opcheck(torch.ops.mla.dcp_decode.default,
                          (q, qp, pb.ckv_cache, pb.kpe_cache, pb.block_table, pb.seq_lens, 0.5, 1, 0, ""),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_size_one_compiles_to_plain_decode():
    ckv, kpe = _tokens([5, 0, 9])
    pb = paged.fill_paged(ckv, kpe, PS)
    q, qp = _q(3)
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    f = torch.compile(lambda *a: torch.ops.mla.dcp_decode(*a, 0.5, 1, 0, ""), backend=backend, fullgraph=True)
    out = f(q, qp, pb.ckv_cache, pb.kpe_cache, pb.block_table, pb.seq_lens)
    ref = torch.ops.mla.decode(q, qp, pb.ckv_cache, pb.kpe_cache, pb.block_table, pb.seq_lens, 0.5)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert len(seen) == 1
    targets = [n.target for n in seen[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.mla.dcp_decode) + targets.count(torch.ops.mla.dcp_decode.default) == 1


# ----------------------------------------------------------------------------------------- validation
def _valid_args():
    ckv, kpe = _tokens([5, 3])
    pb = paged.fill_paged(ckv, kpe, PS)
    q, qp = _q(2)
    return dict(q_nope=q, q_pe=qp, ckv_cache=pb.ckv_cache, kpe_cache=pb.kpe_cache, block_table=pb.block_table,
                seq_lens=pb.seq_lens, sm_scale=0.5, dcp_size=1, dcp_rank=0, group_name="")


@pytest.mark.parametrize("change,name", [
    (dict(dcp_size=0), "dcp_size"),
    (dict(dcp_size=-2), "dcp_size"),
    (dict(dcp_rank=1), "dcp_rank"),
    (dict(dcp_rank=-1), "dcp_rank"),
    (dict(dcp_size=2, dcp_rank=2), "dcp_rank"),
    (dict(dcp_size=2, dcp_rank=0, group_name=""), "group_name"),
    (dict(dcp_size=2, dcp_rank=1, group_name="no-such-group"), "group_name"),
    (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(seq_lens=torch.tensor([5, 3], dtype=torch.int64)), "seq_lens"),
    (dict(seq_lens=torch.tensor([5, -1], dtype=torch.int32)), "seq_lens"),
    (dict(seq_lens=torch.tensor([500, 3], dtype=torch.int32)), "seq_lens"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "block_table"),
    (dict(q_pe=torch.randn(2, H, P + 1)), "kpe_cache"),
    (dict(q_nope=torch.randn(2, H, R, dtype=torch.float64)), "q_nope"),
])
def test_validation(change, name):
    args = {**_valid_args(), **change}
    with pytest.raises(ValueError, match=rf"^{name}:"):
        torch.ops.mla.dcp_decode(**args)


def test_validation_local_capacity_message(monkeypatch):
    """Global lengths are checked against THIS rank's capacity (its share), naming the global length."""
    ckv, kpe = _tokens([8, 8])
    sh = paged.fill_sharded(ckv, kpe, PS, 2, 0)  # 4 local tokens each: 1 page of 4
    q, qp = _q(2)
    monkeypatch.setattr(dcp, "check_group_args", lambda *a: None)  # n > 1 needs a live group; test the data check
    dcp.check_dcp_decode_args(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table,
                              torch.tensor([8, 8], dtype=torch.int32), 0.5, 2, 0, "g")
    with pytest.raises(ValueError, match=r"^seq_lens: global length 10 puts 5 tokens on dcp rank 0 of 2"):
        dcp.check_dcp_decode_args(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table,
                                  torch.tensor([10, 8], dtype=torch.int32), 0.5, 2, 0, "g")


# ----------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("width", [6, 7])  # even R: lse read as a view of the buffer; odd R: copied out
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_roundtrip_bit_exact(dtype, width):
    out = torch.randn(3, 4, width).to(dtype)
    lse = torch.tensor([[-math.inf, 0.0, 1e-30, 3.5], [math.inf, float("nan"), -7.25, 1e30], [1, 2, 3, 4]],
                       dtype=torch.float32)
    packed = dcp.pack_states(out, lse)
    assert packed.dtype == dtype and packed.shape == (3, 4, width + 4 // out.element_size())
    o2, l2 = dcp.unpack_states(packed, width)
    assert torch.equal(o2, out)
    assert torch.equal(l2.view(torch.int32), lse.view(torch.int32))  # bit-exact, NaN included


# ----------------------------------------------------------------------------------------- consistency trailer
def _signature(op, B, heads, width, rope, dtype, scale=0.5, check_lens=True):
    return agree.Signature(op, 3, B, heads, width, rope, dtype, scale, check_lens)


@pytest.mark.parametrize("width", [6, 7])  # odd R: the lse and the trail are copied out, not viewed
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_trailer_rides_beside_the_states_bit_exact(dtype, width):
    """Each rank's chunk = packed (out, lse) + int32 seq_lens + header, bit-cast into out's dtype; the gathered
    chunks (simulated: stacked) unpack to every rank's exact states and trailer. The exchange sizes its
    messages by Signature.payload_numel: it must be the packed states' size."""
    n, B, Hh = 3, 2, 4
    sig = _signature(agree.OP_DCP, B, Hh, width, 5, dtype)
    header = agree.data_header(sig, torch.zeros(1))
    chunks, sent = [], []
    for r in range(n):
        g = torch.Generator().manual_seed(r)
        out = torch.randn(B, Hh, width, generator=g).to(dtype)
        lse = torch.randn(B, Hh, generator=g)
        lse[0, 0] = -math.inf
        seq = torch.tensor([7 + r, 2**31 - 1], dtype=torch.int32)
        packed = dcp.pack_states(out, lse)
        assert packed.numel() == sig.payload_numel()
        chunks.append(agree.pack_chunk(packed, agree.trailer(seq, header)))
        sent.append((out, lse, seq))
    assert chunks[0].dtype == dtype and chunks[0].numel() * dtype.itemsize == \
        B * Hh * (width * dtype.itemsize + 4) + 4 * (B + agree.HEADER_WORDS)  # the extra bytes: 4 (B + 12)
    gathered = torch.stack(chunks)
    payloads, trails = agree.unpack_chunks(gathered, (B, Hh, width + 4 // dtype.itemsize), B + agree.HEADER_WORDS)
    outs, lses = dcp.unpack_states(payloads, width)
    for r, (out, lse, seq) in enumerate(sent):
        assert torch.equal(outs[r], out) and torch.equal(lses[r].view(torch.int32), lse.view(torch.int32))
        assert trails[r].tolist() == seq.tolist() + header.tolist()
    if width % 2 == 0:  # aligned: views of the gathered buffer, no copy kernel
        base = gathered.untyped_storage().data_ptr()
        assert lses.untyped_storage().data_ptr() == base and trails.untyped_storage().data_ptr() == base


def test_tp_signature_sizes_the_q_gather():
    sig = _signature(agree.OP_TP, 2, 3, 16, 8, torch.bfloat16)
    assert torch.cat([torch.zeros(2, 3, 16), torch.zeros(2, 3, 8)], -1).numel() == sig.payload_numel()


def _trails(headers, lens):
    return torch.tensor([list(ls) + list(h) for h, ls in zip(headers, lens)], dtype=torch.int32)


def test_rows_ok_and_poison_mark_exactly_the_disagreeing_requests():
    sig = _signature(agree.OP_DCP, 3, 2, 4, 2, torch.float32)
    h = agree.data_header(sig, torch.zeros(1))
    same = [h.tolist()] * 3
    ok = agree.rows_ok(_trails(same, [[5, 9, 0]] * 3), h, 3, True)
    assert ok.tolist() == [True, True, True]
    ok = agree.rows_ok(_trails(same, [[5, 9, 0], [5, 10, 0], [5, 9, 0]]), h, 3, True)
    assert ok.tolist() == [True, False, True]
    assert agree.rows_ok(_trails(same, [[5, 9, 0], [5, 10, 0], [5, 9, 0]]), h, 3, False).tolist() == [True] * 3
    other = sig.fields()
    other[2] = 4  # a peer with another batch size: nothing may be merged
    odd = [h.tolist(), h.tolist(), [h[0].item(), 0, *other]]
    assert agree.rows_ok(_trails(odd, [[5, 9, 0]] * 3), h, 3, True).tolist() == [False] * 3
    wild = h.clone()
    wild[2 + 2] = agree.WILDCARD  # a symbolic batch size when traced matches any
    assert agree.rows_ok(_trails(odd, [[5, 9, 0]] * 3), wild, 3, True).tolist() == [True] * 3
    out, lse = torch.ones(3, 2, 4), torch.zeros(3, 2)
    po, pl = agree.poison(out, lse, torch.tensor([True, False, True]))
    assert bool(po[1].isnan().all()) and bool(pl[1].isnan().all())
    assert torch.equal(po[[0, 2]], out[[0, 2]]) and torch.equal(pl[[0, 2]], lse[[0, 2]])


def test_host_verdicts_name_the_argument():
    sig = _signature(agree.OP_DCP, 3, 2, 4, 2, torch.float32)
    h = agree.data_header(sig, torch.zeros(1)).tolist()
    agree.check_headers([h, h], "g")  # agreement: nothing
    agree.check_lens([[5, 9], [5, 9]], "g")
    with pytest.raises(ValueError, match=r"^seq_lens: .*request\(s\) \[1\] \(rank 0: \[9\]; rank 1: \[10\]\)"):
        agree.check_lens([[5, 9], [5, 10]], "g")
    for field, value, arg in [(2, 4, "q_nope"), (3, 7, "q_nope"), (5, 3, "q_pe"), (6, 3, "q_nope"),
                              (7, 1, "sm_scale"), (1, 4, "dcp_size"), (0, 2, "group_name")]:
        other = list(h)
        other[2 + field] = value
        with pytest.raises(ValueError, match=f"^{arg}: the ranks of dcp group 'g' disagree"):
            agree.check_headers([h, other], "g")
    reject = [agree.MAGIC + agree.REJECT, agree.ARG_NAMES.index("block_table") + 1] + [0] * (len(h) - 2)
    with pytest.raises(ValueError, match="^block_table: dcp rank 1 of 2 .*rejected this call"):
        agree.check_headers([h, reject], "g")
    with pytest.raises(ValueError, match="^group_name: dcp rank 0 .*not a DCP decode message"):
        agree.check_headers([[0] * len(h), h], "g")


# ----------------------------------------------------------------------------------------- simulated ranks
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulated_ranks_merge_to_full_decode(n, dtype):
    """Each rank's local decode over its shard (local_lens), merged: equals decode over the whole cache."""
    lens = [0, 1, n - 1, n, n + 1, 3 * n + 2, 29]
    ckv, kpe = _tokens(lens, dtype, seed=n)
    q, qp = _q(len(lens), dtype, seed=n + 1)
    seq = torch.tensor(lens, dtype=torch.int32)
    full = paged.fill_paged(ckv, kpe, PS, generator=torch.Generator().manual_seed(0))
    ref_o, ref_l = ref_decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, seq, 0.3)
    outs, lses = [], []
    for r in range(n):
        sh = paged.fill_sharded(ckv, kpe, PS, n, r, generator=torch.Generator().manual_seed(r + 1))
        assert torch.equal(sh.seq_lens, layout.local_lens(seq, n, r))
        o, l = torch.ops.mla.decode(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, layout.local_lens(seq, n, r),
                                    0.3)
        packed = dcp.pack_states(o, l)  # what goes on the wire
        o, l = dcp.unpack_states(packed, R)
        outs.append(o)
        lses.append(l)
    out, lse = torch.ops.mla.merge_states(torch.stack(outs), torch.stack(lses))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), ref_o, **tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l.float()))
    fin = torch.isfinite(ref_l)
    torch.testing.assert_close(lse.double()[fin], ref_l[fin], atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------------------- owner writes
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_owner_writes_build_the_shards(n):
    """Prefill chunks + decode steps written through the owner helpers give exactly fill_sharded's tokens."""
    lens0, steps = [0, 1, 6, 11], 9
    total = [L + steps for L in lens0]
    ckv, kpe = _tokens(total, seed=7)
    for r in range(n):
        cache = DCPCache.allocate(DCPGroup(n, r, "", torch.device("cpu")), len(lens0), max(total), R, P, PS,
                                  torch.float32, fill=float("nan"))
        for b, L in enumerate(lens0):  # chunked prefill: two chunks
            cut = L // 2
            cache.write_prefill(b, ckv[b][:cut], kpe[b][:cut])
            cache.write_prefill(b, ckv[b][cut:L], kpe[b][cut:L])
        for s in range(steps):
            cache.write_decode(torch.stack([ckv[b][lens0[b] + s] for b in range(len(lens0))]),
                               torch.stack([kpe[b][lens0[b] + s] for b in range(len(lens0))]))
        assert cache.seq_lens.tolist() == total and cache.lens == total
        local = cache.local_lens()
        for b in range(len(lens0)):
            mine = layout.local_token_positions(total[b], n, r)
            assert int(local[b]) == len(mine)
            slots = torch.tensor([int(cache.block_table[b, t // PS]) * PS + t % PS for t in range(len(mine))],
                                 dtype=torch.long)
            assert torch.equal(cache.ckv_cache.view(-1, R)[slots], ckv[b][mine])
            assert torch.equal(cache.kpe_cache.view(-1, P)[slots], kpe[b][mine])
        # everything not owned stays untouched (NaN)
        assert int((~torch.isnan(cache.ckv_cache[..., 0])).sum()) == sum(int(x) for x in local)


def test_decode_write_slots_only_owner():
    n = 3
    bt = torch.arange(8, dtype=torch.int32).view(4, 2)
    seq = torch.tensor([0, 4, 5, 7], dtype=torch.int32)  # new tokens at 0, 4, 5, 7 -> owners 0, 1, 2, 1
    got = [dcp.decode_write_slots(bt, seq, PS, n, r) for r in range(n)]
    owners = (seq % n).tolist()
    for b in range(4):
        assert [int(g[b]) >= 0 for g in got] == [r == owners[b] for r in range(n)]
    # local position 5 // 3 = 1 on rank 2: page bt[2, 0] = 4, offset 1
    assert int(got[2][2]) == 4 * PS + 1


def test_write_past_capacity_raises():
    cache = DCPCache.allocate(DCPGroup(2, 0, "", torch.device("cpu")), 1, 8, R, P, PS, torch.float32)
    ckv, kpe = _tokens([9])
    with pytest.raises(ValueError, match="max_len"):
        cache.write_prefill(0, ckv[0], kpe[0])
    with pytest.raises(ValueError, match="^positions:"):
        dcp.prefill_write_slots(cache.block_table, 0, 0, 12, PS, 2, 0)  # local position 5 >= 4 slots


def test_no_slot_for_a_negative_position_or_a_foreign_request():
    """owner_slots: a negative position or a request outside the block table is an error eagerly (CPU), and
    -1 (skipped) where values are not read: check=False, or under torch.compile. Never a real slot."""
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    req, pos = torch.tensor([0, 1]), torch.tensor([2, -1])
    with pytest.raises(ValueError, match="^positions: must be >= 0, saw -1"):
        layout.owner_slots(bt, req, pos, 2, 1, 0)
    assert layout.owner_slots(bt, req, pos, 2, 1, 0, check=False).tolist() == [2, -1]
    for n, rank in [(2, 1), (3, 2)]:  # -1 % n would name rank n-1 the owner of local position -1
        assert layout.owner_slots(bt, req[1:], pos[1:], 2, n, rank, check=False).tolist() == [-1]
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=rf"^req_indices: must be in \[0, 2\).*saw {bad}"):
            layout.owner_slots(bt, torch.tensor([0, bad]), torch.tensor([0, 1]), 2)
        assert layout.owner_slots(bt, torch.tensor([0, bad]), torch.tensor([0, 1]), 2, check=False).tolist() == [6, -1]
    compiled = torch.compile(lambda r, p: layout.owner_slots(bt, r, p, 2), backend="eager", fullgraph=True)
    assert compiled(torch.tensor([0, -1, 1]), torch.tensor([-3, 1, 2])).tolist() == [-1, -1, 2 * 2 + 0]
    with pytest.raises(ValueError, match="^positions:"):
        dcp.write_slots(bt, req, pos, 2)
    for bad in (-1, 2, True):
        with pytest.raises(ValueError, match=r"^req_index: must be an int in \[0, 2\)"):
            dcp.prefill_write_slots(bt, bad, 0, 3, 2)
    assert dcp.prefill_write_slots(bt, 1, 0, 3, 2).tolist() == [0, 1, 4]


def test_layout_imports_nothing_of_ours():
    """layout is the bottom of the package: ops, caches and passes import it, it imports only torch."""
    import ast

    tree = ast.parse(open(layout.__file__).read())
    imported = [(node.level, node.module) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [(0, alias.name) for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    ours = [(lvl, mod) for lvl, mod in imported if lvl > 0 or (mod or "").startswith("mla_compile")]
    assert ours == [], ours


def test_init_dcp_single_process(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    g = init_dcp()
    assert (g.size, g.rank, g.group_name) == (1, 0, "")
    with pytest.raises(ValueError, match="^dcp_size:"):
        init_dcp(dcp_size=2)
