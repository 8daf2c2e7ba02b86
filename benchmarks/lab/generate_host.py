"""Probe: where the host time of one HF generate() decode step goes, and what would remove it.

usage: python benchmarks/lab/generate_host.py OUT.json [--variants hf mla mla_noguard mla_deferred hf_deferred]
                                                       [--prompt 4096] [--batch 8] [--heads 16] [--new 64]

Per variant: decode ms/token ((generate(new) - generate(1)) / (new - 1), median of 3), and the host time per decode
step split by perf-counter wrappers into HF's loop parts: `prepare` (prepare_inputs_for_generation), `call` (the
compiled forward: Dynamo guards, cudagraph-tree bookkeeping, the graph launch; no sync inside), `update`
(_update_model_kwargs_for_generation), `stop` (the stopping check: HF's StopCheck waits for the device here on
CUDA), `other` (logits processing, argmax, cat: the rest of the loop body). For the first mla variant, a profiler
breakdown of the host time inside the compiled call (self CPU per event name, per step) and the decode graph's code.

Variants: hf / mla = HF's auto-compile with Inductor / with mla_dcp (reduce-overhead); `_noguard` adds
guard_filter_fn=skip_guard_on_all_nn_modules_unsafe; `_nopdl` turns programmatic dependent launch off (Inductor's
and ours); `_deferred` forces HF's DeferredStopCheck (HF enables it on
mps only: the host reads the stop flag one step late, so it can queue the next step while the device runs).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generate import build_model, prompts  # noqa: E402


def compile_cfg(variant: str):
    from transformers import CompileConfig

    from mla_compile.integrations.hf import compile_config

    opts = {}
    if "noguard" in variant:
        opts["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    if "notrees" in variant:
        opts["triton.cudagraph_trees"] = False
    if "nopdl" in variant:  # programmatic dependent launch off, Inductor's and ours (a cheaper graph launch?)
        opts["triton.enable_pdl"] = False
    if variant.startswith("hf"):
        cfg = CompileConfig(mode=None, options={"mode": "reduce-overhead", **opts}) if opts else CompileConfig()
        cfg._compile_all_devices = True
        return cfg
    return compile_config(**opts)


class Recordings:
    """Counts the CUDA graphs cudagraph trees record (CUDAGraphTreeManager.record_function): a steady generate()
    should record none. A 2026-12-02 profile showed one recording inside every timed generate (ours ~12 ms, HF's
    ~7 ms, ~0.2 ms per token over 64 tokens), so each timed call reports its count."""

    def __init__(self):
        self.n = 0
        try:
            from torch._inductor import cudagraph_trees as T
        except ImportError:  # pragma: no cover - a torch without Inductor
            self.cls = None
            return
        self.cls, self.orig = T.CUDAGraphTreeManager, T.CUDAGraphTreeManager.record_function

        def record_function(mgr, *a, **k):
            self.n += 1
            return self.orig(mgr, *a, **k)

        self.cls.record_function = record_function

    def restore(self):
        if self.cls is not None:
            self.cls.record_function = self.orig


class Timers:
    def __init__(self):
        self.t = defaultdict(float)
        self.steps = 0

    def wrap(self, name, fn):
        @functools.wraps(fn)  # HF validates generate's kwargs against prepare_inputs_for_generation's signature
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                with torch.profiler.record_function(f"part:{name}"):
                    return fn(*a, **k)
            finally:
                self.t[name] += time.perf_counter() - t0
        return timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--variants", nargs="+", default=["hf", "mla", "mla_deferred", "mla_mg_deferred",
                                                      "mla_mg_deferred_noguard", "mla_mg_deferred_notrees"])
    ap.add_argument("--profile", default="mla_mg_deferred", help="the variant whose steps are profiled")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script itself)")
    args = ap.parse_args()
    import transformers.generation.utils as gu

    import mla_compile  # noqa: F401

    dev = torch.device("cpu" if args.smoke else "cuda")
    model = build_model(args.heads, 4, 2048, 32768, torch.float32 if args.smoke else torch.bfloat16, dev,
                        small=args.smoke)
    model.generation_config.pad_token_id = 0
    ids, mask = prompts(args.batch, args.prompt, model.config.vocab_size, dev)
    result = dict(prompt=args.prompt, batch=args.batch, heads=args.heads, new=args.new, variants={})
    orig_supported = gu.DeferredStopCheck.is_supported
    orig_prepare = model.prepare_inputs_for_generation
    orig_update = model._update_model_kwargs_for_generation
    orig_get = model.get_compiled_call
    orig_stop = gu.StopCheck.__call__
    orig_dstop = gu.DeferredStopCheck.__call__
    recordings = Recordings()
    for variant in args.variants:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for attr in ("_compiled_call", "_last_compile_config"):
            if hasattr(model, attr):
                delattr(model, attr)
        deferred = "deferred" in variant
        os.environ["MLA_COMPILE_PDL"] = "0" if "nopdl" in variant else "auto"
        if "_mg" in variant:  # HF's mask built inside the compiled graph (integrations.hf.create_masks_in_graph)
            from mla_compile.integrations.hf import create_masks_in_graph

            model.create_masks_for_generate = create_masks_in_graph
        elif "create_masks_for_generate" in vars(model):
            del model.create_masks_for_generate
        gu.DeferredStopCheck.is_supported = (staticmethod(lambda *a, **k: True) if deferred else orig_supported)
        timers = Timers()
        model.prepare_inputs_for_generation = timers.wrap("prepare", orig_prepare)
        model._update_model_kwargs_for_generation = timers.wrap("update", orig_update)
        model.get_compiled_call = lambda cfg: timers.wrap("call", orig_get(cfg))
        gu.StopCheck.__call__ = timers.wrap("stop", orig_stop)
        gu.DeferredStopCheck.__call__ = timers.wrap("stop", orig_dstop)
        cfg = compile_cfg(variant)

        def gen(new):
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, cache_implementation="static", compile_config=cfg)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return out

        entry = {}
        try:
            t0 = time.perf_counter()
            first = gen(args.new)
            entry["first_call_s"] = time.perf_counter() - t0
            gen(args.new)
            e2e, pre, parts, records = [], [], [], []
            entry["rewritten"] = int(torch._dynamo.utils.counters["mla_compile"].get("mla_attention_rewritten", 0))
            for _ in range(3):
                gc.collect()
                timers.t.clear()
                recordings.n = 0
                t0 = time.perf_counter()
                gen(args.new)
                e2e.append(time.perf_counter() - t0)
                records.append(recordings.n)
                parts.append(dict(timers.t))
                t0 = time.perf_counter()
                gen(1)
                pre.append(time.perf_counter() - t0)
            steps = args.new - 1
            entry["decode_ms_per_token"] = (statistics.median(e2e) - statistics.median(pre)) / steps * 1e3
            entry["e2e_s"] = statistics.median(e2e)
            entry["cudagraph_records_per_timed_generate"] = records
            loop = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in ("prepare", "call", "update", "stop")}
            # the timed generate's loop body minus the wrapped parts (prefill's own time excluded via gen(1))
            body = statistics.median(e2e) - statistics.median(pre)
            entry["host_us_per_step"] = {k: v / steps * 1e6 for k, v in loop.items()}
            entry["host_us_per_step"]["other"] = (body - sum(loop.values())) / steps * 1e6
            entry["tokens_equal_first_call"] = bool(torch.equal(first, gen(args.new)))
            if variant == args.profile:
                entry["profile_us_per_step"] = profile_parts(gen, args.new)
        except Exception as e:  # keep the other variants' numbers
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        result["variants"][variant] = entry
        print(variant, json.dumps(entry, indent=1), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    gu.DeferredStopCheck.is_supported = orig_supported
    recordings.restore()
    save_code(Path(args.out))


def profile_parts(gen, new: int) -> dict:
    """Per HF loop part (the `part:*` regions), its host time per step and the self CPU time of the events
    inside it by name (top 12), plus the GPU kernel time per step; the same generate length as the timed calls
    (another length is another cache shape: a recompile)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen(new)
    steps = new - 1
    out = {}
    events = prof.events()
    for part in ("prepare", "call", "update", "stop"):
        regions = [e for e in events if e.name == f"part:{part}"]
        self_us = defaultdict(float)

        def walk(e):
            self_us[e.name] += e.self_cpu_time_total
            for c in e.cpu_children:
                walk(c)

        for r in regions:
            walk(r)
        top = sorted(self_us.items(), key=lambda kv: -kv[1])[:12]
        out[part] = {"_total": round(sum(r.cpu_time_total for r in regions) / steps, 1),
                     **{name[:70]: round(us / steps, 1) for name, us in top}}
    gpu = sum(e.self_device_time_total for e in prof.key_averages()
              if e.device_type == torch.autograd.DeviceType.CUDA)
    out["gpu_kernels_us_per_step_incl_prefill"] = round(gpu / steps, 1)
    return out


def save_code(out: Path) -> None:
    """Copy the compiled decode graphs' Inductor code next to OUT (to name the kernels of a GPU profile)."""
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache_dir:
        return
    graphs = [f for f in Path(cache_dir).rglob("*.py") if "torch.ops.mla.decode" in f.read_text(errors="ignore")]
    if graphs:  # the largest: the 4-layer decode step (the device returns few files)
        shutil.copy(max(graphs, key=lambda f: f.stat().st_size), out.with_name("genhost_mla_decode_graph.py"))


if __name__ == "__main__":
    main()
