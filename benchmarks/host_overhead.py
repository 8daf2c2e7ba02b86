"""Host time per call of every op (issue 29): what an eager call or a default-mode compiled graph (no CUDA graphs)
pays on the CPU before the GPU sees a kernel.

usage:  python benchmarks/host_overhead.py OUT.json [--calls 300] [--ops-only]

HOST_ROOT=<another checkout> times that checkout's mla_compile with this script (A/B runs of two commits on one
host: `bash benchmarks/device.sh hostab`); `--ops-only` times the ops table alone.

Parts, each in OUT.json and printed:
  ops          (CUDA) every op at a small shape (B 1, H 16, 1K tokens: a few microseconds of GPU work), called
               `--calls` times back to back; host us per call = the loop's wall time before its closing sync / calls
               (the launch queue holds them all). Next to them the peers' entry points timed the same way
               (FlashInfer's `run` after its `plan`, FlashMLA's decode on a fused cache) and floors (an aten add,
               four torch.empty).
  layers       (CUDA) `mla.decode` split into its layers: the op through the dispatcher (its plan kept per signature,
               ops/_plans.py), the CUDA entry without the op (kernels.dispatch.decode: a plan made per call, what the
               op paid before plans), one split (no merge kernel, a plan made per call), the check alone; the op
               and one split again with every launch through Triton's own `JITFunction.run` (kernels/_launch.py's
               cached path off).
  registration the dispatcher's cost of one op registered two ways with the same trivial body: torch.library.custom_op
               vs `mla_compile.ops._registry.define` (what every op of ours pays per call; CPU tensors).
  checks       each op's input check: a repeated signature (what every call after the first pays: `once_per_signature`)
               vs the whole check (every remembered signature forgotten first); on meta tensors where no GPU is there.
  glue         the Python of an unplanned Triton decode call between the op and the kernels (kernels.dispatch.decode
               with the Triton launches stubbed out: choice, plan made, plan run), on the device's tensors (CPU ones
               where no GPU is there).
  compiled     (CUDA) the host us per call of a few ops inside a default-mode compiled graph: a compiled function of
               two calls of the op less one of one call, beside the op's eager call in the same loop.
  profile      (CUDA) cProfile of `--calls` eager `mla.decode` calls: the top functions by own time.

Where it ran is in `provenance` ("cuda: <GPU name>" or "cpu"); report.py's `host` block shows the CUDA runs.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.environ.get("HOST_ROOT"):  # A/B: another checkout's mla_compile, ahead of this one and an editable install's
    sys.path.insert(0, os.environ["HOST_ROOT"])
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
import mla_compile.ops  # noqa: E402,F401  (registers the ops)
from mla_compile import fp8  # noqa: E402
from mla_compile.ops import _checks as C  # noqa: E402
from mla_compile.ops import _registry, attention, cache, dsa, experts, linear, merge  # noqa: E402

B, H, R, P, PS, L, DT = 1, 16, 512, 64, 64, 1024, torch.bfloat16


REPEATS = 5  # a row: the median of this many loops (one loop's mean swung by ~2x between rows of one run)


def host_us(fn, calls: int) -> float:
    """Wall time of one call, launches queued but not waited for (one warm call first): the median over REPEATS
    loops of calls // REPEATS calls each, the GPU drained between loops."""
    return host_us_interleaved({"call": fn}, calls)["call"]


