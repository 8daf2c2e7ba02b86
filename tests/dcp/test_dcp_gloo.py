"""`mla::dcp_decode` across real processes: gloo groups of n ranks on CPU.

One group of worker processes per n is started once (forkserver with torch preloaded, so a rank costs a
fork, not a torch import) and reused for several checks; each check is a function below run on every rank
(other test modules add theirs: `GlooGroup(n, commands="module")`). Process groups have timeouts, every
command has an outer timeout, and a rank that fails reports its traceback and exits so its peers'
collectives fail fast: a test never hangs.
"""

from __future__ import annotations

import datetime
import importlib
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import traceback

import pytest
import torch

# its module fixture (a process group pool) runs once: every test here on one xdist worker
# (README's test command: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_dcp_gloo")

R, P, PS, H = 32, 8, 4, 4
PG_TIMEOUT_S = 60.0  # every collective of a healthy group
FAIL_PG_TIMEOUT_S = 10.0  # the groups of the failure tests
START_TIMEOUT_S = 150.0  # first start pays the forkserver's torch import (slow on a busy 2-core box)
CMD_TIMEOUT_S = 120.0


# ============================================================================================ the harness
class RankError(AssertionError):
    """Some ranks failed; `errors` maps rank -> its traceback (or how it died)."""

    def __init__(self, errors: dict[int, str], elapsed: float):
        self.errors, self.elapsed = errors, elapsed
        super().__init__(f"{len(errors)} rank(s) failed after {elapsed:.1f}s:\n" + "\n".join(
            f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items())))


class _Ctx:
    """What a command sees on its rank."""

    def __init__(self, rank, n, group):
        self.rank, self.n, self.group = rank, n, group
        self.group_name = group.group_name


def _worker(rank: int, n: int, init_file: str, pg_timeout_s: float, conn, dcp_timeout_s, commands) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from mla_compile.distributed import init_dcp

    try:
        if commands:  # another test module's commands (it imports this one, so ours stay)
            COMMANDS.update(importlib.import_module(commands).COMMANDS)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        ctx = _Ctx(rank, n, init_dcp(timeout=dcp_timeout_s))
        conn.send(("ok", os.getpid()))
    except BaseException:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))
        os._exit(1)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, args = msg
        try:
            conn.send(("ok", COMMANDS[name](ctx, *args)))
        except BaseException:  # noqa: BLE001
            # the group may be half way through a collective: leave, so peers fail now, not at the timeout
            conn.send(("err", f"rank {rank}: {traceback.format_exc()}"))
            conn.close()
            os._exit(1)
    if dist.is_initialized():  # a command may have destroyed it (cmd_teardown)
        dist.destroy_process_group()
    conn.close()


class GlooGroup:
    """n worker processes in one gloo process group; `run(command, *args)` runs a command on every rank.

    `dcp_timeout_s`: the DCP group is `init_dcp(timeout=...)` (a group of its own) instead of the default group;
    `commands`: a test module whose COMMANDS the workers add to this module's."""

    def __init__(self, n: int, pg_timeout_s: float = PG_TIMEOUT_S, dcp_timeout_s: float | None = None,
                 commands: str | None = None):
        self.n, self.broken = n, False
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "mla_compile", "mla_compile.distributed"])
        self.tmp = tempfile.mkdtemp(prefix="dcp_gloo_")
        init_file = os.path.join(self.tmp, "store")  # FileStore rendezvous: no TCP port to collide on
        self.procs, self.conns = [], []
        for r in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, n, init_file, pg_timeout_s, child, dcp_timeout_s, commands),
                            daemon=True, name=f"dcp-gloo-{n}-r{r}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.pids = self._collect(START_TIMEOUT_S)

    def run(self, name: str, *args, timeout: float = CMD_TIMEOUT_S):
        for c in self.conns:
            c.send((name, args))
        return self._collect(timeout)

    def _collect(self, timeout: float):
        t0 = time.monotonic()
        results, errors, pending = [None] * self.n, {}, set(range(self.n))
        while pending:
            left = t0 + timeout - time.monotonic()
            if left <= 0:
                break
            waitables = {}
            for r in pending:
                waitables[self.conns[r]] = r
                waitables[self.procs[r].sentinel] = r
            for obj in mp.connection.wait(list(waitables), left):
                r = waitables[obj]
                if r not in pending:
                    continue
                conn = self.conns[r]
                try:
                    if obj is not conn and not conn.poll():
                        raise EOFError
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self.procs[r].join(1)
                    status, payload = "err", f"rank {r}: process died (exit code {self.procs[r].exitcode})"
                pending.discard(r)
                if status == "ok":
                    results[r] = payload
                else:
                    errors[r] = payload
        elapsed = time.monotonic() - t0
        for r in pending:
            self.procs[r].kill()  # our own worker, by handle
            errors[r] = f"rank {r}: no answer within the {timeout:.0f}s outer timeout (killed)"
        if errors:
            self.close()
            raise RankError(errors, elapsed)
        return results

    def close(self):
        self.broken = True
        for c, p in zip(self.conns, self.procs):
            try:
                if p.is_alive():
                    c.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()  # only our own workers, by handle
                p.join(5)
        for c in self.conns:
            c.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def group_pool(commands: str | None = None):
    """A module fixture's body: get(n) -> a live GlooGroup of n ranks running `commands` (a test module's name;
    this module's commands by default), spawned once and reused by the module's tests (a broken one is
    respawned); all closed at the end."""
    live: dict[int, GlooGroup] = {}

    def get(n: int) -> GlooGroup:
        if n not in live or live[n].broken:
            live[n] = GlooGroup(n) if commands is None else GlooGroup(n, commands=commands)
        return live[n]

    yield get
    for g in live.values():
        if not g.broken:
            g.close()


