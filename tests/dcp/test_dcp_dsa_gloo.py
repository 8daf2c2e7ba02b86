"""`dsa::dcp_indexer_topk` (the DSA indexer over DCP shards: exact global top-k) across real gloo processes, and
the shared tie rule (`mla_compile.topk_order`) on one process.

Reuses `test_dcp_gloo`'s harness (forkserver rank groups, timeouts, fail-fast) with this file's commands added.
The reference is single-rank `dsa::indexer_topk` over the whole (unsharded) key cache; the ranks' selected tokens,
mapped back to global token indices, must be exactly its set (ties included: both break them to the lower index).
"""

from __future__ import annotations

import pytest
import torch

import test_dcp_gloo as base

# its module fixture (a process group pool) runs once: every test here on one xdist worker
# (README's test command: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_dcp_dsa_gloo")

DI, HI, PS = 32, 4, 4


@pytest.fixture(scope="module")
def groups():
    yield from base.group_pool(__name__)


# ============================================================================================ helpers
def slot_tokens(block_table: torch.Tensor, lens: list[int], n: int, rank: int) -> list[dict]:
    """Per request: physical slot -> GLOBAL token index, for a shard filled by `paged.fill_sharded`."""
    maps = []
    for b, L in enumerate(lens):
        local = len(range(rank, max(L, rank), n))
        maps.append({int(block_table[b, j // PS]) * PS + j % PS: j * n + rank for j in range(local)})
    return maps


def selected_tokens(idx: torch.Tensor, maps: list[dict]) -> list[list[int]]:
    return [sorted(maps[b][int(s)] for s in row if s >= 0) for b, row in enumerate(idx)]


def _problem(seed: int, n: int, B: int, ties: bool):
    """Keys, queries and weights (the same on every rank). ties: small integers with a power-of-two scale, so every
    score is exact in float32 whatever the summation order, and many tokens tie at the k-th place."""
    g = torch.Generator().manual_seed(seed)
    lens = base._random_lens(g, n, B, 40)
    lens[0] = 40  # one long row: a real top-k
    if ties:
        keys = [torch.randint(-1, 2, (L, DI), generator=g).float() for L in lens]
        q = torch.randint(-1, 2, (B, HI, DI), generator=g).float()
        w = torch.randint(0, 3, (B, HI), generator=g).float()
    else:
        keys = [torch.randn(L, DI, generator=g) for L in lens]
        q, w = torch.randn(B, HI, DI, generator=g), torch.rand(B, HI, generator=g)
    return lens, keys, q, w


# ============================================================================================ commands
def cmd_dcp_indexer(ctx, seed: int, topk: int, ties: bool, compiled: bool, B: int = 6):
    """This rank's selection (as global token indices) and the single-rank reference's, per request; compiled: also
    under torch.compile (fullgraph), which must equal eager."""
    from mla_compile import paged

    n, rank = ctx.n, ctx.rank
    lens, keys, q, w = _problem(seed, n, B, ties)
    none = [torch.zeros(L, 0) for L in lens]
    full = paged.fill_paged(keys, none, PS, generator=torch.Generator().manual_seed(seed + 1))
    sh = paged.fill_sharded(keys, none, PS, n, rank, generator=torch.Generator().manual_seed(seed + 2 + rank))
    seq = torch.tensor(lens, dtype=torch.int32)
    scale = 0.25 if ties else DI ** -0.5
    idx = torch.ops.dsa.dcp_indexer_topk(q, w, sh.ckv_cache, sh.block_table, seq, topk, scale, n, rank,
                                         ctx.group_name)
    assert idx.shape == (B, topk) and idx.dtype == torch.int32
    for row in idx:  # owned slots first, then -1
        k = int((row >= 0).sum())
        assert bool((row[:k] >= 0).all()) and bool((row[k:] == -1).all())
    ref = torch.ops.dsa.indexer_topk(q, w, full.ckv_cache, full.block_table, seq, topk, scale)
    # did an exact tie straddle the k-th place (so the tie rule decided the set)? per request
    score = torch.relu(scale * torch.einsum("bhd,btd->bht", q, torch.nn.utils.rnn.pad_sequence(keys, True)))
    score = torch.einsum("bh,bht->bt", w, score)
    ref_sets = selected_tokens(ref, slot_tokens(full.block_table, lens, 1, 0))
    tied = [L > topk and float(score[b, ref_sets[b]].min()) == float(score[b, [t for t in range(L)
            if t not in ref_sets[b]]].max()) for b, L in enumerate(lens)]
    same = True
    if compiled:  # the same selection compiled (fullgraph): equal to eager
        torch._dynamo.reset()
        step = torch.compile(lambda *a: torch.ops.dsa.dcp_indexer_topk(*a, topk, scale, n, rank, ctx.group_name),
                             backend="mla_dcp", fullgraph=True, dynamic=False)
        same = torch.equal(step(q, w, sh.ckv_cache, sh.block_table, seq), idx)
    return dict(lens=lens, mine=selected_tokens(idx, slot_tokens(sh.block_table, lens, n, rank)), compiled=same,
                ref=ref_sets, tied=tied)


def cmd_dcp_indexer_bad(ctx):
    """Bad arguments: a ValueError naming the argument on every rank, also when only one rank's call is bad."""
    from mla_compile import paged

    n, rank = ctx.n, ctx.rank
    sh = paged.fill_sharded([torch.randn(9, DI)], [torch.zeros(9, 0)], PS, n, rank)
    q, w, seq = torch.randn(1, HI, DI), torch.rand(1, HI), torch.tensor([9], dtype=torch.int32)
    ok = (q, w, sh.ckv_cache, sh.block_table, seq, 4, 0.1, n, rank, ctx.group_name)
    cases = [
        (ok[:7] + (n + 1,) + ok[8:], "dcp_size"),
        (ok[:9] + ("not-a-group",), "group_name"),
        ((q[:, :, :8],) + ok[1:], "k_cache"),
        ((q, w[:, :2]) + ok[2:], "weights"),
        (ok[:4] + (torch.tensor([-3], dtype=torch.int32),) + ok[5:], "seq_lens"),
        (ok[:5] + (0,) + ok[6:], "topk"),
        # only rank 0 is wrong: its peers fail the same call, naming the same argument
        (ok[:5] + (5 if rank == 0 else 4,) + ok[6:], "topk"),
        (ok[:4] + (torch.tensor([9 if rank else 10_000], dtype=torch.int32),) + ok[5:], "seq_lens"),
    ]
    seen = []
    for args, _ in cases:
        try:
            torch.ops.dsa.dcp_indexer_topk(*args)
            seen.append(None)
        except ValueError as e:
            seen.append(str(e).split(":", 1)[0])
    torch.ops.dsa.dcp_indexer_topk(*ok)  # the group still works after the failures
    return seen


COMMANDS = {f.__name__[4:]: f for f in (cmd_dcp_indexer, cmd_dcp_indexer_bad)}


# ============================================================================================ tests
@pytest.mark.parametrize("n", [2, 3])
def test_dcp_indexer_is_the_single_rank_selection(groups, n):
    g = groups(n)
    for seed, topk, ties in [(n, 8, False), (10 + n, 8, True), (20 + n, 3, True), (30 + n, 64, False)]:
        res = g.run("dcp_indexer", seed, topk, ties, seed == 10 + n)
        lens, ref = res[0]["lens"], res[0]["ref"]
        assert all(r["compiled"] for r in res), "compiled differs from eager"
        if ties:  # the data makes the tie rule decide at least one request's set
            assert any(res[0]["tied"]), (seed, topk)
        for b, L in enumerate(lens):
            union = sorted(t for r in res for t in r["mine"][b])
            assert len(union) == len(set(union)) == min(topk, L), (b, L, union)
            assert union == ref[b], (n, seed, b, union, ref[b])
            for rank, r in enumerate(res):  # each rank lists only tokens it owns
                assert all(t % n == rank for t in r["mine"][b])


def test_dcp_indexer_bad_args_fail_every_rank(groups):
    got = groups(2).run("dcp_indexer_bad")
    want = ["dcp_size", "group_name", "k_cache", "weights", "seq_lens", "topk", "topk", "seq_lens"]
    assert got == [want, want], got


# ============================================================================================ one process
def test_tie_rule_is_lower_index_and_total():
    from mla_compile import topk_order

    score = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, float("nan"), 3.0, float("inf"), -float("inf"), 2.0]])
    valid = torch.ones_like(score, dtype=torch.bool)
    valid[0, 9] = False
    pos, picked = topk_order.top_positions(score, valid, 9)
    # inf first; the three 3.0s by index; 1.0; the two zeros (-0.0 == 0.0) by index; then NaN / -inf (both clamped
    # to -max, by index); the invalid column never
    assert pos[0].tolist() == [7, 1, 2, 6, 0, 3, 4, 5, 8] and bool(picked.all())
    pos, picked = topk_order.top_positions(score, valid, 10)
    assert picked[0].tolist() == [True] * 9 + [False]


def test_single_rank_indexer_breaks_ties_to_lower_token():
    from mla_compile import paged

    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-1, 2, (30, DI), generator=g).float()
    keys[5:25] = keys[4]  # 21 identical keys: an exact tie across the k-th place
    pb = paged.fill_paged([keys], [torch.zeros(30, 0)], PS, generator=g)
    q, w = torch.ones(1, HI, DI), torch.ones(1, HI)
    idx = torch.ops.dsa.indexer_topk(q, w, pb.ckv_cache, pb.block_table, pb.seq_lens, 8, 0.25)
    got = sorted(slot_tokens(pb.block_table, [30], 1, 0)[0][int(s)] for s in idx[0])
    score = torch.relu(0.25 * keys @ q[0].T).sum(-1)
    order = sorted(range(30), key=lambda t: (-float(score[t]), t))  # the rule, written out
    assert got == sorted(order[:8])


def test_dcp_indexer_single_rank_opcheck():
    from mla_compile import paged

    g = torch.Generator().manual_seed(1)
    pb = paged.fill_paged([torch.randn(11, DI, generator=g), torch.randn(0, DI)],
                          [torch.zeros(11, 0), torch.zeros(0, 0)], PS, generator=g)
    args = (torch.randn(2, HI, DI, generator=g), torch.rand(2, HI, generator=g), pb.ckv_cache, pb.block_table,
            pb.seq_lens, 4, 0.2, 1, 0, "")
    assert torch.equal(torch.ops.dsa.dcp_indexer_topk(*args), torch.ops.dsa.indexer_topk(*args[:7]))
    torch.library.opcheck(torch.ops.dsa.dcp_indexer_topk.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