def tensors(device) -> dict:
    """One small call's arguments for every op (meta tensors time the checks only)."""
    g = dict(device=device)
    real = device != "meta"
    rnd = (lambda *s, dtype=DT: torch.randn(*s, dtype=dtype, device=device)) if real else \
          (lambda *s, dtype=DT: torch.empty(*s, dtype=dtype, device=device))
    pages = L // PS + 1
    t = dict(qn=rnd(B, H, R), qp=rnd(B, H, P), qn2=rnd(B, 2, H, R), qp2=rnd(B, 2, H, P), ckv=rnd(pages, PS, R),
             qn128=rnd(B, 128, R), qp128=rnd(B, 128, P),
             kpe=rnd(pages, PS, P),
             table=torch.arange(L // PS, dtype=torch.int32, **g)[None] if real else torch.empty(1, L // PS,
                                                                                              dtype=torch.int32, **g),
             lens=torch.full((B,), L, dtype=torch.int32, **g) if real else torch.empty(B, dtype=torch.int32, **g),
             idx=(torch.randperm(L, **g)[:256].int()[None] if real else torch.empty(B, 256, dtype=torch.int32, **g)),
             idx2=(torch.randperm(L, **g)[:512].int().view(B, 2, 256) if real else
                   torch.empty(B, 2, 256, dtype=torch.int32, **g)),
             outs=rnd(4, B, H, R), lses=rnd(4, B, H, dtype=torch.float32),
             ckv_new=rnd(1, R), kpe_new=rnd(1, P), slots=(torch.tensor([5], **g) if real else
                                                          torch.empty(1, dtype=torch.int64, **g)),
             x=rnd(1, 2048), w_a=rnd(1536, 2048), w_b=rnd(576, 2048), xh=rnd(B, H, 128), wh=rnd(H, R, 128),
             xe=rnd(2, 2048), we=rnd(8, 1024, 2048), eid=(torch.tensor([1, 6], **g) if real else
                                                          torch.empty(2, dtype=torch.int64, **g)),
             iq=rnd(B, 64, 128), iw=rnd(B, 64, dtype=torch.float32), ik=rnd(pages, PS, 128),
             iq2=rnd(B, 2, 64, 128), iw2=rnd(B, 2, 64, dtype=torch.float32),
             fp8_buf=torch.zeros(pages, PS, fp8.token_bytes(R, P, DT), dtype=torch.uint8, **g) if real else
             torch.empty(pages, PS, fp8.token_bytes(R, P, DT), dtype=torch.uint8, **g))
    return t


def op_calls(t: dict) -> dict:
    """name -> a zero-argument call of each op through the dispatcher."""
    ops = torch.ops
    return {
        "mla.decode": lambda: ops.mla.decode(t["qn"], t["qp"], t["ckv"], t["kpe"], t["table"], t["lens"], 0.1),
        # two query tokens per request (MTP / speculative verification: q [B, S, H, *])
        "mla.decode S=2": lambda: ops.mla.decode(t["qn2"], t["qp2"], t["ckv"], t["kpe"], t["table"], t["lens"], 0.1),
        # 128 heads: a DCP rank's (heads replicated); on sm_90 a Gluon kernel with TMA descriptors
        "mla.decode H=128": lambda: ops.mla.decode(t["qn128"], t["qp128"], t["ckv"], t["kpe"], t["table"], t["lens"],
                                                   0.1),
        "mla.sparse_decode": lambda: ops.mla.sparse_decode(t["qn"], t["qp"], t["ckv"], t["kpe"], t["idx"], 0.1),
        "mla.sparse_decode S=2": lambda: ops.mla.sparse_decode(t["qn2"], t["qp2"], t["ckv"], t["kpe"], t["idx2"], 0.1),
        "mla.merge_states": lambda: ops.mla.merge_states(t["outs"], t["lses"]),
        "mla.cache_write": lambda: ops.mla.cache_write(t["ckv"], t["kpe"], t["ckv_new"], t["kpe_new"], t["slots"]),
        "mla.cache_write_fp8_tokens": lambda: ops.mla.cache_write_fp8_tokens(t["fp8_buf"], t["ckv_new"], t["kpe_new"],
                                                                             t["slots"]),
        "mla.fused_linear": lambda: ops.mla.fused_linear(t["x"], [t["w_a"], t["w_b"]]),
        "mla.linear_partials": lambda: ops.mla.linear_partials(t["x"], [t["w_a"], t["w_b"]], 4),
        "mla.per_head_linear": lambda: ops.mla.per_head_linear(t["xh"], t["wh"]),
        "mla.expert_linear": lambda: ops.mla.expert_linear(t["xe"], t["we"], t["eid"]),
        "dsa.indexer_topk": lambda: ops.dsa.indexer_topk(t["iq"], t["iw"], t["ik"], t["table"], t["lens"], 256, 0.1),
        "dsa.indexer_topk S=2": lambda: ops.dsa.indexer_topk(t["iq2"], t["iw2"], t["ik"], t["table"], t["lens"], 256,
                                                             0.1),
        "dsa.k_only_indices": lambda: ops.dsa.k_only_indices(t["table"], t["lens"], PS, 2048),
        "dsa.k_only_indices S=2": lambda: ops.dsa.k_only_indices(t["table"], t["lens"], PS, 2048, 2),
    }


