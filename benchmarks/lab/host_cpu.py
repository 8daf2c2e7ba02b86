"""The ops' eager host path on a CPU: every op's CUDA impl run on CPU tensors, kernel launches stubbed.

Question: how much Python does an eager call of each op pay between `torch.ops.<op>(...)` and its kernel launches
(dispatcher, the autograd shortcut, the plan lookup, allocations, views, frames), measured on any machine, so a
change to that path can be timed before and after in one run without a GPU. What it leaves out: the C launcher,
the CUDA caching allocator and the device / stream queries (stubbed: torch._C's CUDA getters return 0, so the
default-stream scratch path is taken as on the GPU). The H200 host ran this Python ~3-4x slower than a laptop core
(benchmarks/RESULTS.md, host block), so the numbers are for comparing paths, not for the issue's goals.

How: each op's registered CUDA kernel is also registered (in this process only) for the CPU dispatch key, plans
accept CPU tensors as if on device 0, and `kernels._launch.Bound` launches nothing.

    python benchmarks/lab/host_cpu.py [--calls 20000] [--json out.json] [--profile mla.decode ...]

A/B against another commit: `git worktree add /tmp/base <rev>`, then run this file with HOST_ROOT=/tmp/base and
without, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # plans build their launches without a GPU
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import host_overhead as HO  # noqa: E402  (HOST_ROOT=<checkout>: that checkout's mla_compile)
import mla_compile.ops  # noqa: E402


def _cpu_as_cuda(counts: dict | None = None, stub_launches: bool = True) -> None:
    """Route the CPU dispatch key of our ops to their CUDA impls and let plans key CPU tensors. `counts`: count each
    op's CUDA-impl calls in it (by qualname; a wrapper, so not for timing). stub_launches False: the kernels run
    (under TRITON_INTERPRET=1, `check`)."""
    from mla_compile.kernels import _launch, scratch
    from mla_compile.ops import _plans, _registry

    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    scratch._stream = lambda index: 0
    make_scratch = scratch.Scratch.__init__

    def scratch_on_device_0(self, *args, **kwargs):  # the default-stream scratch path a CUDA call takes
        make_scratch(self, *args, **kwargs)
        self.index = 0

    scratch.Scratch.__init__ = scratch_on_device_0
    if stub_launches:
        _launch.Bound.__call__ = lambda self, *args: None
    cpu, cuda = torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA
    for registered in _ops(_registry):
        if cuda in registered._kernels:
            kernel = registered._kernels[cuda]
            if counts is not None:
                kernel = _counted(kernel, registered.qualname, counts)
            with warnings.catch_warnings():  # replacing the CPU impl is the point here
                warnings.simplefilter("ignore")
                registered._lib.impl(registered.name, kernel, "CPU")
            registered._kernels[cpu] = kernel
            registered._below.clear()
    plain = _plans._PLAIN

    def lookup(self, tensors, scalars):
        key = []
        for t in tensors:
            if t is None:
                key.append(None)
            elif type(t) in plain:
                key += (t.dtype, 0, t.shape, t.stride(), t.data_ptr() & 15)
            else:
                return None, None
        env = _plans._switches()
        for a in scalars:
            key += (type(a), a)
        key += (0, _plans.tuning.current(), env)
        key = tuple(key)
        return key, self._plans.get(key)

    _plans.Plans.lookup = lookup


def _counted(kernel, qualname: str, counts: dict):
    def counting(*args, **kwargs):
        counts[qualname] = counts.get(qualname, 0) + 1
        return kernel(*args, **kwargs)

    return counting


def _kept_plans() -> int:
    """Plans kept by every op's `Plans` (ops/_plans.py; module attributes of mla_compile.ops.*): the calls went the
    planned way."""
    from mla_compile.ops._plans import Plans

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("mla_compile.ops.")]
    return sum(len(v._plans) for m in modules for v in vars(m).values() if isinstance(v, Plans))


def _ops(registry) -> list:
    """Our registered ops (`_registry.OPS`; an older tree without it, for A/B runs: found among live objects)."""
    if hasattr(registry, "OPS"):
        return list(registry.OPS.values())
    import gc

    return [o for o in gc.get_objects() if isinstance(o, registry.Op)]


def _check_cases():
    """name -> (a call of the op on small CPU tensors): decode of one and S query tokens, [B] and [B, S] limits,
    index lists of one and S tokens, the DSA indexer and k-only indices of one and S tokens, FP8 cache writes;
    shuffled pages whose unused slots hold NaN."""
    from mla_compile import paged

    g = torch.Generator().manual_seed(3)
    R, P, PS, H, dt = 32, 16, 16, 4, torch.bfloat16
    lens = [37, 5]
    batch = paged.fill_paged([torch.randn(n, R, generator=g).to(dt) for n in lens],
                             [torch.randn(n, P, generator=g).to(dt) for n in lens], PS, generator=g, spare_pages=1)
    c, k, bt, sl = batch.ckv_cache, batch.kpe_cache, batch.block_table, batch.seq_lens

    def q(*lead):
        return torch.randn(*lead, R, generator=g).to(dt), torch.randn(*lead, P, generator=g).to(dt)

    (q3, p3), (q4, p4), (q1, p1) = q(2, H), q(2, 2, H), q(2, 1, H)
    # S query tokens in other layouts: rows padded (the fold [B, S*H] still a view of q: the plan reads q as it is),
    # heads before tokens and tokens before requests (no view folds them: the plan reshapes each call)
    q4_pad, p4_pad = (torch.randn(2, 2, H, w + 8, generator=g).to(dt)[..., :w] for w in (R, P))
    q4_ht, p4_ht = (t.transpose(1, 2) for t in q(2, H, 2))
    q4_sb, p4_sb = (t.transpose(0, 1) for t in q(2, 2, H))
    limits = torch.tensor([[30, 37], [4, 5]], dtype=torch.int32)
    tokens = torch.tensor([[3, 17, -1, 36], [4, 0, 2, -1]])  # positions < each length, -1: none
    idx3 = torch.where(tokens >= 0, bt.long().gather(1, tokens.clamp_min(0) // PS) * PS + tokens.clamp_min(0) % PS,
                       -1).int()  # their physical slots
    idx4 = torch.stack([idx3, idx3.flip(1)], 1)  # [B, S, K]
    d, sd = torch.ops.mla.decode, torch.ops.mla.sparse_decode
    # the DSA indexer on small integers (every score exact: the kernel and the CPU impl rank alike, ties included),
    # keys on pages of 16, top 8 of up to 37 tokens (lengths 37 and 5: one row ranked, one the k-only identity)
    Di, Hi, k_cache = 16, 4, torch.randint(-3, 4, (batch.ckv_cache.shape[0], PS, 16), generator=g).to(dt)

    def iq(*lead):
        return (torch.randint(-3, 4, (*lead, Hi, Di), generator=g).to(dt),
                torch.randint(0, 3, (*lead, Hi), generator=g).float())

    (iq3, iw3), (iq4, iw4) = iq(2), iq(2, 2)
    iq4_sb, iw4_sb = (t.transpose(0, 1) for t in iq(2, 2))  # tokens before requests: no view folds them
    it, ko = torch.ops.dsa.indexer_topk, torch.ops.dsa.k_only_indices
    # FP8 cache writes (R 128, P 16 bf16 rope: one scale group), into a fresh buffer each call (the result compared)
    from mla_compile import fp8

    new_c, new_k = torch.randn(3, 128, generator=g).to(dt), torch.randn(3, 16, generator=g).to(dt)
    slots = torch.tensor([5, -1, 40])

    def write_tokens():
        buf = fp8.allocate(4, PS, 128, 16, torch.device("cpu"), dt)[0].zero_()
        torch.ops.mla.cache_write_fp8_tokens(buf, new_c, new_k, slots)
        return buf

    def write_views():
        buf = fp8.allocate(4, PS, 128, 16, torch.device("cpu"), dt)[0].zero_()
        c8, sc, kp = fp8.views(buf, 128, dt)
        torch.ops.mla.cache_write_fp8(c8, kp, sc, new_c, new_k, slots)
        return buf

    return {
        "cache_write_fp8_tokens": write_tokens,
        "cache_write_fp8": write_views,
        "indexer_topk": lambda: it(iq3, iw3, k_cache, bt, sl, 8, 1.0),
        "indexer_topk S=2": lambda: it(iq4, iw4, k_cache, bt, sl, 8, 1.0),
        "indexer_topk S=2 tokens first": lambda: it(iq4_sb, iw4_sb, k_cache, bt, sl, 8, 1.0),
        "k_only_indices": lambda: ko(bt, sl, PS, 64),
        "k_only_indices S=2": lambda: ko(bt, sl, PS, 64, 2),
        "decode": lambda: d(q3, p3, c, k, bt, sl, 0.2),
        "decode S=2": lambda: d(q4, p4, c, k, bt, sl, 0.2),
        "decode S=2 limits": lambda: d(q4, p4, c, k, bt, limits, 0.2),
        "decode S=1 limits": lambda: d(q1, p1, c, k, bt, limits[:, 1:].contiguous(), 0.2),
        "sparse_decode": lambda: sd(q3, p3, c, k, idx3, 0.2),
        "sparse_decode S=2": lambda: sd(q4, p4, c, k, idx4, 0.2),
        "decode S=2 padded rows": lambda: d(q4_pad, p4_pad, c, k, bt, sl, 0.2),
        "decode S=2 heads first": lambda: d(q4_ht, p4_ht, c, k, bt, limits, 0.2),
        "sparse_decode S=2 padded": lambda: sd(q4_pad, p4_pad, c, k, idx4, 0.2),
        "sparse_decode S=2 tokens first": lambda: sd(q4_sb, p4_sb, c, k, idx4.transpose(0, 1).contiguous()
                                                     .transpose(0, 1), 0.2),
    }


def check() -> dict:
    """The CUDA impls, rerouted to CPU tensors with their kernels interpreted (TRITON_INTERPRET=1), against the CPU
    impls on the same calls: each call twice (a plan made, then found as a recent signature). Returns name ->
    (max |out - ref| / max |ref|, max |lse - ref| over finite lses, same empty rows)."""
    cases = _check_cases()
    with torch.no_grad():
        want = {name: call() for name, call in cases.items()}
        _cpu_as_cuda(stub_launches=False)
        res = {}
        for name, call in cases.items():
            for _ in range(2):
                got = call()
            if isinstance(got, torch.Tensor):  # slot lists, written cache bytes: exactly the CPU impl's
                res[name] = (0.0 if torch.equal(got, want[name]) else float("inf"), 0.0, True,
                             got.shape == want[name].shape)
                continue
            out, lse = got
            w_out, w_lse = want[name]
            finite = torch.isfinite(w_lse)
            e_out = float((out.float() - w_out.float()).abs().max() / w_out.float().abs().max())
            e_lse = float((lse[finite] - w_lse[finite]).abs().max()) if finite.any() else 0.0
            res[name] = (e_out, e_lse, bool(torch.equal(torch.isfinite(lse), finite)), tuple(out.shape) ==
                         tuple(w_out.shape))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plans", action="store_true",
                    help="check the path instead of timing it alone: count each op's CUDA-impl calls and kept plans")
    ap.add_argument("--compiled", action="store_true",
                    help="also the ops inside default-mode compiled graphs (host_overhead.bench_compiled)")
    ap.add_argument("--profile", nargs="*", default=[], metavar="OP", help="cProfile these ops' calls (own us per call)")
    ap.add_argument("--check", action="store_true",
                    help="instead: the CUDA impls' results (kernels interpreted) against the CPU impls'")
    a = ap.parse_args(argv)
    if a.check:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--check interprets the kernels: run with TRITON_INTERPRET=1 set before Python starts")
        res = check()
        ok = all(eo < 2e-2 and el < 1e-2 and empty and shape for eo, el, empty, shape in res.values())
        for name, row in res.items():
            print(f"check {name:20s} out {row[0]:.1e} lse {row[1]:.1e} empty rows {row[2]} shape {row[3]}")
        if a.json:
            a.json.write_text(json.dumps({"check": res, "ok": ok}, indent=1))
        return 0 if ok else 1
    counts = {} if a.plans else None
    _cpu_as_cuda(counts)
    t = HO.tensors("cpu")
    fns = dict(HO.op_calls(t))
    fns["floor: torch.add"] = lambda: torch.add(t["x"], 1)
    fns["floor: 4x torch.empty"] = lambda: [torch.empty(16) for _ in range(4)]
    print("mla_compile from", Path(mla_compile.ops.__file__).parents[1])
    with torch.no_grad():
        t0 = time.perf_counter()
        res = HO.host_us_interleaved(fns, a.calls)
    for name, us in res.items():
        print(f"{name:28s} {us:7.2f} us")
    print(f"(wall {time.perf_counter() - t0:.1f} s)")
    compiled = HO.bench_compiled(a.calls, "cpu") if a.compiled else {}
    if compiled:
        for name, row in compiled.items():
            print(f"compiled {name:20s} {row['us']:6.2f} us a call inside a graph (one-call graph "
                  f"{row['graph_us']:.2f}); eager {row['eager_us']:.2f}")
    for name in a.profile:
        with torch.no_grad():
            for row in HO.profile_call(fns[name], a.calls):
                print(f"{name}: {row['own_us_per_op']:6.2f} us own {row['cum_us_per_op']:6.2f} us cum  {row['function']}")
    if a.json:
        d = {"provenance": "cpu, launches stubbed", "torch": torch.__version__,
             "mla_compile": str(Path(mla_compile.ops.__file__).parents[1]), "ops": res, "compiled": compiled}
        if counts is not None:  # op row -> CUDA-impl calls
            d["plans"] = {name: counts.get(name.split(" ")[0].replace(".", "::"), 0) for name in res
                          if not name.startswith("floor")}
            d["kept_plans"] = _kept_plans()
        a.json.write_text(json.dumps(d, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
