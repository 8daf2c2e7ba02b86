"""Lab probe: what a compiled HF decode step hands our ops (shapes, strides, dtypes, storage offsets), on the CPU.

The kernel a call gets on the GPU follows from these (kernels/dispatch.py: page size, layout, dtype, heads), so this
answers "which kernel and tiling does the HF path run?" without device time. Found with it (2026-12-03): the HF pass
hands every cache, DSAStaticCache's FP8 one included, to `mla.decode` as a page-size-1 view with a token table
(ckv [B * max_len, 1, 512], table [B, max_len]), not as its pages.

    python benchmarks/lab/hf_call_args.py [--heads 16] [--batch 2] [--kv 256] [--kv-cache-dtype auto|fp8_e4m3]

It builds benchmarks/hf_decode.py's model and cache (one layer), compiles the model with `mla_dcp` (default mode),
wraps the CPU kernels of mla::decode / mla::sparse_decode / dsa::indexer_topk to print their arguments, and runs one
decode step. (A TorchDispatchMode would not do: Dynamo does not compile under one, so HF would run eagerly.)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_decode import build_model, cache_kwargs, filled_cache  # noqa: E402

import mla_compile  # noqa: E402,F401
from mla_compile.ops import attention, dsa  # noqa: E402


def describe(a):
    if isinstance(a, torch.Tensor):
        return f"{a.dtype} {tuple(a.shape)} strides {tuple(a.stride())} offset {a.storage_offset()}"
    return repr(a)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3", "fp8_ue8m0"], default="auto")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    B, kv = args.batch, args.kv
    max_len = kv + 640
    model = build_model(args.heads, 1, 2048, 1024, torch.bfloat16, "cpu")
    cache = filled_cache(model, B, kv, max_len, "cpu", kv_cache_dtype=args.kv_cache_dtype)
    libs = []
    for ns, name, op in (("mla", "decode", attention.decode), ("mla", "sparse_decode", attention.sparse_decode),
                         ("dsa", "indexer_topk", dsa.indexer_topk)):
        impl = op.__wrapped__

        def logged(*a, _impl=impl, _name=f"{ns}.{name}"):
            print(_name)
            for x in a:
                print("   ", describe(x))
            return _impl(*a)

        lib = torch.library.Library(ns, "IMPL")
        lib.impl(name, logged, "CPU")
        libs.append(lib)
    step = torch.compile(model, backend="mla_dcp")
    mask = torch.ones(B, max_len, dtype=torch.long)
    with torch.no_grad():
        step(torch.ones(B, 1, dtype=torch.long), **cache_kwargs(model, cache), attention_mask=mask[:, :kv + 1],
             cache_position=torch.tensor([kv]))


if __name__ == "__main__":
    main()
