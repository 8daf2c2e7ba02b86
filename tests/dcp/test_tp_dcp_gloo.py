"""`mla::tp_dcp_decode` (TP x DCP: heads sharded by rank, KV token-cyclic) across real gloo processes.

Reuses `test_dcp_gloo`'s harness (forkserver rank groups, timeouts, fail-fast): the workers run that file's
`_worker` with this file's commands added to its command table.
"""

from __future__ import annotations

import math

import pytest
import torch

import test_dcp_gloo as base

# its module fixture (a process group pool) runs once: every test here on one xdist worker
# (README's test command: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_tp_dcp_gloo")

R, P, PS = 32, 8, 4
HL = 2  # heads per rank; H = n * HL


@pytest.fixture(scope="module")
def groups():
    yield from base.group_pool(__name__)


# ============================================================================================ commands
def _problem(ctx, seed: int, dtype, B: int, max_prefill: int):
    """Global tokens and queries (identical on every rank), the full cache and this rank's shard."""
    from mla_compile import paged

    n = ctx.n
    g = torch.Generator().manual_seed(seed)
    lens = base._random_lens(g, n, B, max_prefill)  # includes 0, 0 < L < n, n, n + 1
    ckv = [torch.randn(L, R, generator=g).to(dtype) for L in lens]
    kpe = [torch.randn(L, P, generator=g).to(dtype) for L in lens]
    q = torch.randn(B, n * HL, R, generator=g).to(dtype)
    qp = torch.randn(B, n * HL, P, generator=g).to(dtype)
    full = paged.fill_paged(ckv, kpe, PS, generator=torch.Generator().manual_seed(seed + 1))
    shard = paged.fill_sharded(ckv, kpe, PS, n, ctx.rank, generator=torch.Generator().manual_seed(seed + 2 + ctx.rank))
    return lens, q, qp, full, shard, torch.tensor(lens, dtype=torch.int32)


def cmd_tp_decode(ctx, seed: int, dtype_name: str, B: int = 7, max_prefill: int = 23):
    """This rank's heads over all ranks' tokens == single-process decode (and float64) on its head slice."""
    from reference import ref_decode

    n, rank, dtype = ctx.n, ctx.rank, getattr(torch, dtype_name)
    lens, q, qp, full, sh, seq = _problem(ctx, seed, dtype, B, max_prefill)
    scale = 1.0 / math.sqrt(R + P)
    mine = slice(rank * HL, (rank + 1) * HL)
    qn, qpn = q[:, mine].contiguous(), qp[:, mine].contiguous()

    out, lse = torch.ops.mla.tp_dcp_decode(qn, qpn, sh.ckv_cache, sh.kpe_cache, sh.block_table, seq, scale, n, rank,
                                           ctx.group_name)
    assert out.shape == (B, HL, R) and out.dtype == dtype and lse.shape == (B, HL) and lse.dtype == torch.float32
    ref_o, ref_l = torch.ops.mla.decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, seq, scale)
    base._close(out, ref_o[:, mine], dtype, "out vs decode")
    base._close_lse(lse, ref_l[:, mine], "lse vs decode")
    o64, l64 = ref_decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, seq, scale)
    base._close(out, o64[:, mine], dtype, "out vs float64")
    base._close_lse(lse, l64[:, mine], "lse vs float64")
    empty = seq == 0
    assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all()), "length 0 -> (0, -inf)"

    # the same partials merged by pure DCP (all heads, replicated q): bit-identical on this rank's heads
    d_o, d_l = torch.ops.mla.dcp_decode(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, seq, scale, n, rank,
                                        ctx.group_name)
    assert torch.equal(out, d_o[:, mine]) and torch.equal(lse, d_l[:, mine]), "differs from dcp_decode's merge"

    # every other row empty at once (some ranks then hold no token of any row)
    masked = torch.where(torch.arange(B) % 2 == 0, torch.zeros_like(seq), seq)
    o_m, l_m = torch.ops.mla.tp_dcp_decode(qn, qpn, sh.ckv_cache, sh.kpe_cache, sh.block_table, masked, scale, n,
                                           rank, ctx.group_name)
    r_o, r_l = torch.ops.mla.decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, masked, scale)
    base._close(o_m, r_o[:, mine], dtype, "masked out")
    base._close_lse(l_m, r_l[:, mine], "masked lse")
    assert bool((o_m[::2] == 0).all()) and bool(torch.isneginf(l_m[::2]).all())
    return {"lens": lens, "out": out, "lse": lse}


