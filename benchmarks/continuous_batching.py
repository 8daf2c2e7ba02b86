"""HF continuous batching (`generate_batch`, the engine behind `transformers serve`) on an MLA model: HF's own
(uncompiled, and compiled with Inductor) against `mla_dcp` as its compile backend, whose attention rewrite absorbs
HF's attention over the gathered latents with HF's mask (passes/attention_dense.py) instead of expanding every
request's cached latents through kv_b_proj on every step.

usage: python benchmarks/continuous_batching.py OUT.json [--requests 16] [--prompt 2048] [--new 32] [--heads 16]
                                                [--modes hf hf_compile mla]
Each mode: one generate_batch() to compile / warm up, then the timed one (wall time, tokens / s); the generated
tokens are compared with the first mode's (agreement: the fraction of requests whose tokens are identical).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import build_model  # noqa: E402
from hf_decode import sync  # noqa: E402


def run_mode(model, mode: str, prompts, new: int, args):
    from transformers import CompileConfig, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cc = None if mode == "hf" else CompileConfig(backend="mla_dcp" if mode == "mla" else "inductor", mode="default",
                                                 fullgraph=False)
    if cc is not None:
        cc._compile_all_devices = True  # HF compiles on CUDA only otherwise (the CPU smoke run)
    cfg = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens, varlen_compile_config=cc,
                                   q_padding_interval_size=args.q_pad, kv_padding_interval_size=args.kv_pad)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    times, out = [], None
    for _ in range(2):
        sync(model.device)
        t = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg)
        sync(model.device)
        times.append(time.perf_counter() - t)
    counters = dict(torch._dynamo.utils.counters["mla_compile"])
    tokens = {k: v.generated_tokens for k, v in out.items()}
    return dict(first_s=times[0], timed_s=times[1], tokens_per_s=len(prompts) * new / times[1],
                counters=counters), tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--q-pad", type=int, default=64)
    ap.add_argument("--kv-pad", type=int, default=8192)
    ap.add_argument("--modes", nargs="+", default=["hf", "hf_compile", "mla"])
    ap.add_argument("--smoke", action="store_true", help="CPU, float32, a tiny model (the script's own check)")
    args = ap.parse_args()
    import mla_compile  # noqa: F401

    device = torch.device("cpu" if args.smoke else "cuda")
    model = build_model(args.heads, args.layers, 256 if args.smoke else 2048, 32768,
                        torch.float32 if args.smoke else torch.bfloat16, device, small=args.smoke)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 32768, (args.prompt - 64 * (i % 4),), generator=g).tolist()
               for i in range(args.requests)]
    result = dict(args=vars(args), device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", modes={})
    ref = None
    for mode in args.modes:
        try:
            row, tokens = run_mode(model, mode, prompts, args.new, args)
        except Exception as e:  # noqa: BLE001 - one mode's failure is a result too
            result["modes"][mode] = dict(error=f"{type(e).__name__}: {e}"[:500])
            print(mode, "failed:", result["modes"][mode]["error"], flush=True)
            continue
        ref = tokens if ref is None else ref
        row["agreement"] = sum(tokens[k] == ref.get(k) for k in tokens) / len(tokens)
        result["modes"][mode] = row
        print(f"{mode:12s} timed {row['timed_s']:.3f} s  ({row['tokens_per_s']:.1f} tok/s; first call "
              f"{row['first_s']:.1f} s)  agreement {row['agreement']:.2f}  {row['counters']}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
