"""Compile suite: what `torch.compile(backend="mla_dcp")` costs, and whether a second process reuses it.

For each target model, the same compile + decode loop runs in TWO fresh subprocesses that share one
TORCHINDUCTOR_CACHE_DIR (a new temp dir): the first process is cold (empty caches), the second should load
every graph from Inductor's FX graph cache. Per process we record
  first_call_s      wall time of the first compiled call (Dynamo + our rewrite + AOTAutograd + Inductor)
  second_graph_s    wall time of the call that compiles the second graph (DSA: crossing max_kv_len > topk)
  step_ms           median (and min) wall time per step after compilation, host-synchronized
  graphs            torch._dynamo.utils.counters["stats"]["unique_graphs"]
  cudagraph_recordings  calls of CUDAGraphTreeManager.record_function (CUDA, mode="reduce-overhead" only)
  fxgraph_cache_hit / _miss / _bypass, aot_autograd cache hit / miss, mla_compile rewrite counters.

Targets:
  dsa  examples/dsa_decode.py's DSADecodeLayer (k-only dense graph + indexer sparse graph; crosses topk)
  hf   a tiny HF DeepseekV3ForCausalLM from config (tests/hf_models.py; random weights, nothing downloaded),
       eager prefill, compiled decode over a StaticCache (the MLA pass rewrites its attention)

usage:
  python -m benchmarks compile [--out benchmarks/results/compile.json] [--targets dsa,hf] [--device auto]
  python benchmarks/compile_suite.py OUT.json [same flags]
Works on CPU (the one suite that means something there) and on CUDA (mode="reduce-overhead" by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mla_compile.integrations.hf import cache_kwargs

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("dsa", "hf")


# --------------------------------------------------------------------------------------------- worker
def _count_cudagraph_recordings() -> list[int]:
    """Patch CUDAGraphTreeManager.record_function to count recordings; returns the (mutable) counter."""
    from torch._inductor import cudagraph_trees as ct

    box = [0]
    orig = ct.CUDAGraphTreeManager.record_function

    def record_function(self, *a, **k):
        box[0] += 1
        return orig(self, *a, **k)

    ct.CUDAGraphTreeManager.record_function = record_function
    return box


def _timed(fn):
    import torch

    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _run_dsa(device: str, mode: str | None, steps: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from dsa_decode import DecodeState, DSADecodeLayer

    from mla_compile.dsa import mark_max_kv_len_dynamic

    topk = 64
    start = (3, 10, topk - 12, 1)  # the longest request crosses topk after ~12 steps: both graphs compile
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the dtype the GPU kernels are tuned for
    layer = DSADecodeLayer(topk=topk).to(device, dtype).eval()
    state = DecodeState(layer, list(start), max_len=max(start) + steps + 1, dtype=dtype)
    for name in ("block_table", "ckv", "kpe", "index"):
        setattr(state, name, getattr(state, name).to(device))
        if device == "cuda":
            torch._dynamo.mark_static_address(getattr(state, name))  # mutated inside CUDA graphs
    mark_max_kv_len_dynamic()
    compiled = torch.compile(layer, backend="mla_dcp", fullgraph=True, mode=mode)
    times, crossing = [], None
    with torch.no_grad():
        for i in range(steps):
            seq_lens, slots, max_kv_len = state.step_inputs()
            x = torch.randn(len(start), 256, device=device, dtype=dtype)
            args = (x, state.ckv, state.kpe, state.index, state.block_table, seq_lens.to(device),
                    slots.to(device), max_kv_len)
            _, dt = _timed(lambda: compiled(*args))
            times.append(dt)
            if crossing is None and max_kv_len > topk:
                crossing = i
    return dict(times=times, second_graph_step=crossing,
                config=dict(topk=topk, start_lens=list(start), steps=steps, dtype=str(dtype)))


def _run_hf(device: str, mode: str | None, steps: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import hf_models as M
    from transformers import StaticCache

    L = 8 + steps + 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = M.deepseek_v3(num_layers=2, dtype=dtype).to(device)
    ids, mask = M.batch(L=L)
    ids, mask = ids.to(device), mask.to(device)
    cache = StaticCache(config=model.config, max_cache_len=L)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True, mode=mode)
    T = ids.shape[1]
    times = []
    with torch.no_grad():
        out = model(ids, attention_mask=mask[:, :T], **cache_kwargs(model, cache),
                    cache_position=torch.arange(T, device=device))  # eager prefill
        tok = out.logits[:, -1].argmax(-1)
        for i in range(steps):
            pos = torch.tensor([T + i], device=device)
            out, dt = _timed(lambda: compiled(tok[:, None], attention_mask=mask, **cache_kwargs(model, cache),
                                              cache_position=pos))
            times.append(dt)
            tok = out.logits[:, -1].argmax(-1)
    return dict(times=times, second_graph_step=None,
                config=dict(model="DeepseekV3ForCausalLM", layers=2, hidden=64, heads=4, batch=ids.shape[0],
                            prompt=T, max_cache_len=L, steps=steps, dtype=str(dtype)))


def worker(target: str, device: str, mode: str | None, steps: int) -> dict:
    """One process: compile + run `target`, return its counters (called in a fresh subprocess)."""
    import torch
    from torch._dynamo.utils import counters

    import mla_compile  # noqa: F401

    t_import = time.perf_counter()
    recordings = _count_cudagraph_recordings() if device == "cuda" else None
    counters.clear()
    res = (_run_dsa if target == "dsa" else _run_hf)(device, mode, steps)
    times = res.pop("times")
    k = res["second_graph_step"]
    later = [t for i, t in enumerate(times) if i != 0 and i != k][2:] or times[1:]
    ind = counters["inductor"]
    aot = counters["aot_autograd"]
    out = dict(
        target=target, device=device, mode=mode, torch=torch.__version__,
        first_call_s=times[0], second_graph_s=times[k] if k is not None else None,
        step_ms=statistics.median(later) * 1e3 if later else None,
        step_ms_min=min(later) * 1e3 if later else None,  # shared CPUs: the median can carry other load
        total_s=time.perf_counter() - t_import,
        graphs=counters["stats"]["unique_graphs"],
        cudagraph_recordings=recordings[0] if recordings is not None else None,
        fxgraph_cache_hit=ind.get("fxgraph_cache_hit", 0), fxgraph_cache_miss=ind.get("fxgraph_cache_miss", 0),
        fxgraph_cache_bypass=ind.get("fxgraph_cache_bypass", 0),
        aot_autograd_cache_hit=aot.get("autograd_cache_hit", 0), aot_autograd_cache_miss=aot.get("autograd_cache_miss", 0),
        aot_autograd_cache_bypass=aot.get("autograd_cache_bypass", 0),
        mla_compile=dict(counters["mla_compile"]),
        cudagraph_skips={kk: v for kk, v in ind.items() if "cudagraph_skip" in kk},
        **res)
    return out


# --------------------------------------------------------------------------------------------- driver
def run_process(target: str, device: str, mode: str | None, steps: int, cache_dir: str, timeout: float) -> dict:
    """Run `worker` in a fresh interpreter with TORCHINDUCTOR_CACHE_DIR=cache_dir; returns its JSON."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("TRITON_CACHE_DIR", None)  # Triton's cache lives under the Inductor dir then: cold really is cold
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", target, "--device", device,
           "--mode", mode or "default", "--steps", str(steps), path]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if proc.returncode != 0:
            return dict(target=target, error=f"exit {proc.returncode}: {proc.stderr[-2000:]}")
        with open(path) as fh:
            res = json.load(fh)
    except subprocess.TimeoutExpired:
        return dict(target=target, error=f"timeout after {timeout:.0f}s")
    finally:
        os.unlink(path)
    res["process_s"] = time.perf_counter() - t0
    return res


