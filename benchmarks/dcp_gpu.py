"""DCP on GPUs (NCCL): correctness, CUDA-graph capture of a DCP decode step, and the step-time benchmark.

usage (one process per GPU; N in 1, 2, 4):
  torchrun --nproc-per-node N benchmarks/dcp_gpu.py OUT.json [--quick] [--no-compile] [--no-bench]
  python benchmarks/dcp_gpu.py --summarize OUT.json IN.json [IN.json ...]   # merge per-N runs (or merged
                                                                            # files), print + write OUT.md table
  torchrun --nproc-per-node 2 benchmarks/dcp_gpu.py OUT.json --smoke         # tiny shapes; runs on CPU/gloo too

Sections, in this order (rank 0 writes the JSON after each one, so a later crash keeps the earlier results):
  correctness  random global lengths (0, < n, n, long), chunked prefill + 8 decode steps through owner writes
               (DCPCache); every step `mla::dcp_decode` vs single-GPU `mla::decode` over the unsharded cache on
               the same GPU, the float64 CPU reference at the ends, and bit-identical results on every rank.
  graph        a whole DCP decode step (owner write of the new token, seq_lens += 1, dcp_decode) captured in
               one torch.cuda.graph and replayed with new q / tokens; half-way the lengths are changed from
               outside (seq_lens.copy_) and replay continues: each replay checked against the reference.
  bench        per-step attention time, bf16, R 512, P 64, page 64, kv_len 32K/128K, B 8/32, H 16/128:
               `local_ms`  mla::decode over this rank's shard alone (CUDA graph),
               `dcp_ms`    the full mla::dcp_decode (local decode + packed all-gather + merge; CUDA graph),
               `comm_merge_ms` the all-gather + merge alone, on this step's (out, lse);
               `local_kernel` the decode kernel `auto` ran for the shard; `local_flashmla_ms` FlashMLA alone on
               the same shard (a one-buffer copy of it, its schedule made inside each call, as bench_ops times it)
               when `flash_mla` imports, cross-checked against our local decode (`local_flashmla_vs_ours`,
               `local_flashmla_ok`): the peer a rank could run instead;
               overhead_frac = (dcp - local) / dcp and comm_merge_frac = comm_merge / dcp. Each time is the
               max over ranks of the median of 5 measurements of 20 replays x 10 calls per graph.
  compile      dcp_decode under torch.compile(backend="mla_dcp", fullgraph=True) and with
               mode="reduce-overhead" (CUDA-graph trees) vs eager (skipped with --no-compile).
Keep NCCL_NVLS_ENABLE=0 (set here by default): NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import mla_compile  # noqa: E402,F401
from mla_compile import layout  # noqa: E402
from mla_compile.distributed import DCPCache, DCPGroup, init_dcp  # noqa: E402
from mla_compile.kernels import dispatch  # noqa: E402
from mla_compile.kernels import flashmla as FMLA  # noqa: E402
from mla_compile.ops import dcp as dcp_ops  # noqa: E402

DT = torch.bfloat16
SHAPES = dict(R=512, P=64, PS=64)
SMOKE_SHAPES = dict(R=32, P=8, PS=4)
SCALE = 192 ** -0.5  # DeepSeek: (qk_nope 128 + rope 64) ** -0.5
CALLS_PER_GRAPH, REPLAYS, REPEATS = 10, 20, 5


# --------------------------------------------------------------------------------------------- helpers
class Ctx:
    def __init__(self, grp: DCPGroup, smoke: bool):
        self.grp, self.n, self.rank, self.device = grp, grp.size, grp.rank, grp.device
        self.cuda = self.device.type == "cuda"
        self.smoke = smoke
        s = SMOKE_SHAPES if smoke else SHAPES
        self.R, self.P, self.PS = s["R"], s["P"], s["PS"]

    def log(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()
        if self.n > 1:
            dist.barrier()


def reduce_max(ctx: Ctx, x: float) -> float:
    if ctx.n == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def all_true(ctx: Ctx, flag: bool) -> bool:
    return reduce_max(ctx, 0.0 if flag else 1.0) == 0.0


def same_on_all_ranks(ctx: Ctx, *tensors) -> bool:
    """Bitwise equality of these tensors across ranks (gathered and compared on every rank)."""
    if ctx.n == 1:
        return True
    ok = True
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(ctx.n)]
        dist.all_gather(parts, t.contiguous())
        ok &= all(torch.equal(p.view(torch.uint8), parts[0].view(torch.uint8)) for p in parts)  # NaN-safe
    return all_true(ctx, ok)


def errors(out, lse, ref_o, ref_l) -> dict:
    out, ref_o = out.double().cpu(), ref_o.double().cpu()
    lse, ref_l = lse.double().cpu(), ref_l.double().cpu()
    fin = torch.isfinite(ref_l)
    inf_ok = bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_l)))
    diff = (out - ref_o).abs()
    return dict(out_max_abs=float(diff.max()) if out.numel() else 0.0,
                out_max_rel=float((diff / ref_o.abs().clamp(min=1.0)).max()) if out.numel() else 0.0,
                out_ref_max=float(ref_o.abs().max()) if out.numel() else 0.0,
                lse_max_abs=float((lse[fin] - ref_l[fin]).abs().max()) if bool(fin.any()) else 0.0,
                inf_pattern_ok=inf_ok)


def within(e: dict, out_tol: float, lse_tol: float) -> bool:
    return e["inf_pattern_ok"] and e["out_max_rel"] <= out_tol and e["lse_max_abs"] <= lse_tol


def make_tokens(ctx: Ctx, total: list[int], seed: int):
    """Global tokens, identical on every rank (CPU generator), moved to the device."""
    g = torch.Generator().manual_seed(seed)
    ckv = [torch.randn(T, ctx.R, generator=g).to(DT).to(ctx.device) for T in total]
    kpe = [torch.randn(T, ctx.P, generator=g).to(DT).to(ctx.device) for T in total]
    return ckv, kpe, g


def random_q(ctx: Ctx, g, B, H):
    q = torch.randn(B, H, ctx.R, generator=g).to(DT).to(ctx.device)
    qp = torch.randn(B, H, ctx.P, generator=g).to(DT).to(ctx.device)
    return q, qp


def prefilled_caches(ctx: Ctx, lens, steps, seed, chunk=1024):
    """(sharded DCPCache, unsharded single-GPU DCPCache, tokens, generator) after a chunked prefill."""
    total = [L + steps for L in lens]
    ckv, kpe, g = make_tokens(ctx, total, seed)
    max_len = max(total) + 1
    nan = float("nan")  # slots never written stay NaN: reading one poisons the result
    cache = DCPCache.allocate(ctx.grp, len(lens), max_len, ctx.R, ctx.P, ctx.PS, DT, ctx.device, fill=nan)
    full = DCPCache.allocate(DCPGroup.single(ctx.device), len(lens), max_len, ctx.R, ctx.P, ctx.PS, DT, ctx.device,
                             fill=nan)
    for b, L in enumerate(lens):
        for s in range(0, L, chunk):
            e = min(L, s + chunk)
            cache.write_prefill(b, ckv[b][s:e], kpe[b][s:e])
            full.write_prefill(b, ckv[b][s:e], kpe[b][s:e])
    return cache, full, ckv, kpe, g


def test_lens(ctx: Ctx) -> list[int]:
    n = ctx.n
    if ctx.smoke:
        return [0, max(1, n - 1), n, n + 1, 37, 61]
    return [0, max(1, n - 1), n, n + 1, 1000, 4099, 6000]


OUT_TOL, LSE_TOL = 2e-2, 2e-3  # out: |diff| / max(|ref|, 1), bf16 ulp is <= 7.8e-3 relative; lse fp32


# --------------------------------------------------------------------------------------------- sections
def section_correctness(ctx: Ctx, steps=8) -> dict:
    from reference import ref_decode

    res = {"cases": []}
    for H, seed in ((16, 1), (128, 2)):
        lens = test_lens(ctx)
        cache, full, ckv, kpe, g = prefilled_caches(ctx, lens, steps, seed)
        worst = dict(out_max_abs=0.0, out_max_rel=0.0, lse_max_abs=0.0, inf_pattern_ok=True)
        same = True
        f64 = {}
        for s in range(steps + 1):
            q, qp = random_q(ctx, g, len(lens), H)
            out, lse = cache.decode(q, qp, SCALE)
            ref_o, ref_l = full.decode(q, qp, SCALE)
            e = errors(out, lse, ref_o, ref_l)
            worst = {k: (max(worst[k], e[k]) if k != "inf_pattern_ok" else worst[k] and e[k]) for k in worst}
            same &= same_on_all_ranks(ctx, out, lse)
            if s in (0, steps):
                o64, l64 = ref_decode(q.cpu(), qp.cpu(), full.ckv_cache.cpu(), full.kpe_cache.cpu(),
                                      full.block_table.cpu(), full.seq_lens.cpu(), SCALE)
                f64[f"step{s}"] = errors(out, lse, o64, l64)
            if s < steps:
                pos = cache.lens[:]
                new_c = torch.stack([ckv[b][pos[b]] for b in range(len(lens))])
                new_k = torch.stack([kpe[b][pos[b]] for b in range(len(lens))])
                cache.write_decode(new_c, new_k)
                full.write_decode(new_c, new_k)
        ok = within(worst, OUT_TOL, LSE_TOL) and same and all(within(v, OUT_TOL, LSE_TOL) for v in f64.values())
        ok = all_true(ctx, ok)
        case = dict(H=H, lens=lens, steps=steps, vs_single_gpu=worst, vs_float64=f64, identical_on_ranks=same, ok=ok)
        res["cases"].append(case)
        ctx.log("correctness", json.dumps(case))
        del cache, full
    res["ok"] = all(c["ok"] for c in res["cases"])
    return res


def capture(ctx: Ctx, fn, warmup=2, restore=None):
    """CUDA graph of fn() (warmed up on a side stream; `restore()` undoes the warm-up's side effects)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    if restore is not None:
        restore()
    ctx.sync()  # warm-up collectives done before capture begins (the NCCL watchdog idle)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        out = fn()
    ctx.sync()
    return g, out


def section_graph(ctx: Ctx, steps=8) -> dict:
    """One DCP decode step (owner write + seq_lens += 1 + dcp_decode) in a CUDA graph, replayed."""
    n, r = ctx.n, ctx.rank
    H = 16
    lens = test_lens(ctx)
    B = len(lens)
    cache, full, ckv, kpe, g = prefilled_caches(ctx, lens, steps + 4, seed=3)
    q = torch.zeros(B, H, ctx.R, dtype=DT, device=ctx.device)
    qp = torch.zeros(B, H, ctx.P, dtype=DT, device=ctx.device)
    new_c = torch.zeros(B, ctx.R, dtype=DT, device=ctx.device)
    new_k = torch.zeros(B, ctx.P, dtype=DT, device=ctx.device)

    def step():
        slots = dcp_ops.decode_write_slots(cache.block_table, cache.seq_lens, ctx.PS, n, r)
        torch.ops.mla.cache_write(cache.ckv_cache, cache.kpe_cache, new_c, new_k, slots)
        cache.seq_lens.add_(1)
        return torch.ops.mla.dcp_decode(q, qp, cache.ckv_cache, cache.kpe_cache, cache.block_table, cache.seq_lens,
                                        SCALE, n, r, ctx.grp.group_name)

    saved = cache.seq_lens.clone()
    if ctx.cuda:
        graph, (g_out, g_lse) = capture(ctx, step, restore=lambda: cache.seq_lens.copy_(saved))
        replay = graph.replay
    else:  # --smoke on CPU: the same replay logic with eager calls (no CUDA graph)
        g_out = torch.empty(B, H, ctx.R, dtype=DT)
        g_lse = torch.empty(B, H)

        def replay():
            o, l = step()
            g_out.copy_(o)
            g_lse.copy_(l)
    worst = dict(out_max_abs=0.0, out_max_rel=0.0, lse_max_abs=0.0, inf_pattern_ok=True)
    same, lens_now, changed = True, list(lens), None
    for s in range(steps):
        if s == steps // 2:  # lengths changed from outside the graph: requests truncated / slots reused
            lens_now = [L // 2 if b % 2 else L for b, L in enumerate(lens_now)]
            changed = list(lens_now)
            t = torch.tensor(lens_now, dtype=torch.int32, device=ctx.device)
            cache.seq_lens.copy_(t)
            full.seq_lens.copy_(t)
            full.lens = list(lens_now)
        qq, qqp = random_q(ctx, g, B, H)
        q.copy_(qq)
        qp.copy_(qqp)
        new_c.copy_(torch.stack([ckv[b][lens_now[b]] for b in range(B)]))
        new_k.copy_(torch.stack([kpe[b][lens_now[b]] for b in range(B)]))
        replay()
        full.write_decode(new_c, new_k)
        lens_now = [L + 1 for L in lens_now]
        ref_o, ref_l = full.decode(q, qp, SCALE)
        e = errors(g_out, g_lse, ref_o, ref_l)
        worst = {k: (max(worst[k], e[k]) if k != "inf_pattern_ok" else worst[k] and e[k]) for k in worst}
        same &= same_on_all_ranks(ctx, g_out, g_lse)
    seq_ok = cache.seq_lens.tolist() == lens_now
    ok = all_true(ctx, within(worst, OUT_TOL, LSE_TOL) and same and seq_ok)
    res = dict(cuda_graph=ctx.cuda, H=H, lens=lens, replays=steps, lens_set_from_outside_at=steps // 2, lens_after_change=changed,
               vs_single_gpu=worst, identical_on_ranks=same, seq_lens_advanced_in_graph=seq_ok, ok=ok)
    ctx.log("graph", json.dumps(res))
    return res


def section_compile(ctx: Ctx) -> dict:
    n, r = ctx.n, ctx.rank
    H = 16
    lens = test_lens(ctx)
    cache, full, ckv, kpe, g = prefilled_caches(ctx, lens, 0, seed=4)
    name = ctx.grp.group_name

    def fn(q, qp, ckv_cache, kpe_cache, block_table, seq_lens):
        return torch.ops.mla.dcp_decode(q, qp, ckv_cache, kpe_cache, block_table, seq_lens, SCALE, n, r, name)

    res = {}
    modes = {"default": None} if not ctx.cuda else {"default": None, "reduce-overhead": "reduce-overhead"}
    for label, mode in modes.items():
        try:
            torch._dynamo.reset()
            t0 = time.time()
            compiled = torch.compile(fn, backend="mla_dcp", fullgraph=True, dynamic=False, mode=mode)
            worst = dict(out_max_abs=0.0, out_max_rel=0.0, lse_max_abs=0.0, inf_pattern_ok=True)
            for i in range(4):
                seq = cache.seq_lens if i % 2 == 0 else torch.clamp(cache.seq_lens - 7 * i, min=0)
                q, qp = random_q(ctx, g, len(lens), H)
                args = (q, qp, cache.ckv_cache, cache.kpe_cache, cache.block_table, seq)
                got = [t.clone() for t in compiled(*args)]
                eager = fn(*args)
                e = errors(got[0], got[1], eager[0], eager[1])
                worst = {k: (max(worst[k], e[k]) if k != "inf_pattern_ok" else worst[k] and e[k]) for k in worst}
            ok = all_true(ctx, within(worst, 1e-2, 1e-4))
            res[label] = dict(vs_eager=worst, compile_and_run_s=time.time() - t0, ok=ok)
        except Exception as e:  # noqa: BLE001 - optional section: report, keep the others
            res[label] = dict(error=f"{type(e).__name__}: {str(e)[:800]}", ok=False)
            traceback.print_exc()
        ctx.log("compile", label, json.dumps(res[label]))
    torch._dynamo.reset()
    return res


def time_graph(ctx: Ctx, fn) -> float:
    """ms per call: CALLS_PER_GRAPH calls in one CUDA graph, REPLAYS replays, median of REPEATS, max over ranks."""
    if not ctx.cuda:  # smoke on CPU: wall clock
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return reduce_max(ctx, (time.perf_counter() - t0) / 3 * 1e3)

    def many():
        out = None
        for _ in range(CALLS_PER_GRAPH):
            out = fn()
        return out

    graph, _ = capture(ctx, many)
    graph.replay()
    times = []
    for _ in range(REPEATS):
        ctx.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (REPLAYS * CALLS_PER_GRAPH))
    del graph
    return reduce_max(ctx, statistics.median(times))


def local_flashmla(ctx: Ctx, row: dict, q, qp, ckv, kpe, table, loc) -> None:
    """FlashMLA alone on this rank's shard, beside our local decode (`row["local_flashmla_*"]`); nothing where it does
    not import (every rank alike) or takes another page size. A failure on one rank skips the timing on all of them
    (the timing is a collective)."""
    if not ctx.cuda or ctx.PS != FMLA.PAGE or not FMLA.available():
        return
    ok, run = False, None
    try:
        import flash_mla as fm

        from bench_ops import flashmla_alone, flashmla_copy  # benchmarks/: this script's directory

        run = flashmla_alone(fm, q, qp, flashmla_copy(ckv, kpe)[2], table, loc, SCALE)
        out, lse = run()
        ours = torch.ops.mla.decode(q, qp, ckv, kpe, table, loc, SCALE)
        e = errors(out.reshape(ours[0].shape), lse.reshape(ours[1].shape), *ours)
        row["local_flashmla_vs_ours"] = e
        ok = True
    except Exception as ex:  # noqa: BLE001 - a peer: report, keep the table
        row["local_flashmla_error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
    if all_true(ctx, ok):
        row["local_flashmla_ok"] = all_true(ctx, within(row["local_flashmla_vs_ours"], 2e-2, 1e-3))
        row["local_flashmla_ms"] = time_graph(ctx, run)


def bench_one(ctx: Ctx, L: int, B: int, H: int) -> dict:
    n, r, PS = ctx.n, ctx.rank, ctx.PS
    seq = torch.full((B,), L, dtype=torch.int32, device=ctx.device)
    loc = layout.local_lens(seq, n, r)
    pages = -(-layout.local_capacity(L, n) // PS)
    num_pages = B * pages
    ckv = torch.empty(num_pages, PS, ctx.R, dtype=DT, device=ctx.device).normal_()
    kpe = torch.empty(num_pages, PS, ctx.P, dtype=DT, device=ctx.device).normal_()
    table = torch.randperm(num_pages, device=ctx.device).view(B, pages).int()
    q = torch.randn(B, H, ctx.R, dtype=DT, device=ctx.device)
    qp = torch.randn(B, H, ctx.P, dtype=DT, device=ctx.device)
    name = ctx.grp.group_name
    row = dict(n=n, H=H, B=B, L=L, local_len=int(loc[0]))
    row["local_kernel"] = dispatch.decode_kernel(q, qp, ckv, kpe, block_table=table).name if ctx.cuda else "torch"
    row["local_ms"] = time_graph(ctx, lambda: torch.ops.mla.decode(q, qp, ckv, kpe, table, loc, SCALE))
    local_flashmla(ctx, row, q, qp, ckv, kpe, table, loc)
    row["dcp_ms"] = time_graph(ctx, lambda: torch.ops.mla.dcp_decode(q, qp, ckv, kpe, table, seq, SCALE, n, r, name))
    if n > 1:
        out, lse = torch.ops.mla.decode(q, qp, ckv, kpe, table, loc, SCALE)
        row["comm_merge_ms"] = time_graph(
            ctx, lambda: torch.ops.mla.merge_states(*dcp_ops.gather_states(out, lse, n, name)))
        row["gather_bytes_per_rank"] = B * H * (ctx.R * 2 + 4)
    else:
        row["comm_merge_ms"] = 0.0
    row["overhead_frac"] = (row["dcp_ms"] - row["local_ms"]) / row["dcp_ms"]
    row["comm_merge_frac"] = row["comm_merge_ms"] / row["dcp_ms"]
    kv_bytes = B * L * (ctx.R + ctx.P) * 2
    row["kv_TBps_total"] = kv_bytes / (row["dcp_ms"] * 1e-3) / 1e12
    del ckv, kpe, table
    if ctx.cuda:
        torch.cuda.empty_cache()
    return row


def section_bench(ctx: Ctx, quick: bool) -> list:
    if ctx.smoke:
        grid = [(256, 2, 4)]
    elif quick:
        grid = [(32768, 8, 16), (131072, 8, 16)]
    else:
        grid = [(L, B, H) for L in (32768, 131072) for B in (8, 32) for H in (16, 128)]
    rows = []
    for L, B, H in grid:
        row = bench_one(ctx, L, B, H)
        rows.append(row)
        ctx.log("bench", json.dumps(row))
    return rows


# --------------------------------------------------------------------------------------------- summary
def summarize(out_path: str, paths: list[str]) -> str:
    runs = {}
    for p in paths:
        try:
            with open(p) as fh:
                d = json.load(fh)
            for run in (d["runs"].values() if "runs" in d else [d]):  # a merged file from an earlier summary
                runs[run["n"]] = run
        except Exception as e:  # noqa: BLE001
            print(f"skip {p}: {e}", file=sys.stderr)
    ns = sorted(runs)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import dcp_block  # the one DCP table (RESULTS.md uses the same)

    text = "\n".join(dcp_block({"runs": {str(n): runs[n] for n in ns}}))  # table + per-n check lines
    with open(out_path, "w") as fh:
        json.dump({"runs": {str(n): runs[n] for n in ns}, "table_md": text}, fh, indent=1)
    with open(os.path.splitext(out_path)[0] + ".md", "w") as fh:
        fh.write(text + "\n")
    print(text)
    return text


# --------------------------------------------------------------------------------------------- main
def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="*")
    ap.add_argument("--summarize", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--timeout", type=float, default=180.0, help="process-group timeout (s)")
    a = ap.parse_args(argv)
    if a.summarize:
        summarize(a.out, a.inputs)
        return 0

    t0 = time.time()
    grp = init_dcp(timeout=datetime.timedelta(seconds=a.timeout))
    ctx = Ctx(grp, a.smoke)
    torch.manual_seed(1234 + ctx.rank)  # bench data only; correctness data comes from explicit generators
    results = dict(n=ctx.n, device=torch.cuda.get_device_name() if ctx.cuda else "cpu", torch=torch.__version__,
                   nccl=".".join(map(str, torch.cuda.nccl.version())) if ctx.cuda else None,
                   nvls=os.environ.get("NCCL_NVLS_ENABLE"), shapes=dict(R=ctx.R, P=ctx.P, PS=ctx.PS, dtype=str(DT)),
                   decode_backend=os.environ.get("MLA_COMPILE_DECODE_BACKEND", "auto"))

    def save():
        results["wall_s"] = time.time() - t0
        if ctx.rank == 0:
            with open(a.out, "w") as fh:
                json.dump(results, fh, indent=1)

    ctx.log(f"DCP n={ctx.n} on {results['device']}, torch {results['torch']}, NCCL {results['nccl']}")
    results["correctness"] = section_correctness(ctx)
    save()
    results["graph"] = section_graph(ctx)
    save()
    if not a.no_bench:
        results["bench"] = section_bench(ctx, a.quick)
        save()
    if not a.no_compile:  # last: the riskiest section (Inductor + NCCL + CUDA-graph trees) cannot cost the others
        results["compile"] = section_compile(ctx)
        save()
    ok = results["correctness"]["ok"] and results["graph"].get("ok", True)
    results["ok"] = ok
    save()
    ctx.log(f"done in {time.time() - t0:.0f}s: {'OK' if ok else 'FAILED'}")
    dist.destroy_process_group() if dist.is_initialized() else None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
