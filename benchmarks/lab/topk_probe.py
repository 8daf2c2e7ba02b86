"""Lab probe (issue 29): can one Triton radix-select kernel replace `torch.topk` in `dsa::indexer_topk`?

`dsa::indexer_topk` on CUDA is three steps (kernels/dsa.py): the logits kernel writes each token's int64 order key
(`mla_compile/topk_order.py`: score descending, ties to the lower token index; distinct for real tokens, NONE
below them), `torch.topk(keys, k, sorted=True)` takes each row's k largest, the slots kernel maps them to physical
slots. On the H200 host (benchmarks/host_overhead.py, 2026-12-03) the op costs 42.8 us per eager call, ~19 of
them in `torch.topk` alone (its CUDA path: a radix select, then a bitonic sort of the k picked, each with its own
launch and output allocations; for few long rows a multi-block select with several launches per radix digit).
Peers replace it with one kernel per call (TensorRT-LLM's indexerTopK, vLLM's `top_k_per_row`, SGLang's
`fast_topk`: one CTA per row, a histogram radix select in shared memory).

`radix_topk(keys, k)` here: ONE launch, one program per row, no allocation but its output:
  1. radix select over the keys' 64 bits as unsigned (sign bit flipped), 8 bits a pass, most significant first:
     each pass histograms the digit of the keys that match the prefix found so far (`tl.histogram`, masked), and
     picks the digit holding the k-th largest; it stops as soon as the keys matching the prefix are exactly the
     ones still needed (random scores: after 2-3 passes);
  2. one pass writes every key whose masked value is >= the prefix (exactly k of them: the keys are distinct)
     to the row's output, positions from a running `tl.cumsum`;
  3. the k written keys are sorted descending in registers (`tl.sort`) and written back.
Output: int64 [B, k], the row's k largest keys, largest first: what `torch.topk(keys, k).values` returns, so the
slots kernel would read it unchanged. Rows need at least k real keys (what the op guarantees for the rows it ranks).

    python benchmarks/lab/topk_probe.py OUT.json          # GPU: time both, check equality
    TRITON_INTERPRET=1 python benchmarks/lab/topk_probe.py --check   # CPU: small shapes against torch.topk

Timing (GPU): CUDA-graph replay of each (`do_bench_cudagraph`, median), and host us per eager call (a loop of calls
without a sync, as host_overhead.py times ops), at decode shapes of DeepSeek-V3.2's indexer (k 2048) and the host
benchmark's small shape (B 1, 1K tokens, k 256). Each Triton variant is checked equal to torch.topk's values first.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mla_compile import topk_order  # noqa: E402

_SIGN = tl.constexpr(-(2**63))  # int64 sign bit: key ^ _SIGN orders as unsigned like the key does as signed


@triton.jit
def _radix_topk_kernel(Keys, Out, T, k, s_kb, s_ob, BLOCK: tl.constexpr, KBLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    keys_row = Keys + row * s_kb
    out_row = Out + row * s_ob
    offs = tl.arange(0, BLOCK)
    digits = tl.arange(0, 256)
    prefix = tl.zeros((), dtype=tl.uint64)
    mask = tl.zeros((), dtype=tl.uint64)
    need = k  # keys still to take among those matching the prefix
    shift = 56
    done = False
    while (shift >= 0) & (not done):
        hist = tl.zeros((256,), dtype=tl.int32)
        for start in range(0, T, BLOCK):
            idx = start + offs
            key = tl.load(keys_row + idx, mask=idx < T, other=-(2**63))
            u = (key ^ _SIGN).to(tl.uint64, bitcast=True)
            match = ((u & mask) == prefix) & (idx < T)
            digit = ((u >> shift) & 255).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
        # at_least[d]: matching keys with digit >= d (non-increasing in d); the k-th largest has the largest d with
        # at_least[d] >= need
        at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        pick = tl.sum((at_least >= need).to(tl.int32)) - 1
        above = tl.sum(tl.where(digits > pick, hist, 0))
        equal = tl.sum(tl.where(digits == pick, hist, 0))
        need -= above
        prefix |= pick.to(tl.uint64) << shift
        mask |= tl.full((), 255, tl.uint64) << shift
        done = equal == need  # every key matching the prefix is taken: no further digit decides anything
        shift -= 8
    # the k keys whose masked value is >= the prefix, in row order
    base = 0
    for start in range(0, T, BLOCK):
        idx = start + offs
        key = tl.load(keys_row + idx, mask=idx < T, other=-(2**63))
        u = (key ^ _SIGN).to(tl.uint64, bitcast=True)
        take = ((u & mask) >= prefix) & (idx < T)
        pos = base + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_row + pos, key, mask=take)
        base += tl.sum(take.to(tl.int32))
    tl.debug_barrier()  # the row's writes above, by every thread, before any thread reads them back
    ko = tl.arange(0, KBLOCK)
    top = tl.load(out_row + ko, mask=ko < k, other=-(2**63))
    top = tl.sort(top, descending=True)
    tl.debug_barrier()
    tl.store(out_row + ko, top, mask=ko < k)


def radix_topk(keys: torch.Tensor, k: int, block: int = 1024, num_warps: int = 8) -> torch.Tensor:
    """int64 [B, k]: each row's k largest keys, largest first (rows need >= k keys above NONE)."""
    B, T = keys.shape
    out = torch.empty((B, k), dtype=torch.int64, device=keys.device)
    _radix_topk_kernel[(B,)](keys, out, T, k, keys.stride(0), out.stride(0), BLOCK=block,
                             KBLOCK=triton.next_power_of_2(k), num_warps=num_warps)
    return out