@pytest.fixture(scope="module")
def groups():
    yield from group_pool()


_WORKER_GROUPS: dict = {}  # per worker process: tp -> its TP x DCP group (made once; a group is a collective)


def worker_group(ctx, tp: int):
    """In a worker: this rank's (TP x) DCP group: the harness's world group for pure DCP (tp 0), else
    `init_dcp(tp_size=tp, dcp_size=n // tp)`, made once per worker."""
    import types

    from mla_compile.distributed import init_dcp

    if tp == 0:
        return types.SimpleNamespace(size=ctx.n, rank=ctx.rank, group_name=ctx.group_name)
    if tp not in _WORKER_GROUPS:
        _WORKER_GROUPS[tp] = init_dcp(tp_size=tp, dcp_size=ctx.n // tp)
    return _WORKER_GROUPS[tp]


# ============================================================================================ commands
def _dtype(name):
    return getattr(torch, name)


def _random_lens(g: torch.Generator, n: int, B: int, max_prefill: int) -> list[int]:
    """Always includes L = 0, a length < n, L = n, L = n + 1; the rest random."""
    fixed = [0, max(1, n - 1) if n > 1 else 1, n, n + 1]
    rest = torch.randint(0, max_prefill + 1, (max(0, B - len(fixed)),), generator=g).tolist()
    lens = (fixed + rest)[:B]
    perm = torch.randperm(B, generator=g).tolist()
    return [lens[i] for i in perm]


def _close(a, b, dtype, what):
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(a.double(), b.double(), **tol, msg=lambda m: f"{what}: {m}")


def _close_lse(a, b, what):
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"{what}: -inf pattern differs"
    fin = torch.isfinite(b)
    torch.testing.assert_close(a.double()[fin], b.double()[fin], atol=1e-4, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def cmd_prefill_decode(ctx: _Ctx, seed: int, dtype_name: str, B: int = 7, steps: int = 9, max_prefill: int = 23):
    """Chunked prefill then `steps` decode steps, all through owner writes; every step dcp_decode equals
    single-process mla::decode over the unsharded cache (and the float64 reference at the ends)."""
    from mla_compile import layout, paged
    from mla_compile.distributed import DCPCache, DCPGroup
    from reference import ref_decode

    n, rank, dtype = ctx.n, ctx.rank, _dtype(dtype_name)
    g = torch.Generator().manual_seed(seed)  # identical stream on every rank: replicated model state
    lens = _random_lens(g, n, B, max_prefill)
    total = [L + steps for L in lens]
    max_len = max(total) + 3
    ckv = [torch.randn(T, R, generator=g).to(dtype) for T in total]
    kpe = [torch.randn(T, P, generator=g).to(dtype) for T in total]
    scale = 1.0 / math.sqrt(R + P)

    nan = float("nan")  # unwritten slots are NaN: a read outside the owned tokens poisons the result
    cache = DCPCache.allocate(ctx.group, B, max_len, R, P, PS, dtype, fill=nan)
    full = DCPCache.allocate(DCPGroup.single(), B, max_len, R, P, PS, dtype, fill=nan)
    assert cache.block_table.shape[1] * PS >= layout.local_capacity(max_len, n)
    for b, L in enumerate(lens):  # chunked prefill: random chunk sizes, same on every rank
        start = 0
        while start < L:
            T = int(torch.randint(1, L - start + 1, (1,), generator=g))
            for c in (cache, full):
                c.write_prefill(b, ckv[b][start:start + T], kpe[b][start:start + T])
            start += T
    assert cache.seq_lens.tolist() == lens

    trace = []
    for s in range(steps + 1):
        q = torch.randn(B, H, R, generator=g).to(dtype)
        qp = torch.randn(B, H, P, generator=g).to(dtype)
        out, lse = cache.decode(q, qp, scale)
        ref_o, ref_l = full.decode(q, qp, scale)  # dcp_size 1: mla::decode over the whole cache
        assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (B, H, R)
        _close(out, ref_o, dtype, f"step {s} out")
        _close_lse(lse, ref_l, f"step {s} lse")
        if s in (0, steps):  # independent float64 reference
            o64, l64 = ref_decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, full.seq_lens, scale)
            _close(out, o64, dtype, f"step {s} out vs float64")
            _close_lse(lse, l64, f"step {s} lse vs float64")
        if s == 0:
            # rows with length 0 (and < n) at once; and a shuffled block table built by paged.fill_sharded
            masked = torch.where(torch.arange(B) % 2 == 0, torch.zeros_like(cache.seq_lens), cache.seq_lens)
            o_m, l_m = torch.ops.mla.dcp_decode(q, qp, cache.ckv_cache, cache.kpe_cache, cache.block_table, masked,
                                                scale, n, rank, ctx.group_name)
            r_m = torch.ops.mla.decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, masked, scale)
            _close(o_m, r_m[0], dtype, "masked out")
            _close_lse(l_m, r_m[1], "masked lse")
            assert bool((o_m[::2] == 0).all()) and bool(torch.isneginf(l_m[::2]).all())
            sh = paged.fill_sharded([x[:L] for x, L in zip(ckv, lens)], [x[:L] for x, L in zip(kpe, lens)], PS,
                                    n, rank, generator=torch.Generator().manual_seed(100 + rank))
            o_s, l_s = torch.ops.mla.dcp_decode(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table,
                                                torch.tensor(lens, dtype=torch.int32), scale, n, rank, ctx.group_name)
            _close(o_s, ref_o, dtype, "fill_sharded out")
            _close_lse(l_s, ref_l, "fill_sharded lse")
        trace.append((out, lse))
        if s < steps:  # the new token of every request: written by its owner only
            pos = cache.lens[:]
            new_c = torch.stack([ckv[b][pos[b]] for b in range(B)])
            new_k = torch.stack([kpe[b][pos[b]] for b in range(B)])
            before = torch.isnan(cache.ckv_cache[..., 0]).sum()
            cache.write_decode(new_c, new_k)
            full.write_decode(new_c, new_k)
            owned = sum(int(p % n == rank) for p in pos)
            assert int(before - torch.isnan(cache.ckv_cache[..., 0]).sum()) == owned, "only the owner writes"
    assert cache.seq_lens.tolist() == total
    return {"lens": lens, "outs": torch.stack([o for o, _ in trace]), "lses": torch.stack([l for _, l in trace])}


