"""`dsa::indexer_topk`'s two top-k selects side by side (issue 29): the radix select kernel (one launch, one program per
row: `kernels/dsa._select_slots_kernel`) vs torch.topk + the slots kernel, each inside the whole op (the logits
kernel first), on the same inputs.

usage:  python benchmarks/indexer_select.py OUT.json        (CUDA; `bash benchmarks/device.sh select`)
        TRITON_INTERPRET=1 python benchmarks/indexer_select.py --check     (CPU smoke test)

Per shape (B requests, T tokens each in the block table, all rows ranked: seq_len = T > topk; V3.2's indexer:
Hi 64, Di 128, bf16, page 64): CUDA-graph replay median of each select's plan (`do_bench_cudagraph`), the host us
per eager call of each (host_overhead.py's loops of calls without a sync, the two selects interleaved), and a check that
both give the same slots (random scores: distinct keys, one right answer). `kernels/dsa.RADIX_MAX_TOKENS` is set
from these rows: auto takes radix where it is not slower.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.host_overhead import host_us_interleaved  # noqa: E402
from mla_compile import paged  # noqa: E402
from mla_compile.kernels import dsa as K  # noqa: E402

SHAPES = [(1, 1024, 256), (8, 4096, 2048), (8, 8192, 2048), (64, 8192, 2048), (8, 16384, 2048), (8, 32768, 2048),
          (32, 16384, 2048)]  # (B, T, topk); the first is host_overhead.py's indexer call
HI, DI, PS = 64, 128, 64


def inputs(B: int, T: int, gen, device: str = "cuda") -> tuple:
    q = torch.randn(B, HI, DI, generator=gen).bfloat16()
    w = torch.randn(B, HI, generator=gen)
    keys = [torch.randn(T, DI, generator=gen).bfloat16() for _ in range(B)]
    bt = paged.fill_paged(keys, keys, PS, shuffle=True, generator=gen)
    return tuple(t.to(device) for t in (q, w, bt.ckv_cache, bt.block_table, bt.seq_lens))


def check() -> bool:
    """CPU, under TRITON_INTERPRET=1: the two selects agree at a small shape (the script's own smoke test)."""
    args = inputs(2, 300, torch.Generator().manual_seed(0), "cpu")
    return torch.equal(K.indexer_topk(*args, 40, 0.1, "radix"), K.indexer_topk(*args, 40, 0.1, "torch"))


def main(argv) -> int:
    if "--check" in argv:
        print("VERDICT", "ok" if check() else "differs")
        return 0
    from triton.testing import do_bench_cudagraph

    gen = torch.Generator().manual_seed(0)
    rows = []
    for B, T, topk in SHAPES:
        args = inputs(B, T, gen)
        plans = {s: K.indexer_topk_plan(*args, topk, 0.1, s) for s in ("radix", "torch")}
        outs = {s: plan(*args) for s, plan in plans.items()}
        row = dict(B=B, T=T, topk=topk, same=bool(torch.equal(outs["radix"], outs["torch"])),
                   auto=K._select("auto", T, topk))
        for s, plan in plans.items():
            row[f"{s}_graph_us"] = do_bench_cudagraph(lambda: plan(*args), rep=50, return_mode="median") * 1e3
        host = host_us_interleaved({s: (lambda plan=plan: plan(*args)) for s, plan in plans.items()}, 200)
        row.update({f"{s}_host_us": us for s, us in host.items()})
        row["radix_over_torch_graph"] = row["radix_graph_us"] / row["torch_graph_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| B | T | topk | radix graph us | torch graph us | radix/torch | radix host us | torch host us | same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['T']} | {r['topk']} | {r['radix_graph_us']:.1f} | {r['torch_graph_us']:.1f} | "
              f"{r['radix_over_torch_graph']:.2f} | {r['radix_host_us']:.1f} | {r['torch_host_us']:.1f} | "
              f"{r['same']} |")
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               radix_max_tokens=K.RADIX_MAX_TOKENS, rows=rows)
    if argv:
        Path(argv[0]).write_text(json.dumps(doc, indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
