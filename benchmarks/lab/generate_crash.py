"""Probe: HF generate() under mla_dcp with CUDA graphs, recipe variants side by side; on an error, the generated
Inductor frames it went through (file, line, and the non-tensor locals: what a kernel got instead of a pointer).

usage: python benchmarks/lab/generate_crash.py OUTDIR [--prompt 1024] [--batch 2] [--new 16] [--variants ...]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generate import build_model, prompts  # noqa: E402


def describe_error(exc, outdir: Path, tag: str):
    traceback.print_exception(exc)
    tb = exc.__traceback__
    while tb is not None:
        f = tb.tb_frame
        fn = f.f_code.co_filename
        if "torchinductor" in fn or (fn.startswith("/tmp/") and "/tmp/site/" not in fn):
            print(f"-- inductor frame {fn}:{tb.tb_lineno} in {f.f_code.co_name}")
            try:
                lines = Path(fn).read_text().splitlines()
                print("\n".join(lines[max(tb.tb_lineno - 6, 0):tb.tb_lineno + 2]))
                shutil.copy(fn, outdir / f"{tag}_{Path(fn).name}")
            except Exception as e:  # noqa: BLE001
                print("  (source unavailable)", e)
            odd = {k: (type(v).__name__, v if isinstance(v, (int, float, type(None))) else "")
                   for k, v in f.f_locals.items() if not isinstance(v, torch.Tensor)}
            print("  non-tensor locals:", dict(list(odd.items())[:80]))
        tb = tb.tb_next


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=["recipe", "config", "config_nopartition", "config_nocombo",
                                                      "config_nopdl", "recipe_inductor"])
    ap.add_argument("--child", action="store_true", help="run the variants in this process")
    args = ap.parse_args()
    if not args.child:  # one process per variant: a segfault in one leaves the others measured
        import subprocess

        for v in args.variants:
            cmd = [sys.executable, __file__, args.outdir, "--child", "--variants", v, "--prompt", str(args.prompt),
                   "--batch", str(args.batch), "--new", str(args.new), "--heads", str(args.heads)]
            rc = subprocess.call(cmd)
            if rc:
                print(f"== {v}: process exited {rc}", flush=True)
        return
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    import mla_compile  # noqa: F401
    from mla_compile.integrations.hf import compile_config

    dev = torch.device("cuda")
    model = build_model(args.heads, 4, 2048, 32768, torch.bfloat16, dev)
    model.generation_config.pad_token_id = 0
    ids, mask = prompts(args.batch, args.prompt, 32768, dev)
    orig_forward = model.forward

    def gen(**kw):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                                  do_sample=False, cache_implementation="static", **kw)[:, args.prompt:]

    ref = gen(disable_compile=True)
    for v in args.variants:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model.forward = orig_forward
        for attr in ("_compiled_call", "_last_compile_config"):
            if hasattr(model, attr):
                delattr(model, attr)
        t0 = time.perf_counter()
        try:
            if v.startswith("recipe"):
                backend = "inductor" if v == "recipe_inductor" else "mla_dcp"
                ckw = dict(mode="reduce-overhead")
                if v == "recipe_static":
                    ckw["dynamic"] = False
                if v == "recipe_nopartition":
                    ckw = dict(options={"mode": "reduce-overhead", "graph_partition": False})
                model.forward = torch.compile(orig_forward, backend=backend, **ckw)
                kw = dict(disable_compile=True)
            else:
                opts = {"config": {}, "config_nopartition": {"graph_partition": False},
                        "config_nocombo": {"combo_kernels": False},
                        "config_nopdl": {"triton.enable_pdl": False}}[v]
                kw = dict(compile_config=compile_config(**opts))
            toks = [gen(**kw) for _ in range(3)]
            c = torch._dynamo.utils.counters
            print(f"== {v}: OK {time.perf_counter() - t0:.1f}s agree={[(t == ref).float().mean().item() for t in toks]}"
                  f" rewritten={c['mla_compile'].get('mla_attention_rewritten', 0)}"
                  f" not={c['mla_compile'].get('mla_attention_not_rewritten', 0)} graphs={c['stats'].get('unique_graphs')}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"== {v}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            try:
                describe_error(e, out, v)
            except Exception as e2:  # noqa: BLE001 - the next variant still runs
                print("  (describe_error failed:", type(e2).__name__, e2, ")")
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
