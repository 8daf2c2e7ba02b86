"""DCP fault injection on spawned gloo groups: every fault ends in an error on EVERY rank (or, where no host
sync is allowed, NaN in exactly the rows concerned), and the next well-formed call is correct.

Faults: ranks disagreeing on seq_lens, on shapes or sm_scale; a rank whose checks fail alone (it sends a
REJECT in the call's collective); a rank that skips a call and goes on with the next; a rank killed mid-run;
a rank stalling past `init_dcp(timeout=)`. Uses `test_dcp_gloo`'s harness (forkserver groups, process-group
and outer timeouts, only our own children killed). Recoverable faults are caught on the ranks (the
commands return the errors' texts), so one group serves them all.
"""

from __future__ import annotations

import math
import os
import signal
import time
from unittest import mock

import pytest
import torch

import test_dcp_gloo as base

# its module fixture (a process group pool) runs once: every test here on one xdist worker
# (README's test command: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_dcp_faults")

R, P, PS, H = 32, 8, 4, 4
SCALE = 1.0 / math.sqrt(R + P)
MAX_TOKENS = 40  # per request: tokens are prefixes of a fixed stream, whatever length a rank believes


# ============================================================================================ helpers (on a rank)
def _problem(ctx, lens, seed: int, heads: int = H, max_pages: int | None = None):
    """(q, q_pe, this rank's shard, the unsharded cache, seq_lens) for global `lens`; request b's tokens are a
    prefix of stream (seed, b), so ranks that disagree on one length still agree on every other request."""
    from mla_compile import paged

    ckv, kpe = [], []
    for b, L in enumerate(lens):
        g = torch.Generator().manual_seed(1000 * seed + b)
        ckv.append(torch.randn(MAX_TOKENS, R, generator=g)[:L])
        kpe.append(torch.randn(MAX_TOKENS, P, generator=g)[:L])
    g = torch.Generator().manual_seed(seed)
    q, qp = torch.randn(len(lens), heads, R, generator=g), torch.randn(len(lens), heads, P, generator=g)
    shard = paged.fill_sharded(ckv, kpe, PS, ctx.n, ctx.rank, max_pages=max_pages,
                               generator=torch.Generator().manual_seed(seed + 7 + ctx.rank))
    full = paged.fill_paged(ckv, kpe, PS, max_pages=max_pages, generator=torch.Generator().manual_seed(seed + 3))
    return q, qp, shard, full, torch.tensor(lens, dtype=torch.int32)


def _dcp(ctx, q, qp, shard, seq, scale=SCALE, group_name=None, block_table=None):
    return torch.ops.mla.dcp_decode(q, qp, shard.ckv_cache, shard.kpe_cache,
                                    shard.block_table if block_table is None else block_table, seq, scale, ctx.n,
                                    ctx.rank, group_name or ctx.group_name)


def _reference(q, qp, full, seq):
    return torch.ops.mla.decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, seq, SCALE)


