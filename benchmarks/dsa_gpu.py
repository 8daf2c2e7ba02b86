"""DSA decode at kv_len <= topk: dense (k-only) graph vs sparse (indexer) graph, same inputs, same run.

Both variants come from one `torch.compile(..., backend="mla_dcp", mode="reduce-overhead")` of the example
layer: max_kv_len = real max selects the dense graph; max_kv_len = topk + 1 forces the sparse graph (valid,
since the indexer then selects every token too). Also checks the two give the same output, counts
compiled graphs / cudagraph recordings, and times the indexer ops alone.

    python benchmarks/dsa_gpu.py out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from dsa_decode import DecodeState, DSADecodeLayer  # noqa: E402

from mla_compile.dsa import mark_max_kv_len_dynamic  # noqa: E402


def time_cuda(fn, iters=50, warmup=10) -> float:
    """Mean ms per call, CUDA events around `iters` calls (wall clock on CPU, for smoke runs)."""
    if not torch.cuda.is_available():
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_graph(fn, reps=20, iters=20) -> float:
    """Mean ms per call of fn, `reps` calls captured in one CUDA graph (GPU time: inside a decode step's graph
    an op costs its kernels, not a graph launch)."""
    if not torch.cuda.is_available():
        return time_cuda(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture (Triton JIT)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return time_cuda(graph.replay, iters=iters) / reps


def bench(batch: int, kv_len: int, topk: int, heads: int, dtype=torch.bfloat16, device="cuda", hidden=2048,
          index_heads=64) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = DSADecodeLayer(hidden=hidden, heads=heads, kv_lora_rank=512, rope_dim=64, index_heads=index_heads,
                           index_dim=128, topk=topk).to(device, dtype).eval()
    state = DecodeState(layer, [kv_len - 1] * batch, max_len=kv_len + 64, page_size=64, dtype=dtype)
    seq_lens, slots, max_kv_len = state.step_inputs()
    seq_lens, slots = seq_lens.to(device), slots.to(device)
    for name in ("block_table", "ckv", "kpe", "index"):
        setattr(state, name, getattr(state, name).to(device))
        torch._dynamo.mark_static_address(getattr(state, name))  # caches are mutated inside CUDA graphs
    mark_max_kv_len_dynamic()
    mode = "reduce-overhead" if device == "cuda" else None
    compiled = torch.compile(layer, backend="mla_dcp", mode=mode, fullgraph=True)
    x = torch.randn(batch, hidden, device=device, dtype=dtype)
    args = (x, state.ckv, state.kpe, state.index, state.block_table, seq_lens, slots)
    with torch.no_grad():
        dense_out = compiled(*args, max_kv_len).clone()
        sparse_out = compiled(*args, topk + 1).clone()
        t_dense = time_cuda(lambda: compiled(*args, max_kv_len))
        t_sparse = time_cuda(lambda: compiled(*args, topk + 1))
        q = torch.randn(batch, index_heads, 128, device=device, dtype=dtype)
        w = torch.rand(batch, index_heads, device=device)
        # The indexer as the seed runs it at kv_len <= topk: full logits + top-k. (Our indexer_topk skips the
        # logits of rows with kv_len <= topk, so time it with a top-k below kv_len to make it do the work.)
        full_topk = kv_len // 2
        t_indexer = time_graph(lambda: torch.ops.dsa.indexer_topk(q, w, state.index, state.block_table, seq_lens,
                                                                   full_topk, 128 ** -0.5))
        t_k_only = time_graph(lambda: torch.ops.dsa.k_only_indices(state.block_table, seq_lens, 64, topk))
    err = ((dense_out.float() - sparse_out.float()).abs().max() / sparse_out.float().abs().max()).item()
    return dict(batch=batch, kv_len=kv_len, topk=topk, heads=heads, dense_ms=t_dense, sparse_ms=t_sparse,
                step_speedup=t_sparse / t_dense, indexer_ms=t_indexer, k_only_ms=t_k_only,
                indexer_time_cut=1 - t_k_only / t_indexer, dense_vs_sparse_rel_err=err,
                graphs=counters["stats"]["unique_graphs"],
                cudagraph_skips=sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "skip" in k))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="dsa_gpu.json")
    out = ap.parse_args(argv).out
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (dense vs sparse graphs under CUDA-graph trees); none here")
    rows = [bench(b, 2048, 2048, h) for h in (16, 128) for b in (8, 32)]
    print("| H | B | kv_len | dense ms | sparse ms | step speedup | indexer ms | k-only ms | indexer cut | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['heads']} | {r['batch']} | {r['kv_len']} | {r['dense_ms']:.3f} | {r['sparse_ms']:.3f} | "
              f"{r['step_speedup']:.2f}x | {r['indexer_ms']:.3f} | {r['k_only_ms']:.4f} | "
              f"{100 * r['indexer_time_cut']:.1f}% | {r['dense_vs_sparse_rel_err']:.1e} |")
    Path(out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