def cmd_compile(ctx: _Ctx, seed: int, inductor: bool, dtype_name: str = "float32"):
    """dcp_decode under torch.compile(fullgraph=True): one Dynamo node, decomposed by AOT into decode +
    all_gather_into_tensor + wait_tensor + merge_states; with backend="mla_dcp" (Inductor) the collective is
    in the generated code. Matches eager; a second call with new lengths reuses the graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import run_and_get_code

    from mla_compile import paged

    n, rank, dtype = ctx.n, ctx.rank, _dtype(dtype_name)
    g = torch.Generator().manual_seed(seed)
    lens = [0, 1, n, 17, 29]
    B, max_len = len(lens), 40
    ckv = [torch.randn(max_len, R, generator=g).to(dtype) for _ in lens]
    kpe = [torch.randn(max_len, P, generator=g).to(dtype) for _ in lens]
    sh = paged.fill_sharded(ckv, kpe, PS, n, rank, generator=torch.Generator().manual_seed(rank))
    name = ctx.group_name

    def step(q, qp, ckv_cache, kpe_cache, block_table, seq_lens):
        out, lse = torch.ops.mla.dcp_decode(q, qp, ckv_cache, kpe_cache, block_table, seq_lens, 0.125, n, rank, name)
        return out * 2.0, lse  # something around the op, as in a model

    dynamo_graphs, aot_graphs = [], []

    def capture_aot(gm, example_inputs):
        aot_graphs.append(gm)
        return gm.forward

    def backend(gm, example_inputs):
        dynamo_graphs.append(gm)
        if inductor:
            from mla_compile.backend import mla_dcp

            return mla_dcp(gm, example_inputs)
        return aot_autograd(fw_compiler=capture_aot)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    checks = {}
    for i, L in enumerate([lens, [5, 0, 2, 40, 33]]):
        seq = torch.tensor(L, dtype=torch.int32)
        q, qp = torch.randn(B, H, R, generator=g).to(dtype), torch.randn(B, H, P, generator=g).to(dtype)
        args = (q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, seq)
        eager = step(*args)
        if inductor and i == 0:
            got, code = run_and_get_code(compiled, *args)
            code = "\n".join(code)
            checks["inductor_all_gather"] = "_c10d_functional.all_gather_into_tensor" in code
            checks["inductor_wait"] = "_c10d_functional.wait_tensor" in code
            checks["inductor_decode"] = "mla.decode" in code
            checks["inductor_merge"] = "mla.merge_states" in code
        else:
            got = compiled(*args)
        assert_compiled_matches_eager(got, eager, dtype)
    checks["dynamo_graphs"] = len(dynamo_graphs)
    targets = [str(nd.target) for nd in dynamo_graphs[0].graph.nodes if nd.op == "call_function"]
    checks["dynamo_dcp_nodes"] = sum("dcp_decode" in t for t in targets)
    if aot_graphs:
        aot_targets = [str(nd.target) for nd in aot_graphs[0].graph.nodes if nd.op == "call_function"]
        checks["aot_targets"] = sorted({t for t in aot_targets if "mla" in t or "c10d" in t})
    return checks


def assert_compiled_matches_eager(got, eager, dtype):
    """(out, lse) of a compiled DCP decode vs the same call eagerly: same -inf pattern, values close."""
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: Inductor may round the packs differently
    torch.testing.assert_close(got[0], eager[0], atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(eager[1]))
    torch.testing.assert_close(got[1], eager[1], atol=1e-6, rtol=1e-6)


def cmd_group_mismatch(ctx: _Ctx):
    """dcp_size / dcp_rank that disagree with the named group: ValueError naming the argument (no collective)."""
    from mla_compile import paged

    sh = paged.fill_sharded([torch.randn(5, R)], [torch.randn(5, P)], PS, ctx.n, ctx.rank)
    q, qp = torch.randn(1, H, R), torch.randn(1, H, P)
    base = (q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, torch.tensor([5], dtype=torch.int32), 0.1)
    seen = []
    for size, rank, name, arg in [(ctx.n + 1, ctx.rank, ctx.group_name, "dcp_size"),
                                  (ctx.n, (ctx.rank + 1) % ctx.n, ctx.group_name, "dcp_rank"),
                                  (ctx.n, ctx.rank, "not-a-group", "group_name")]:
        try:
            torch.ops.mla.dcp_decode(*base, size, rank, name)
        except ValueError as e:
            assert str(e).startswith(f"{arg}:"), str(e)
            seen.append(arg)
    return seen


def cmd_fail(ctx: _Ctx, mode: str, bad_rank: int):
    """Rank `bad_rank` raises / exits / is SIGKILLed; the others enter a dcp_decode collective."""
    from mla_compile import paged

    if ctx.rank == bad_rank:
        if mode == "raise":
            raise RuntimeError(f"boom from rank {ctx.rank}")
        if mode == "exit":
            os._exit(3)
        if mode == "stall":  # alive but never joins the collective: only the timeouts can save the peers
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    sh = paged.fill_sharded([torch.randn(9, R)], [torch.randn(9, P)], PS, ctx.n, ctx.rank)
    q, qp = torch.randn(1, H, R), torch.randn(1, H, P)
    torch.ops.mla.dcp_decode(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, torch.tensor([9], dtype=torch.int32),
                             0.1, ctx.n, ctx.rank, ctx.group_name)
    return "survived"  # a peer that returns here has not noticed the failure: the test fails


COMMANDS = {f.__name__[4:]: f for f in (cmd_prefill_decode, cmd_compile, cmd_group_mismatch, cmd_fail)}


# ============================================================================================ tests
def _same_on_every_rank(results):
    for r, res in enumerate(results[1:], 1):
        assert torch.equal(res["outs"], results[0]["outs"]), f"rank {r} out differs from rank 0"
        assert torch.equal(res["lses"], results[0]["lses"]), f"rank {r} lse differs from rank 0"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_prefill_then_decode_matches_single_process(groups, n):
    g = groups(n)
    for seed, dtype in [(n, "float32"), (10 + n, "bfloat16")]:
        res = g.run("prefill_decode", seed, dtype)
        assert any(L == 0 for L in res[0]["lens"]) and any(0 < L < n for L in res[0]["lens"]) or n == 1
        _same_on_every_rank(res)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_group_mismatch_is_value_error(groups, n):
    assert groups(n).run("group_mismatch") == [["dcp_size", "dcp_rank", "group_name"]] * n


@pytest.mark.parametrize("n", [3, 4])
def test_compile_aot_decomposes_into_collective(groups, n):
    for checks in groups(n).run("compile", 5, False):
        assert checks["dynamo_graphs"] == 1 and checks["dynamo_dcp_nodes"] == 1, checks
        assert checks["aot_targets"] == ["_c10d_functional.all_gather_into_tensor.default",
                                         "_c10d_functional.wait_tensor.default", "mla.decode.default",
                                         "mla.merge_states.default"], checks


def test_compile_mla_dcp_backend_n2(groups):
    """torch.compile(backend=mla_dcp, fullgraph=True) on gloo: Inductor code holds the collective; == eager.
    bf16: the lse travels bit-cast into two bf16 columns (a size-changing view that Inductor must lower)."""
    for checks in groups(2).run("compile", 6, True, "bfloat16", timeout=300):
        assert checks["dynamo_graphs"] == 1 and checks["dynamo_dcp_nodes"] == 1, checks
        assert checks["inductor_all_gather"] and checks["inductor_wait"], checks
        assert checks["inductor_decode"] and checks["inductor_merge"], checks


@pytest.mark.parametrize("mode", ["raise", "exit", "kill"])
def test_failing_rank_fails_every_rank_fast(mode):
    n, bad = 3, 1
    g = GlooGroup(n, pg_timeout_s=FAIL_PG_TIMEOUT_S)
    try:
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            g.run("fail", mode, bad, timeout=FAIL_PG_TIMEOUT_S + 20)
        elapsed = time.monotonic() - t0
    finally:
        g.close()
    errors = info.value.errors
    assert sorted(errors) == list(range(n)), errors  # every rank errored, none hung or "survived"
    assert not any("outer timeout" in e for e in errors.values()), errors  # the ranks errored on their own
    if mode == "raise":
        assert "boom from rank 1" in errors[bad]
    else:
        assert "process died" in errors[bad]
    for r in range(n):
        if r != bad:
            assert "Traceback" in errors[r] and "dcp_decode" in errors[r], errors[r]
    assert elapsed < FAIL_PG_TIMEOUT_S + 10, f"took {elapsed:.1f}s"


def test_stalled_rank_times_out_every_peer():
    """A rank that never joins the collective: peers fail at the process-group timeout, the stalled rank is
    killed by the outer timeout; nothing hangs."""
    n, bad, pg_timeout, outer = 3, 2, 3.0, 8.0
    g = GlooGroup(n, pg_timeout_s=pg_timeout)
    try:
        with pytest.raises(RankError) as info:
            g.run("fail", "stall", bad, timeout=outer)
    finally:
        g.close()
    errors = info.value.errors
    assert sorted(errors) == list(range(n)), errors
    assert "outer timeout" in errors[bad]
    for r in range(n):
        if r != bad:
            assert "dcp_decode" in errors[r] and "outer timeout" not in errors[r], errors[r]
    assert info.value.elapsed < outer + 5


@pytest.mark.slow
def test_n8_prefill_decode_and_compile():
    g = GlooGroup(8)
    try:
        _same_on_every_rank(g.run("prefill_decode", 8, "float32", timeout=300))
        _same_on_every_rank(g.run("prefill_decode", 18, "bfloat16", timeout=300))
        for checks in g.run("compile", 8, False, timeout=300):
            assert checks["dynamo_dcp_nodes"] == 1 and "_c10d_functional.all_gather_into_tensor.default" in \
                checks["aot_targets"], checks
    finally:
        g.close()