def _error(fn) -> str:
    """The ValueError fn raises (the group survives it); a call that returns is a failure of the test."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("the call returned instead of raising ValueError")


def _good(ctx, seed: int, lens=(5, 9, 3, 0), group_name=None) -> bool:
    """A well-formed call (same lens everywhere) equals single-process decode over the unsharded cache."""
    q, qp, shard, full, seq = _problem(ctx, list(lens), seed)
    out, lse = _dcp(ctx, q, qp, shard, seq, group_name=group_name)
    ref_o, ref_l = _reference(q, qp, full, seq)
    base._close(out, ref_o, torch.float32, "out after the fault")
    base._close_lse(lse, ref_l, "lse after the fault")
    return True


def _rows_poisoned(out, lse, ref, bad: list[int]) -> bool:
    """NaN out and lse in exactly the rows `bad`; every other row equals the reference."""
    rows = torch.zeros(out.shape[0], dtype=torch.bool)
    rows[bad] = True
    assert bool(torch.isnan(out[rows]).all()) and bool(torch.isnan(lse[rows]).all()), "rows not poisoned"
    base._close(out[~rows], ref[0][~rows], torch.float32, "unpoisoned rows")
    base._close_lse(lse[~rows], ref[1][~rows], "unpoisoned rows")
    return True


# ============================================================================================ commands
def cmd_lens(ctx):
    """Rank 1 believes request 1 is one token longer."""
    from mla_compile.ops import _checks as C

    lens = [5, 9, 3, 0]
    mine = [5, 10, 3, 0] if ctx.rank == 1 else lens
    q, qp, shard, full, seq = _problem(ctx, mine, seed=1)
    res = {"eager": _error(lambda: _dcp(ctx, q, qp, shard, seq)), "good": _good(ctx, 2)}
    ref = _reference(q, qp, full, seq)
    # eager without host verdicts (CUDA's default): NaN rows, the same on every rank
    with mock.patch.object(C, "data_checks_enabled", lambda device: False):
        res["no_sync"] = _rows_poisoned(*_dcp(ctx, q, qp, shard, seq), ref, [1])
    # torch.compile (fullgraph, AOTAutograd decomposition): NaN rows; then a well-formed call is clean
    torch._dynamo.reset()
    step = torch.compile(lambda *a: torch.ops.mla.dcp_decode(*a, SCALE, ctx.n, ctx.rank, ctx.group_name),
                         backend="aot_eager", fullgraph=True)
    res["compiled"] = _rows_poisoned(*step(q, qp, shard.ckv_cache, shard.kpe_cache, shard.block_table, seq), ref, [1])
    q, qp, shard, full, seq = _problem(ctx, lens, seed=3)
    out, lse = step(q, qp, shard.ckv_cache, shard.kpe_cache, shard.block_table, seq)
    ref = _reference(q, qp, full, seq)
    res["compiled_good"] = _rows_poisoned(out, lse, ref, [])
    return res


def cmd_shapes(ctx):
    """Disagreeing shapes / sm_scale at a group's first call, from one rank alone, and from every rank."""
    import torch.distributed as dist

    name = dist.new_group(list(range(ctx.n))).group_name  # no agreed call on it yet
    r, res = ctx.rank, {}

    def call(lens, seed, heads=H, scale=SCALE):
        q, qp, shard, _, seq = _problem(ctx, lens, seed, heads=heads)
        return _error(lambda: _dcp(ctx, q, qp, shard, seq, scale=scale, group_name=name))

    res["first_call_batch"] = call([5, 9, 3] + [7] * (r == 1), 4)
    res["good1"] = _good(ctx, 5, (5, 9, 3), group_name=name)
    res["one_rank_batch"] = call([5, 9, 3] + [7] * (r == 1), 6)  # rank 1's exchange meets the others' data
    res["good2"] = _good(ctx, 7, (5, 9, 3), group_name=name)
    res["one_rank_heads"] = call([5, 9, 3], 8, heads=H + (r == 2))
    res["one_rank_scale"] = call([5, 9, 3], 9, scale=SCALE * (2 if r == 1 else 1))  # the same sizes
    res["every_rank_batch"] = call([5] * (4 + r), 10)  # every rank exchanges, three different sizes
    res["good3"] = _good(ctx, 11, (5, 9, 3, 1), group_name=name)  # every rank changes to B=4: agreed
    return res


