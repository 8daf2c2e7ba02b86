"""Probe: where one HF generate() decode step spends its time under a compile config (host vs GPU).

usage: python benchmarks/lab/generate_profile.py OUT.txt [--modes hf mla mla_default] [--prompt 4096] [--batch 8]
                                                  [--heads 16] [--new 32] [--cprofile]
Prints the profiler's top host functions and GPU kernels of a timed generate(), its wall time per new token, and
the GPU busy time per token (sum of kernel times), i.e. whether the step is host-bound.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generate import build_model, count_stop_checks, generate_kwargs, prompts, set_up_mode  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--modes", nargs="+", default=["hf", "mla"])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--cprofile", action="store_true", help="also a cProfile of one generate (Python functions)")
    args = ap.parse_args()
    import mla_compile  # noqa: F401
    from torch.profiler import ProfilerActivity, profile

    stop_checks = count_stop_checks()
    dev = torch.device("cuda")
    model = build_model(args.heads, 4, 2048, 32768, torch.bfloat16, dev)
    model.generation_config.pad_token_id = 0
    ids, mask = prompts(args.batch, args.prompt, 32768, dev)
    lines = []
    for mode in args.modes:
        torch._dynamo.reset()
        for attr in ("_compiled_call", "_last_compile_config"):
            if hasattr(model, attr):
                delattr(model, attr)
        set_up_mode(model, mode)  # what benchmarks/generate.py installs for the mode (optimize_generate ...)

        def gen(new):
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               cache_implementation="static", **generate_kwargs(mode))
            torch.cuda.synchronize()

        gen(args.new)
        gen(args.new)
        t0 = time.perf_counter()
        gen(args.new)
        wall = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen(args.new)
        ka = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
        lines.append(f"=== {mode}: wall {wall * 1e3:.1f} ms for {args.new} tokens; GPU kernel time "
                     f"{gpu_us / 1e3:.1f} ms; stop checks made so far: {dict(stop_checks)}")
        lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
        lines.append(ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=90))
        print("\n".join(lines[-3:]), flush=True)
        if args.cprofile:
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            gen(args.new)
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(45)
            lines.append(f"=== {mode}: cProfile of one generate ({args.new} tokens), by own time")
            lines.append(buf.getvalue())
            print("\n".join(lines[-2:]), flush=True)
    Path(args.out).write_text("\n".join(lines))
    # the decode graphs' generated code, to name the kernels in the tables above
    import os
    import shutil

    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir:
        for f in Path(cache_dir).rglob("*.py"):
            text = f.read_text(errors="ignore")
            if "def call(self, args)" in text or "def call(args)" in text:
                tag = "mla" if "torch.ops.mla." in text else "hf"
                shutil.copy(f, Path(args.out).with_name(f"genprofile_{tag}_{f.stem[:12]}.py"))


if __name__ == "__main__":
    main()