def measure(target: str, device: str, mode: str | None, steps: int, timeout: float = 600.0) -> dict:
    """Cold process, then warm process on the same cache dir; the summary row for one target."""
    with tempfile.TemporaryDirectory(prefix="mla_compile_cache_") as cache_dir:
        cold = run_process(target, device, mode, steps, cache_dir, timeout)
        warm = run_process(target, device, mode, steps, cache_dir, timeout)
    row = dict(target=target, device=device, mode=mode, cold=cold, warm=warm)
    if "error" not in cold and "error" not in warm:
        row["cache_ok"] = warm["fxgraph_cache_hit"] >= 1 and warm["fxgraph_cache_miss"] == 0
        row["warm_speedup_first_call"] = cold["first_call_s"] / warm["first_call_s"]
        if not row["cache_ok"]:
            row["cache_note"] = ("second process missed the FX graph cache: "
                                 f"hit {warm['fxgraph_cache_hit']} miss {warm['fxgraph_cache_miss']} "
                                 f"bypass {warm['fxgraph_cache_bypass']}")
    else:
        row["cache_ok"] = False
    return row


def table(results: dict) -> str:
    lines = ["| target | device | mode | graphs | cudagraph recordings | cold first call s | warm first call s | "
             "cold 2nd graph s | warm 2nd graph s | warm step ms min | warm fxgraph hit/miss | warm AOT hit/miss | rewrites |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, fmt="{:.2f}": fmt.format(v) if isinstance(v, (int, float)) else "-"  # noqa: E731
    for r in results["rows"]:
        c, w = r["cold"], r["warm"]
        if "error" in c or "error" in w:
            lines.append(f"| {r['target']} | {r['device']} | {r['mode'] or 'default'} | error: "
                         f"{(c.get('error') or w.get('error'))[:120]!r} |")
            continue
        rec = c["cudagraph_recordings"]
        lines.append(
            f"| {r['target']} | {r['device']} | {r['mode'] or 'default'} | {c['graphs']} | "
            f"{rec if rec is not None else '-'} | {f(c['first_call_s'])} | {f(w['first_call_s'])} | "
            f"{f(c['second_graph_s'])} | {f(w['second_graph_s'])} | {f(w['step_ms_min'], '{:.3f}')} | "
            f"{w['fxgraph_cache_hit']}/{w['fxgraph_cache_miss']} | "
            f"{w['aot_autograd_cache_hit']}/{w['aot_autograd_cache_miss']} | "
            f"{sum(c['mla_compile'].values()) if c['mla_compile'] else 0} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "benchmarks" / "results" / "compile.json"))
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma list of: " + ", ".join(TARGETS))
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--mode", default=None,
                    help="torch.compile mode (default: reduce-overhead on CUDA, default on CPU); 'default' = None")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=600.0, help="per process (s)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:  # inside the subprocess
        res = worker(a.worker, a.device, None if a.mode == "default" else a.mode, a.steps)
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
        return 0

    import torch

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    mode = a.mode if a.mode is not None else ("reduce-overhead" if device == "cuda" else None)
    mode = None if mode == "default" else mode
    targets = [t for t in a.targets.split(",") if t]
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        ap.error(f"unknown targets {bad}; choose from {TARGETS}")
    try:
        from tqdm import tqdm
    except ImportError:  # bench extra not installed: plain loop
        def tqdm(it, **_):
            return it
    t0 = time.time()
    results = dict(device=device, device_name=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   torch=torch.__version__, mode=mode, steps=a.steps, rows=[])
    for target in tqdm(targets, desc="compile suite (cold + warm process each)", unit="target"):
        row = measure(target, device, mode, a.steps, a.timeout)
        results["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("cold", "warm")}), flush=True)
    results["wall_s"] = time.time() - t0
    results["table_md"] = table(results)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(results["table_md"])
    ok = all(r.get("cache_ok") for r in results["rows"])
    if not ok:
        print("compile suite: the second process did NOT fully hit the FX graph cache for: "
              + ", ".join(r["target"] for r in results["rows"] if not r.get("cache_ok")), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
