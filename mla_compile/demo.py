"""The main job: `python -m mla_compile demo`.

Today: a CPU walk-through of decode context parallelism — each request's latent KV is split token-cyclically
over n simulated ranks, every rank decodes its shard, and `mla::merge_states` combines the partial states;
the result must equal the unsplit decode. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from . import ops  # noqa: F401
from .paged import fill_paged, fill_sharded


def simulated_dcp(*, batch: int, heads: int, kv_lora_rank: int, rope_dim: int, page_size: int,
                  max_len: int, ranks: list[int], dtype: torch.dtype, seed: int) -> bool:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (batch,), generator=g).tolist()
    lens[0] = max_len  # at least one long request
    ckv = [torch.randn(n, kv_lora_rank, generator=g).to(dtype) for n in lens]
    kpe = [torch.randn(n, rope_dim, generator=g).to(dtype) for n in lens]
    q_nope = torch.randn(batch, heads, kv_lora_rank, generator=g).to(dtype)
    q_pe = torch.randn(batch, heads, rope_dim, generator=g).to(dtype)
    scale = 1.0 / math.sqrt(128 + rope_dim)

    full = fill_paged(ckv, kpe, page_size, generator=g)
    t0 = time.perf_counter()
    ref_out, ref_lse = torch.ops.mla.decode(q_nope, q_pe, full.ckv_cache, full.kpe_cache, full.block_table,
                                            full.seq_lens, scale)
    t_full = time.perf_counter() - t0
    print(f"requests: lens={lens}  heads={heads}  R={kv_lora_rank}  P={rope_dim}  page={page_size}  {dtype}")
    print(f"unsplit decode: {t_full * 1e3:.1f} ms")
    print(f"{'ranks':>5} {'tokens/rank (req 0)':>22} {'max|dout|':>10} {'max|dlse|':>10}  ok")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    all_ok = True
    for n in ranks:
        outs, lses = [], []
        for r in range(n):
            shard = fill_sharded(ckv, kpe, page_size, n, r, generator=g)
            o, l = torch.ops.mla.decode(q_nope, q_pe, shard.ckv_cache, shard.kpe_cache, shard.block_table,
                                        shard.seq_lens, scale)
            outs.append(o)
            lses.append(l)
        out, lse = torch.ops.mla.merge_states(torch.stack(outs), torch.stack(lses))
        d_out = (out.float() - ref_out.float()).abs().max().item()
        finite = torch.isfinite(ref_lse)
        same_empty = torch.equal(finite, torch.isfinite(lse))
        d_lse = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        ok = same_empty and d_out <= tol and d_lse <= tol
        all_ok &= ok
        per_rank = "/".join(str(-(-max(lens[0] - r, 0) // n)) for r in range(n))
        print(f"{n:>5} {per_rank:>22} {d_out:>10.2e} {d_lse:>10.2e}  {'yes' if ok else 'NO'}")
    return all_ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_compile demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=300)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    ok = simulated_dcp(batch=a.batch, heads=a.heads, kv_lora_rank=a.kv_lora_rank, rope_dim=a.rope_dim,
                       page_size=a.page_size, max_len=a.max_len, ranks=a.ranks, dtype=getattr(torch, a.dtype),
                       seed=a.seed)
    print("DCP split+merge equals unsplit decode:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