def cmd_tp_compile(ctx, seed: int, dtype_name: str = "float32", B: int = 5):
    """tp_dcp_decode under torch.compile(backend="mla_dcp", fullgraph=True): one Dynamo node; Inductor's code
    holds both collectives, decode and merge; equals eager; new lengths reuse the graph."""
    from torch._inductor.utils import run_and_get_code

    from mla_compile.backend import mla_dcp

    n, rank, dtype = ctx.n, ctx.rank, getattr(torch, dtype_name)
    _, q, qp, _, sh, seq = _problem(ctx, seed, dtype, B, 40)
    scale = 1.0 / math.sqrt(R + P)
    mine = slice(rank * HL, (rank + 1) * HL)

    def step(qn, qpn, ckv, kpe, table, lens):
        return torch.ops.mla.tp_dcp_decode(qn, qpn, ckv, kpe, table, lens, scale, n, rank, ctx.group_name)

    dynamo_graphs = []

    def backend(gm, example_inputs):
        dynamo_graphs.append(gm)
        return mla_dcp(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    checks = {}
    for i, L in enumerate([seq, torch.tensor([5, 0, 1, 40, 33], dtype=torch.int32)]):
        args = (q[:, mine].contiguous(), qp[:, mine].contiguous(), sh.ckv_cache, sh.kpe_cache, sh.block_table, L)
        eager = step(*args)
        if i == 0:
            got, code = run_and_get_code(compiled, *args)
            code = "\n".join(code)
            for key in ("all_gather_into_tensor", "all_to_all_single", "wait_tensor", "mla.decode",
                        "mla.merge_states"):
                checks[key] = key in code
        else:
            got = compiled(*args)
        base.assert_compiled_matches_eager(got, eager, dtype)
    checks["dynamo_graphs"] = len(dynamo_graphs)
    targets = [str(nd.target) for nd in dynamo_graphs[0].graph.nodes if nd.op == "call_function"]
    checks["dynamo_tp_dcp_nodes"] = sum("tp_dcp_decode" in t for t in targets)
    return checks


def cmd_tp_bad_args(ctx):
    """Bad arguments: ValueError naming the argument, raised before any collective (so no rank hangs)."""
    from mla_compile import paged

    n, rank = ctx.n, ctx.rank
    sh = paged.fill_sharded([torch.randn(5, R)], [torch.randn(5, P)], PS, n, rank)
    q, qp = torch.randn(1, HL, R), torch.randn(1, HL, P)
    seq = torch.tensor([5], dtype=torch.int32)
    cache = (sh.ckv_cache, sh.kpe_cache, sh.block_table)
    cases = [
        ((q, qp, *cache, seq, 0.1, n + 1, rank, ctx.group_name), "dcp_size"),
        ((q, qp, *cache, seq, 0.1, n, (rank + 1) % n, ctx.group_name), "dcp_rank"),
        ((q, qp, *cache, seq, 0.1, n, rank, "not-a-group"), "group_name"),
        ((q, torch.randn(1, HL + 1, P), *cache, seq, 0.1, n, rank, ctx.group_name), "q_pe"),
        ((q[:, :0], qp[:, :0], *cache, seq, 0.1, n, rank, ctx.group_name), "q_nope"),
        ((q, qp, *cache, torch.tensor([-1], dtype=torch.int32), 0.1, n, rank, ctx.group_name), "seq_lens"),
        ((q, qp, *cache, torch.tensor([10_000], dtype=torch.int32), 0.1, n, rank, ctx.group_name), "seq_lens"),
    ]
    seen = []
    for args, arg in cases:
        try:
            torch.ops.mla.tp_dcp_decode(*args)
        except ValueError as e:
            assert str(e).startswith(f"{arg}:"), str(e)
            seen.append(arg)
    return seen


COMMANDS = {f.__name__[4:]: f for f in (cmd_tp_decode, cmd_tp_compile, cmd_tp_bad_args)}


# ============================================================================================ tests
@pytest.mark.parametrize("n", [2, 4])
def test_tp_dcp_matches_single_process_on_own_heads(groups, n):
    g = groups(n)
    for seed, dtype in [(n, "float32"), (20 + n, "bfloat16")]:
        res = g.run("tp_decode", seed, dtype)
        lens = res[0]["lens"]
        assert 0 in lens and any(0 < L < n for L in lens)
        assert all(r["lens"] == lens for r in res)
        # the ranks' head slices differ (each rank returned ITS heads, not a replicated result)
        assert not torch.equal(res[0]["out"], res[1]["out"])


@pytest.mark.parametrize("n", [2, 4])
def test_tp_dcp_bad_args_are_value_errors(groups, n):
    want = ["dcp_size", "dcp_rank", "group_name", "q_pe", "q_nope", "seq_lens", "seq_lens"]
    assert groups(n).run("tp_bad_args") == [want] * n


def test_tp_dcp_single_rank_is_decode_and_opchecks():
    from mla_compile import paged

    g = torch.Generator().manual_seed(3)
    ckv, kpe = [torch.randn(9, R, generator=g), torch.randn(0, R)], [torch.randn(9, P, generator=g), torch.randn(0, P)]
    pb = paged.fill_paged(ckv, kpe, PS, generator=g)
    q, qp = torch.randn(2, 3, R, generator=g), torch.randn(2, 3, P, generator=g)
    args = (q, qp, pb.ckv_cache, pb.kpe_cache, pb.block_table, pb.seq_lens, 0.2)
    got = torch.ops.mla.tp_dcp_decode(*args, 1, 0, "")
    want = torch.ops.mla.decode(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.library.opcheck(torch.ops.mla.tp_dcp_decode.default, (*args, 1, 0, ""),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp_dcp_compile_mla_dcp_backend_n2(groups, dtype):
    """bf16: the lse crosses the all-to-all bit-cast into two bf16 columns (a size-changing view Inductor lowers)."""
    for checks in groups(2).run("tp_compile", 7, dtype, timeout=300):
        assert checks["dynamo_graphs"] == 1 and checks["dynamo_tp_dcp_nodes"] == 1, checks
        assert all(checks[k] for k in ("all_gather_into_tensor", "all_to_all_single", "wait_tensor", "mla.decode",
                                       "mla.merge_states")), checks