def cmd_reject(ctx):
    """One rank's own checks fail (its shard): its REJECT makes every rank fail the same call."""
    from mla_compile.ops import _checks as C

    res = {}
    # block tables of 1 page (4 tokens); global length 13 puts 5 tokens on rank 0 only (4 on the others)
    q, qp, shard, _, _ = _problem(ctx, [12, 2], seed=12, max_pages=1)
    res["capacity"] = _error(lambda: _dcp(ctx, q, qp, shard, torch.tensor([13, 2], dtype=torch.int32)))
    res["good1"] = _good(ctx, 13)
    # rank 2's block table points past its page pool (mla.decode's data check, on rank 2 alone)
    q, qp, shard, _, seq = _problem(ctx, [5, 9, 3], seed=14)
    table = shard.block_table.clone()
    if ctx.rank == 2:
        table[1, 0] = 10_000
    res["block_table"] = _error(lambda: _dcp(ctx, q, qp, shard, seq, block_table=table))
    res["good2"] = _good(ctx, 15)
    # tp_dcp_decode: its block-table check runs before the q all-gather, so the REJECT travels in that gather
    hl = slice(ctx.rank * 2, ctx.rank * 2 + 2)
    q, qp, shard, full, seq = _problem(ctx, [5, 9, 3], seed=16, heads=2 * ctx.n)
    args = (q[:, hl].contiguous(), qp[:, hl].contiguous(), shard.ckv_cache, shard.kpe_cache)
    res["tp_block_table"] = _error(lambda: torch.ops.mla.tp_dcp_decode(
        *args, table if ctx.rank == 2 else shard.block_table, seq, SCALE, ctx.n, ctx.rank, ctx.group_name))
    out, lse = torch.ops.mla.tp_dcp_decode(*args, shard.block_table, seq, SCALE, ctx.n, ctx.rank, ctx.group_name)
    ref = _reference(q, qp, full, seq)
    res["tp_good"] = _rows_poisoned(out, lse, (ref[0][:, hl], ref[1][:, hl]), [])
    # tp, ranks disagreeing on seq_lens: the verdict on the q gather; without host verdicts, NaN rows
    mine = [5, 9, 4] if ctx.rank == 0 else [5, 9, 3]
    q, qp, shard, full, seq = _problem(ctx, mine, seed=17, heads=2 * ctx.n)
    args = (q[:, hl].contiguous(), qp[:, hl].contiguous(), shard.ckv_cache, shard.kpe_cache, shard.block_table, seq,
            SCALE, ctx.n, ctx.rank, ctx.group_name)
    res["tp_lens"] = _error(lambda: torch.ops.mla.tp_dcp_decode(*args))
    ref = _reference(q, qp, full, seq)
    with mock.patch.object(C, "data_checks_enabled", lambda device: False):
        res["tp_lens_no_sync"] = _rows_poisoned(*torch.ops.mla.tp_dcp_decode(*args), (ref[0][:, hl], ref[1][:, hl]),
                                                [2])
    return res


def cmd_skip(ctx):
    """Rank 1 fails OUTSIDE the op before call A and goes on with call B; the others make call A."""
    a, b = [5, 9, 3], [6, 10, 4]
    q, qp, shard, _, seq = _problem(ctx, b if ctx.rank == 1 else a, seed=20)
    res = {"skip_lens": _error(lambda: _dcp(ctx, q, qp, shard, seq)), "good1": _good(ctx, 21)}
    q, qp, shard, _, seq = _problem(ctx, b + [2] if ctx.rank == 1 else a, seed=22)  # B changes: an exchange
    res["skip_shape"] = _error(lambda: _dcp(ctx, q, qp, shard, seq))
    res["good2"] = _good(ctx, 23)
    return res


def cmd_die(ctx, bad: int):
    """Two good calls, then rank `bad` is SIGKILLed; the others go on to a third call."""
    _good(ctx, 30)
    _good(ctx, 31)
    if ctx.rank == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    _good(ctx, 32)
    return "survived"  # a peer returning here has not noticed the failure: the test fails


def cmd_stall(ctx, bad: int, stall_s: float):
    """Rank `bad` does not join for stall_s (past the DCP group's timeout); the others call dcp_decode."""
    if ctx.rank == bad:
        time.sleep(stall_s)
        return "stalled"
    _good(ctx, 40)
    return "survived"


def cmd_teardown(ctx):
    """Eager dcp_decode calls, then destroy_process_group while this rank still holds its DCPGroup: the gloo
    threads left after it (a group kept alive past it is torn down with the interpreter, which can abort the
    process: 'terminate called without an active exception')."""
    import torch.distributed as dist

    good = _good(ctx, 50) and _good(ctx, 51)
    dist.destroy_process_group()
    tasks = f"/proc/{os.getpid()}/task"
    names = [open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)] if os.path.isdir(tasks) else None
    return {"good": good, "threads": names}


COMMANDS = {f.__name__[4:]: f for f in (cmd_lens, cmd_shapes, cmd_reject, cmd_skip, cmd_die, cmd_stall,
                                        cmd_teardown)}


# ============================================================================================ tests
@pytest.fixture(scope="module")
def group():
    g = base.GlooGroup(3, pg_timeout_s=base.FAIL_PG_TIMEOUT_S, commands=__name__)
    yield g
    if not g.broken:
        g.close()


def _same_everywhere(res, key):
    assert all(r[key] == res[0][key] for r in res), [r[key] for r in res]
    return res[0][key]