def check_calls(t: dict) -> dict:
    """name -> (the memoized check, its arguments)."""
    return {
        "mla.decode": (attention.check_decode_args, (t["qn"], t["qp"], t["ckv"], t["kpe"], t["table"], t["lens"], 0.1)),
        "mla.sparse_decode": (attention.check_sparse_args, (t["qn"], t["qp"], t["ckv"], t["kpe"], t["idx"], 0.1)),
        "mla.merge_states": (merge.check_merge_args, (t["outs"], t["lses"])),
        "mla.cache_write": (cache.check_cache_write_args, (t["ckv"], t["kpe"], t["ckv_new"], t["kpe_new"], t["slots"])),
        "mla.fused_linear": (linear.check_fused_linear_args, (t["x"], [t["w_a"], t["w_b"]])),
        "mla.per_head_linear": (linear.check_per_head_linear_args, (t["xh"], t["wh"])),
        "mla.expert_linear": (experts.check_expert_linear_args, (t["xe"], t["we"], t["eid"])),
        "dsa.indexer_topk": (dsa.check_indexer_args, (t["iq"], t["iw"], t["ik"], t["table"], t["lens"], 256, 0.1)),
    }


def bench_checks(device: str, calls: int) -> dict:
    out = {}
    for name, (check, args) in check_calls(tensors(device)).items():
        out[name] = {"repeated_us": host_us(lambda: check(*args), calls),
                     "whole_us": host_us(lambda: (C.forget_signatures(), check(*args)), calls)}
    return out


def bench_registration(calls: int) -> dict:
    """The same trivial body registered both ways (CPU tensors: the dispatcher's own cost)."""
    x = torch.zeros(4)

    def body(x):
        return x.new_empty(x.shape)

    if not hasattr(torch.ops.host_probe, "via_define"):  # once per process
        torch.library.custom_op("host_probe::via_custom_op", body, mutates_args=(), schema="(Tensor x) -> Tensor")
        _registry.define("host_probe::via_define", schema="(Tensor x) -> Tensor")(body)
    return {"custom_op_us": host_us(lambda: torch.ops.host_probe.via_custom_op(x), calls * 10),
            "define_us": host_us(lambda: torch.ops.host_probe.via_define(x), calls * 10),
            "body_alone_us": host_us(lambda: body(x), calls * 10)}