def make_keys(B: int, T: int, valid: int, device, gen, ties: bool = False) -> torch.Tensor:
    """Order keys of random scores (ties: scores from 8 values, so the k-th place falls in a tie class), the last
    T - valid positions NONE."""
    score = torch.randn(B, T, generator=gen, device=device)
    if ties:
        score = (score * 2).round() / 2
    cols = torch.arange(T, device=device)
    return topk_order.order_keys(score, cols[None, :], (cols < valid)[None, :].expand(B, T))


def check(device="cpu") -> list[str]:
    gen = torch.Generator(device=device).manual_seed(0)
    bad = []
    for B, T, valid, k, ties, block in [(2, 300, 300, 16, False, 64), (3, 257, 200, 64, True, 128),
                                        (1, 1000, 999, 128, False, 256), (2, 64, 64, 64, True, 64),
                                        (2, 130, 129, 100, False, 64)]:
        keys = make_keys(B, T, valid, device, gen, ties)
        want = torch.topk(keys, k, dim=1).values
        got = radix_topk(keys, k, block=block, num_warps=4)
        if not torch.equal(got, want):
            bad.append(f"B {B} T {T} valid {valid} k {k} ties {ties}: differs")
    return bad


SHAPES = [(1, 1024, 256), (8, 8192, 2048), (8, 32768, 2048), (32, 32768, 2048), (8, 131072, 2048),
          (64, 8192, 2048)]  # (B, T, k); the first is host_overhead.py's indexer call
VARIANTS = [(1024, 8), (2048, 8), (4096, 16)]  # (BLOCK, num_warps)


def host_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / calls * 1e6


def main(argv):
    if "--check" in argv:
        bad = check("cpu")
        print("VERDICT", "ok" if not bad else "; ".join(bad))
        return
    from triton.testing import do_bench_cudagraph

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B, T, k in SHAPES:
        keys = make_keys(B, T, T, "cuda", gen)
        want = torch.topk(keys, k, dim=1).values
        row = dict(B=B, T=T, k=k, torch_graph_us=do_bench_cudagraph(lambda: torch.topk(keys, k, dim=1),
                                                                    rep=50, return_mode="median") * 1e3,
                   torch_host_us=host_us(lambda: torch.topk(keys, k, dim=1)), triton={})
        for block, warps in VARIANTS:
            name = f"b{block}w{warps}"
            try:
                got = radix_topk(keys, k, block, warps)
                if not torch.equal(got, want):
                    row["triton"][name] = "differs from torch.topk"
                    continue
                row["triton"][name] = dict(
                    graph_us=do_bench_cudagraph(lambda: radix_topk(keys, k, block, warps), rep=50,
                                                return_mode="median") * 1e3,
                    host_us=host_us(lambda: radix_topk(keys, k, block, warps)))
            except Exception as e:  # noqa: BLE001 - a variant that does not build is reported, not fatal
                row["triton"][name] = repr(e)[:300]
        ties = make_keys(B, T, T, "cuda", gen, ties=True)  # the k-th place inside a tie class: every pass runs
        row["ties_equal"] = bool(torch.equal(radix_topk(ties, k), torch.topk(ties, k, dim=1).values))
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows)
    if argv:
        Path(argv[0]).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