def test_lens_disagreement_fails_every_rank_or_poisons_its_rows(group):
    res = group.run("lens", timeout=180)
    msg = _same_everywhere(res, "eager")  # the same ValueError on every rank, naming seq_lens and request 1
    assert msg.startswith("seq_lens: ") and "request(s) [1]" in msg and "rank 1: [10]" in msg, msg
    assert all(r["good"] and r["no_sync"] and r["compiled"] and r["compiled_good"] for r in res)


def test_shape_and_scale_disagreements_fail_every_rank(group):
    res = group.run("shapes")
    for key, arg, what in [("first_call_batch", "q_nope", "batch size"), ("one_rank_batch", "q_nope", "batch size"),
                           ("one_rank_heads", "q_nope", "query heads"), ("one_rank_scale", "sm_scale", "sm_scale"),
                           ("every_rank_batch", "q_nope", "batch size")]:
        msg = _same_everywhere(res, key)
        assert msg.startswith(f"{arg}: ") and what in msg, (key, msg)
    assert "rank 0: 3, rank 1: 4, rank 2: 3" in res[0]["one_rank_batch"]
    assert all(r["good1"] and r["good2"] and r["good3"] for r in res)


def test_one_rank_rejecting_fails_every_rank_in_the_same_call(group):
    res = group.run("reject")
    assert res[0]["capacity"].startswith("seq_lens: global length 13 puts 5 tokens on dcp rank 0 of 3")
    for r in (1, 2):
        assert res[r]["capacity"].startswith("seq_lens: dcp rank 0 of 3"), res[r]["capacity"]
        assert "rejected this call" in res[r]["capacity"]
    for key in ("block_table", "tp_block_table"):
        assert res[2][key].startswith("block_table: page index out of range"), res[2][key]
        for r in (0, 1):
            assert res[r][key].startswith("block_table: dcp rank 2 of 3"), res[r][key]
    assert _same_everywhere(res, "tp_lens").startswith("seq_lens: ")
    assert all(r["good1"] and r["good2"] and r["tp_good"] and r["tp_lens_no_sync"] for r in res)


def test_rank_skipping_a_call_is_caught_at_its_next_one(group):
    res = group.run("skip")
    assert _same_everywhere(res, "skip_lens").startswith("seq_lens: ")
    assert _same_everywhere(res, "skip_shape").startswith("q_nope: ")
    assert all(r["good1"] and r["good2"] for r in res)


def test_killed_rank_fails_every_peer_fast():
    g = base.GlooGroup(3, pg_timeout_s=base.FAIL_PG_TIMEOUT_S, commands=__name__)
    try:
        t0 = time.monotonic()
        with pytest.raises(base.RankError) as info:
            g.run("die", 1, timeout=base.FAIL_PG_TIMEOUT_S + 20)
        elapsed = time.monotonic() - t0
    finally:
        g.close()
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2] and "process died" in errors[1], errors
    for r in (0, 2):
        assert "dcp_decode" in errors[r] and "outer timeout" not in errors[r], errors[r]
    assert elapsed < base.FAIL_PG_TIMEOUT_S, f"took {elapsed:.1f}s"


def test_init_dcp_timeout_bounds_a_stalled_peer():
    """init_dcp(timeout=2) on a default group of timeout 60: the DCP group of its own times out in ~2 s."""
    g = base.GlooGroup(3, pg_timeout_s=60.0, dcp_timeout_s=2.0, commands=__name__)
    try:
        with pytest.raises(base.RankError) as info:
            g.run("stall", 2, 5.0, timeout=30)
    finally:
        g.close()
    errors = info.value.errors
    assert sorted(errors) == [0, 1], errors  # the stalled rank returns; its peers timed out
    for r in (0, 1):
        assert "dcp_decode" in errors[r] and "outer timeout" not in errors[r], errors[r]
    assert info.value.elapsed < 20, f"took {info.value.elapsed:.1f}s"


def test_destroy_process_group_frees_the_group_while_a_dcp_group_is_held():
    g = base.GlooGroup(2, commands=__name__)
    try:
        res = g.run("teardown")
    finally:
        g.close()
    assert all(r["good"] for r in res)
    if res[0]["threads"] is None:
        pytest.skip("no /proc: thread names unavailable")
    for r in res:
        assert not [t for t in r["threads"] if "gloo" in t], r["threads"]