def host_us_interleaved(fns: dict, calls: int) -> dict:
    """`host_us` of several calls side by side: REPEATS rounds, each timing one loop of every call in turn, and
    each row the median of its loops (a host that drifts during the run moves every row alike)."""
    for fn in fns.values():
        fn()
    per_loop = max(1, calls // REPEATS)
    loops = {name: [] for name in fns}
    cuda = torch.cuda.is_available()
    for _ in range(REPEATS):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(per_loop):
                fn()
            loops[name].append((time.perf_counter() - t0) / per_loop * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return {name: sorted(v)[len(v) // 2] for name, v in loops.items()}


def bench_ops(calls: int) -> dict:
    t = tensors("cuda")
    fns = dict(op_calls(t))
    fns["floor: torch.add"] = lambda: torch.add(t["x"], 1)
    fns["floor: 4x torch.empty"] = lambda: [torch.empty(16, device="cuda") for _ in range(4)]
    from mla_compile.kernels import flashinfer_mla as FI
    from mla_compile.kernels import flashmla as FMLA

    if FI.available():
        run = FI.plan(t["qn"], t["qp"], t["ckv"], t["table"], t["lens"], 0.1).raw
        fns["peer: flashinfer run"] = lambda: run(t["qn"], t["qp"], t["ckv"], t["kpe"])
    if FMLA.available():
        fckv, fkpe = FMLA.fused_caches(t["ckv"].shape[0], PS, R, P, DT, torch.device("cuda"))
        fns["peer: flashmla decode (fused cache)"] = lambda: FMLA.decode(t["qn"], t["qp"], fckv, fkpe, t["table"],
                                                                          t["lens"], 0.1)
    return host_us_interleaved(fns, calls)


COMPILED = ("mla.decode", "mla.sparse_decode", "mla.merge_states", "mla.cache_write", "dsa.indexer_topk")


def _compiled(fn):
    return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)


def _chained(t: dict) -> dict:
    """name -> call(q_nope) for the ops whose output `out` can be the next call's q_nope (same shape and dtype)."""
    ops = torch.ops
    return {
        "mla.decode": lambda qn: ops.mla.decode(qn, t["qp"], t["ckv"], t["kpe"], t["table"], t["lens"], 0.1),
        "mla.sparse_decode": lambda qn: ops.mla.sparse_decode(qn, t["qp"], t["ckv"], t["kpe"], t["idx"], 0.1),
    }


def bench_compiled(calls: int, device: str = "cuda") -> dict:
    """Host us per call of each op inside a default-mode compiled graph (torch.compile, Inductor, no CUDA graphs):
    a compiled function of three calls less one of one call, halved, so the graph's own cost (guards, AOTAutograd's
    wrapper, input checks) cancels; `graph_us` is the one-call function's whole time, `eager_us` the op's eager
    call, timed in the same loop. `method` "chain": each call's out is the next call's q_nope and the function
    returns the last call's outputs, so both functions return as many tensors (a model's graph returns none of
    these either). "outputs": the function returns every call's outputs (ops that cannot chain; their row also
    holds the graph's handling of the extra outputs, a few us each on a CPU core). Inductor keeps every call: no CSE
    of our ops, and the chained or returned outputs are used."""
    t = tensors(device)
    calls_by_name, chained = op_calls(t), _chained(t)
    fns, methods = {}, {}
    for name in COMPILED:
        call = calls_by_name[name]
        if name in chained:
            one, qn = chained[name], t["qn"]
            methods[name] = "chain"
            fns[name + " x1"] = _compiled(lambda one=one, qn=qn: one(qn))
            fns[name + " x3"] = _compiled(lambda one=one, qn=qn: one(one(one(qn)[0])[0]))
        else:
            methods[name] = "outputs"
            fns[name + " x1"] = _compiled(lambda call=call: call())
            fns[name + " x3"] = _compiled(lambda call=call: (call(), call(), call()))
        fns[name + " eager"] = call
    with torch.no_grad():
        rows = host_us_interleaved(fns, calls)
    return {name: {"us": (rows[name + " x3"] - rows[name + " x1"]) / 2, "graph_us": rows[name + " x1"],
                   "eager_us": rows[name + " eager"], "method": methods[name]} for name in COMPILED}


def bench_layers(calls: int) -> dict:
    from mla_compile.kernels import _launch, dispatch

    t = tensors("cuda")
    a = (t["qn"], t["qp"], t["ckv"], t["kpe"], t["table"], t["lens"], 0.1)
    _launch.ENABLED = False
    try:
        triton_path = {"op, Triton's own launch path": host_us(lambda: torch.ops.mla.decode(*a), calls),
                       "triton, one split, Triton's own launch path": host_us(lambda: _one_split(*a), calls)}
    finally:
        _launch.ENABLED = True
    from mla_compile.ops import _plans

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # no scratch off the default stream: the partials allocated per call
        on_side_stream = host_us(lambda: torch.ops.mla.decode(*a), calls)
    torch.cuda.current_stream().wait_stream(side)
    guards, _plans._GUARDS = _plans._GUARDS, False
    attention._DECODE_PLANS.clear()  # its recent signatures dropped: the key finds the plan
    try:
        key_only = host_us(lambda: torch.ops.mla.decode(*a), calls)
    finally:
        _plans._GUARDS = guards
    return {**triton_path, "op (dispatcher)": host_us(lambda: torch.ops.mla.decode(*a), calls),
            "op, plan found by the key (no recent-signature check)": key_only,
            "op on a side stream (partials allocated, no scratch)": on_side_stream,
            "unplanned cuda entry (kernels.dispatch.decode)": host_us(lambda: dispatch.decode(*a), calls),
            "triton, one split (no merge kernel)": host_us(lambda: _one_split(*a), calls),
            "check, repeated signature": host_us(lambda: attention.check_decode_args(*a), calls),
            "check, whole": host_us(lambda: (C.forget_signatures(), attention.check_decode_args(*a)), calls)}


def _one_split(*a):
    from mla_compile.kernels import decode as D

    return D.decode(*a, splits=1)


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` and `fast(kernel)[grid](...)` do nothing."""

    def __init__(self):
        self._mla_fast_launch = self  # what kernels._launch.fast returns for it

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def launch(self, grid, args, kwargs):  # what kernels._launch.Bound calls
        return None

    def entry(self, grid, args, kwargs):
        return None


def bench_glue(device: str, calls: int) -> dict:
    """kernels.dispatch.decode and kernels.decode.decode with the stage-1 and merge launches stubbed out."""
    from mla_compile.kernels import decode as D
    from mla_compile.kernels import dispatch
    from mla_compile.kernels import merge as M
    from mla_compile.kernels import stage1_launch as S1

    t = tensors(device)
    a = (t["qn"], t["qp"], t["ckv"], t["kpe"], t["table"], t["lens"], 0.1)
    names = ("_stage1_kernel", "_stage1_merged_kernel", "_stage1_tma_kernel")
    saved = [getattr(S1, n) for n in names], M._merge_kernel
    for n in names:  # where the plans bind them
        setattr(S1, n, _NoLaunch())
    M._merge_kernel = _NoLaunch()
    try:
        return {"unplanned cuda entry (dispatch.decode), launches stubbed": host_us(lambda: dispatch.decode(*a), calls),
                "kernels.decode.decode, launches stubbed": host_us(lambda: D.decode(*a), calls),
                "kernel choice (dispatch.decode_kernel)": host_us(lambda: dispatch.decode_kernel(*a[:4]), calls)}
    finally:
        for n, k in zip(names, saved[0]):
            setattr(S1, n, k)
        M._merge_kernel = saved[1]


PROFILED = ("mla.decode", "mla.sparse_decode", "mla.merge_states", "mla.fused_linear", "dsa.indexer_topk")


def profile_op(name: str, calls: int, top: int = 15) -> list[dict]:
    """cProfile of `calls` eager calls of one op (its plan made first): the functions by own time per call."""
    rows = profile_call(op_calls(tensors("cuda"))[name], calls, top)
    torch.cuda.synchronize()
    return rows


def profile_call(call, calls: int, top: int = 15) -> list[dict]:
    """cProfile of `calls` calls of `call` (one call first): the functions by own time per call."""
    call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    stats = pstats.Stats(prof).sort_stats("tottime")
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in list(stats.stats.items()):
        rows.append({"function": f"{Path(file).name}:{line}:{fn}", "calls_per_op": ncalls / calls,
                     "own_us_per_op": tottime / calls * 1e6, "cum_us_per_op": cumtime / calls * 1e6})
    return sorted(rows, key=lambda r: -r["own_us_per_op"])[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--ops-only", action="store_true", help="the ops table alone (A/B runs)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    res = {"provenance": f"cuda: {torch.cuda.get_device_name()}" if cuda else "cpu", "torch": torch.__version__,
           "mla_compile": str(Path(mla_compile.ops.__file__).parents[1])}
    if a.ops_only:
        res["ops"] = bench_ops(a.calls) if cuda else {}
        a.out.write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return 0
    res.update(registration=bench_registration(a.calls), checks=bench_checks("cuda" if cuda else "meta", a.calls),
               glue=bench_glue("cuda" if cuda else "cpu", a.calls))
    if cuda:
        res["ops"] = bench_ops(a.calls)
        res["compiled"] = bench_compiled(a.calls)
        res["layers"] = bench_layers(a.calls)
        res["profile"] = profile_op("mla.decode", a.calls)
        res["profiles"] = {name: profile_op(name, a.calls, top=8) for name in PROFILED[1:]}
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("profile", "profiles")}, indent=1))
    for name, rows in {"mla.decode": res.get("profile", []), **res.get("profiles", {})}.items():
        print(f"--- profile of {name}")
        for row in rows:
            print(f"{row['own_us_per_op']:8.2f} us own {row['cum_us_per_op']:8.2f} us cum  {row['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
