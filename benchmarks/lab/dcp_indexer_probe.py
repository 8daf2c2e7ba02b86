"""Lab probe: what `dsa::dcp_indexer_topk`'s per-rank work costs on the GPU, next to the single-rank op's.

Under DCP each rank scores its shard of the indexer keys and takes its top-k candidates
(`ops/dcp_dsa.local_candidates`: plain torch, the one formula of the CPU paths: keys gathered to float32 [B, T, Di],
two einsums, `topk_order.order_keys`, `torch.topk`) before one all-gather and the merge. The single-rank op runs the
logits kernel and the radix select (kernels/dsa.py). Same shard, same lengths, one GPU (no process group: the
collective is not timed), CUDA-graph replay medians (`do_bench_cudagraph`):

  local eager     local_candidates as the op runs it eagerly
  local compiled  the same under torch.compile (what a compiled model's dcp_indexer_topk decomposes to)
  op              torch.ops.dsa.dcp_local_candidates: on CUDA the logits kernel + the radix select writing keys
  indexer_topk    torch.ops.dsa.indexer_topk over the same shard (a kernel path's cost at this per-rank length)

    python benchmarks/lab/dcp_indexer_probe.py OUT.json        (`bash benchmarks/device.sh dcpindexer`)

The question: is the DCP indexer's local step worth a kernel path (the logits kernel writing keys with the global
token index, the radix select writing keys instead of slots)?
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mla_compile  # noqa: E402,F401  (registers the ops)
from mla_compile import topk_order  # noqa: E402
from mla_compile.ops.dcp_dsa import local_candidates  # noqa: E402

SHAPES = [(8, 4096, 2048), (8, 16384, 2048), (8, 65536, 2048), (32, 16384, 2048)]  # (B, local tokens, topk)
HI, DI, PS, N, RANK = 64, 128, 64, 2, 0


def main(argv) -> int:
    from triton.testing import do_bench_cudagraph

    gen = torch.Generator(device="cuda").manual_seed(0)
    compiled = torch.compile(local_candidates, dynamic=False)
    rows = []
    for B, T, topk in SHAPES:
        pages = B * T // PS
        k_cache = torch.randn(pages, PS, DI, generator=gen, device="cuda").bfloat16()
        table = torch.randperm(pages, device="cuda", generator=gen).view(B, T // PS).int()
        lens = torch.full((B,), T, dtype=torch.int32, device="cuda")
        q = torch.randn(B, HI, DI, generator=gen, device="cuda").bfloat16()
        w = torch.randn(B, HI, generator=gen, device="cuda")
        local = lambda: local_candidates(q, w, k_cache, table, lens, topk, 0.1, N, RANK)  # noqa: E731
        fused = lambda: compiled(q, w, k_cache, table, lens, topk, 0.1, N, RANK)  # noqa: E731
        single = lambda: torch.ops.dsa.indexer_topk(q, w, k_cache, table, lens, topk, 0.1)  # noqa: E731
        op = lambda: torch.ops.dsa.dcp_local_candidates(q, w, k_cache, table, lens, topk, 0.1, N, RANK)  # noqa: E731
        # compiled scores may round differently (sum order): the share of picked tokens both agree on
        picked = [topk_order.key_index(keys).sort(dim=1).values for keys in (local(), fused())]
        agree = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(*picked)) / (B * topk)
        row = dict(B=B, T=T, topk=topk, compiled_agrees=agree)
        row["op_equals_plain"] = bool(torch.equal(op(), local()))  # kernel scores may round apart from float32 torch
        for name, fn in (("local_eager_us", local), ("local_compiled_us", fused), ("op_us", op),
                         ("indexer_topk_us", single)):
            row[name] = do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    if argv:
        Path(argv[0]).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
