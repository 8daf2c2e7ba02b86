"""FP8 latent cache decode (mla_compile/fp8.py, issue 25) vs the bf16 cache and the peers, side by side on the same
tokens.

    python benchmarks/fp8_decode.py [out.json] [--shapes H:B:KV ...] [--scale-fmt ue8m0]

Shapes (H, B, kv per request): issue 25's acceptance grid, R 512 / P 64, page 64, shuffled pages, bf16 q. The bf16
cache is random bf16 tokens; the FP8 cache holds the same tokens quantized by `mla::cache_write_fp8` (656 bytes a
token, one [NP, PS, 656] buffer; `--scale-fmt ue8m0`: with power-of-two scales, which FlashMLA's V3.2 kernel reads
exactly). Timing: CUDA-graph replay (triton.testing.do_bench_cudagraph, median) of one
decode call, what a captured decode step runs:
  - `bf16_ms`: `torch.ops.mla.decode` over the bf16 caches (what the dispatch picks for separate caches);
  - `flashmla_bf16_ms`: FlashMLA's dense bf16 decode on its fused [pages, 64, 576] layout (schedule made per call);
  - `flashmla_fp8_ms`: FlashMLA's dense FP8 decode (`is_fp8_kvcache=True`, one scale per tensor for q and for the
    cache: not our format, so its accuracy is reported, not compared; schedule made once, outside the timing);
  - `fp8_ms`: `torch.ops.mla.decode` over the FP8 cache: what auto runs (on an H200 at page 64 the swap-AB Gluon
    kernel, kernels/decode_fp8_swapab.py);
  - `fp8_triton_ms`: `kernels.decode.decode` over the FP8 cache: the Triton FP8 kernel (decode_fp8.py: scales folded
    into the products; what token tables, fp16 q and index lists take);
  - `fp8_dequant_ms`: the pointer kernel that dequantizes its tiles in registers (fp32 q takes it), over the same
    FP8 cache;
  - `fp8_flashmla_ms`: `torch.ops.mla.decode` over the FP8 cache with decode_kernel="flashmla" (H 64 / 128 with
    FlashMLA installed): FlashMLA's V3.2 FP8 kernel reading our cache in place (kernels/flashmla_fp8.py; each
    request's slots written as an index list per call, included in the time);
  - `fp8_configs_ms`: decode_fp8.py's kernel at other tilings (`--sweep`).
`--token-table`: instead, what the HF pass hands `mla.decode` (benchmarks/lab/hf_call_args.py): every cache as a
page-size-1 view ([slots, 1, width]) read through a token table [B, kv] of each request's slots (its shuffled pages'
slots in order), at H 16 / 128, B 8, 32K: the bf16 cache (`bf16_ms`), the FP8 cache through auto (`fp8_ms`: the
swap-AB kernel's GATHER form) and the Triton FP8 kernel (`fp8_triton_ms`), and auto over the same caches' page-64
views beside them (`*_paged_ms`): what the token table costs each reader.
`--whole-page`: instead, the layout HF's FP8 `DSAStaticCache` hands the kernel (one page per request, max_len =
kv + 640 tokens, a [B, 1] block table) at H 16 / 128, B 8, 32K: the default tiling and every SWEEP tiling, each
checked against float64 first.
Every timed call of ours is checked first against a float64 reference of request 0 (over the dequantized cache
for FP8). `*_gbps` counts the cache bytes read (bf16: 1152 a token, FP8: 656); `*_bw_frac` divides that by a
device-to-device copy's bandwidth (read + write) measured in the same run as bench_ops.py measures it. Prints one
JSON document (also written to argv[1] if given).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from op_timing_out import emit, row_done  # noqa: E402

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile import fp8, tuning

R, P, PS = 512, 64, 64
SCALE = (128 + 64) ** -0.5
CASES = [(16, 8, 32768), (16, 32, 32768), (16, 8, 131072), (128, 8, 32768), (128, 32, 32768)]  # (H, B, kv)
# other tilings of decode_fp8.py's kernel (--sweep): block_h, block_n, warps, stages
SWEEP = [(16, 64, 8, 3), (16, 32, 8, 2), (16, 64, 4, 2), (32, 64, 8, 2), (32, 32, 4, 2)]


def caches(B, KV, gen, scale_fmt=None):
    """(bf16 ckv, bf16 kpe, FP8 buffer views (ckv, scale, kpe), block table, lengths) of the same tokens; scale_fmt:
    the FP8 write's (`fp8.quantize`)."""
    pages = B * KV // PS
    ckv = torch.randn(pages, PS, R, generator=gen, device="cuda").to(torch.bfloat16)
    kpe = torch.randn(pages, PS, P, generator=gen, device="cuda").to(torch.bfloat16)
    _, c8, s8, k8 = fp8.allocate(pages, PS, R, P, device="cuda")
    slots = torch.arange(pages * PS, device="cuda")
    torch.ops.mla.cache_write_fp8(c8, k8, s8, ckv.view(-1, R), kpe.view(-1, P), slots, scale_fmt)
    table = torch.randperm(pages, generator=gen, device="cuda").view(B, KV // PS).int()
    return ckv, kpe, (c8, s8, k8), table, torch.full((B,), KV, dtype=torch.int32, device="cuda")


def check_request0(out, lse, qn, qp, ckv_rows, kpe, table, page_size=PS, length=None) -> str:
    """Request 0 against float64 on the GPU; ckv_rows(slots) gives its latent rows in float64. Its tokens: every
    slot of its table's pages, or the first `length` of them."""
    slots = (table[0].long()[:, None] * page_size + torch.arange(page_size, device="cuda")).reshape(-1)[:length]
    c, k = ckv_rows(slots), kpe.reshape(-1, P)[slots].double()
    s = SCALE * (qn[0].double() @ c.T + qp[0].double() @ k.T)
    want = torch.softmax(s, -1) @ c
    err = float((out[0].double() - want).norm() / want.norm())
    lse_err = float((lse[0].double() - torch.logsumexp(s, -1)).abs().max())
    return "ok" if err < 2e-2 and lse_err < 2e-2 else f"out rel err {err:.3g}, lse abs err {lse_err:.3g}"


def whole_page_rows(ms, K, slack: int = 640) -> list[dict]:
    """HF's DSAStaticCache layout: one page of kv + slack tokens per request (module docstring, `--whole-page`)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for H, B, KV in ((16, 8, 32768), (128, 8, 32768)):
        width = KV + slack
        ckv = torch.randn(B * width, R, generator=gen, device="cuda").to(torch.bfloat16)
        kpe = torch.randn(B * width, P, generator=gen, device="cuda").to(torch.bfloat16)
        _, c8, s8, k8 = fp8.allocate(B, width, R, P, device="cuda")
        torch.ops.mla.cache_write_fp8(c8, k8, s8, ckv, kpe, torch.arange(B * width, device="cuda"))
        table = torch.arange(B, device="cuda", dtype=torch.int32)[:, None]
        lens = torch.full((B,), KV, dtype=torch.int32, device="cuda")
        qn = torch.randn(B, H, R, generator=gen, device="cuda").to(torch.bfloat16)
        qp = torch.randn(B, H, P, generator=gen, device="cuda").to(torch.bfloat16)
        def rows(s):
            return fp8.dequantize(c8.reshape(-1, R)[s], s8.reshape(-1, 4)[s], torch.float64)

        row = dict(H=H, B=B, kv_len=KV, page_size=width, default_cfg=str(K.fp8_config(H, width)), fp8_configs_ms={})
        for name, cfg in [("default", None)] + [(f"h{bh}n{bn}w{w}s{st}", K.DecodeConfig(
                block_h=bh, block_n=bn, num_warps=w, num_stages=st, max_splits=256)) for bh, bn, w, st in SWEEP]:
            def call(cfg=cfg):
                return K.decode(qn, qp, c8, k8, table, lens, SCALE, cfg=cfg, ckv_scale=s8)
            try:
                ok = check_request0(*call(), qn, qp, rows, k8, table, width, KV)
                row["fp8_configs_ms"][name] = ms(call) if ok == "ok" else ok
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: reported per config
                row["fp8_configs_ms"][name] = repr(e)[:200]
        rows.append(row)
        row_done(row)
        del ckv, kpe, c8, s8, k8
        torch.cuda.empty_cache()
    return rows


def token_table_rows(ms, K) -> list[dict]:
    """The HF pass's page-size-1 token-table layout next to the page-64 one (module docstring, `--token-table`)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for H, B, KV in ((16, 8, 32768), (128, 8, 32768)):
        ckv, kpe, (c8, s8, k8), table, lens = caches(B, KV, gen)
        tokens = (table.long()[:, :, None] * PS + torch.arange(PS, device="cuda")).reshape(B, KV).int()
        qn = torch.randn(B, H, R, generator=gen, device="cuda").to(torch.bfloat16)
        qp = torch.randn(B, H, P, generator=gen, device="cuda").to(torch.bfloat16)
        flat = [t.reshape(-1, 1, t.shape[-1]) for t in (ckv, kpe, c8, s8, k8)]

        def fp8_rows(s):
            return fp8.dequantize(c8.reshape(-1, R)[s], s8.reshape(-1, 4)[s], torch.float64)

        calls = {
            "bf16": (lambda: torch.ops.mla.decode(qn, qp, flat[0], flat[1], tokens, lens, SCALE),
                     lambda s: ckv.reshape(-1, R)[s].double(), kpe),
            "fp8": (lambda: torch.ops.mla.decode(qn, qp, flat[2], flat[4], tokens, lens, SCALE, flat[3]), fp8_rows, k8),
            "fp8_triton": (lambda: K.decode(qn, qp, flat[2], flat[4], tokens, lens, SCALE, ckv_scale=flat[3]),
                           fp8_rows, k8),
            "bf16_paged": (lambda: torch.ops.mla.decode(qn, qp, ckv, kpe, table, lens, SCALE), None, None),
            "fp8_paged": (lambda: torch.ops.mla.decode(qn, qp, c8, k8, table, lens, SCALE, s8), None, None),
        }
        row = dict(H=H, B=B, kv_len=KV, layout="page 1, token table")
        for name, (call, rows_of, kpe_of) in calls.items():
            if rows_of is not None:  # the token table's layouts are checked; the paged ones are the main table's
                row[f"{name}_check"] = check_request0(*call(), qn, qp, rows_of, kpe_of.reshape(-1, 1, P),
                                                      tokens[:, :, None], 1)
            row[f"{name}_ms"] = ms(call)
        rows.append(row)
        row_done(row)
        del ckv, kpe, c8, s8, k8, flat
        torch.cuda.empty_cache()
    return rows


def flashmla_calls(qn, qp, ckv, kpe, table, lens):
    """(bf16 call, FP8 call) of FlashMLA's dense decode, or (None, None) without it. The bf16 call reads a fused
    [pages, 64, 1, 576] copy of the caches; the FP8 call a per-tensor-scaled e4m3 copy of that (q too)."""
    try:
        import flash_mla as fm
        from mla_compile.kernels import flashmla as FMLA
    except ImportError:
        return None, None
    if not FMLA.available():
        return None, None
    kv = torch.cat((ckv, kpe), -1).unsqueeze(2)
    q = torch.cat((qn, qp), -1).unsqueeze(1)

    def bf16():
        return fm.flash_mla_with_kvcache(q, kv, table, lens, R, fm.get_mla_metadata()[0], softmax_scale=SCALE,
                                         causal=False, use_legacy=True)

    k_scale = kv.float().abs().amax() / 448
    q_scale = q.float().abs().amax() / 448
    kv8 = (kv.float() / k_scale).to(torch.float8_e4m3fn)
    q8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
    dq, dk = q_scale.reshape(1).float(), k_scale.reshape(1).float()
    meta = fm.get_mla_metadata()[0]
    meta.tile_scheduler_metadata, meta.num_splits = fm.get_mla_decoding_metadata(
        lens, q.shape[1] * q.shape[2], 1, is_fp8_kvcache=True, use_legacy=True)

    def fp8_call():
        return fm.flash_mla_with_kvcache(q8, kv8, table, lens, R, meta, softmax_scale=SCALE, causal=False,
                                         is_fp8_kvcache=True, use_legacy=True, descale_q=dq, descale_k=dk)

    return bf16, fp8_call


def main(argv):
    from unittest import mock

    from triton.testing import do_bench_cudagraph

    from mla_compile.kernels import decode as K
    from mla_compile.kernels import decode_fp8

    def ms(fn):
        return do_bench_cudagraph(fn, rep=50, return_mode="median")

    from bench_ops import copy_bandwidth  # the ops table's measure, so the bandwidth fractions compare

    copy_gbps = copy_bandwidth() / 1e9
    sweep = "--sweep" in argv
    if "--token-table" in argv:
        emit(dict(device=torch.cuda.get_device_name(), layout="page 1, token table", rows=token_table_rows(ms, K)),
             [a for a in argv if a != "--token-table"])
        return
    if "--whole-page" in argv:
        rows = whole_page_rows(ms, K)
        emit(dict(device=torch.cuda.get_device_name(), layout="one page per request", rows=rows),
             [a for a in argv if a != "--whole-page"])
        return
    argv = [a for a in argv if a != "--sweep"]
    cases = CASES
    if "--shapes" in argv:  # --shapes H:B:KV ...: these shapes instead of CASES
        i = argv.index("--shapes")
        shapes = [a for a in argv[i + 1:] if a.count(":") == 2]
        cases = [tuple(int(x) for x in a.split(":")) for a in shapes]
        argv = argv[:i] + argv[i + 1 + len(shapes):]
    scale_fmt = None
    if "--scale-fmt" in argv:  # --scale-fmt ue8m0: the FP8 cache written with power-of-two scales
        i = argv.index("--scale-fmt")
        scale_fmt = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for H, B, KV in cases:
        ckv, kpe, (c8, s8, k8), table, lens = caches(B, KV, gen, scale_fmt)
        qn = torch.randn(B, H, R, generator=gen, device="cuda").to(torch.bfloat16)
        qp = torch.randn(B, H, P, generator=gen, device="cuda").to(torch.bfloat16)

        def bf16_call():
            return torch.ops.mla.decode(qn, qp, ckv, kpe, table, lens, SCALE)

        def fp8_call():
            return torch.ops.mla.decode(qn, qp, c8, k8, table, lens, SCALE, s8)

        def fp8_triton_call(cfg=None):
            return K.decode(qn, qp, c8, k8, table, lens, SCALE, cfg=cfg, ckv_scale=s8)

        def fp8_rows(s):
            return fp8.dequantize(c8.reshape(-1, R)[s], s8.reshape(-1, 4)[s], torch.float64)

        row = dict(H=H, B=B, kv_len=KV, scale_fmt=scale_fmt)
        row["bf16_check"] = check_request0(*bf16_call(), qn, qp, lambda s: ckv.view(-1, R)[s].double(), kpe, table)
        row["fp8_check"] = check_request0(*fp8_call(), qn, qp, fp8_rows, k8, table)
        o8, o16 = fp8_call()[0].double(), bf16_call()[0].double()
        row["fp8_vs_bf16_max_row_rel_err"] = float(((o8 - o16).norm(dim=-1) / o16.norm(dim=-1)).max())
        row["bf16_ms"] = ms(bf16_call)
        row["fp8_ms"] = ms(fp8_call)
        row["fp8_triton_check"] = check_request0(*fp8_triton_call(), qn, qp, fp8_rows, k8, table)
        row["fp8_triton_ms"] = ms(fp8_triton_call)
        with mock.patch.object(decode_fp8, "fits", lambda *a: False):  # the register-dequantizing kernel
            K.fp8_config.cache_clear()  # at its own tiling (the config is cached per shape)
            row["fp8_dequant_check"] = check_request0(*fp8_triton_call(), qn, qp, fp8_rows, k8, table)
            row["fp8_dequant_ms"] = ms(fp8_triton_call)
        K.fp8_config.cache_clear()
        fm_bf16, fm_fp8 = flashmla_calls(qn, qp, ckv, kpe, table, lens)
        if fm_bf16 is not None:
            try:
                row["flashmla_bf16_ms"] = ms(fm_bf16)
                out, _ = fm_fp8()
                row["flashmla_fp8_vs_bf16_max_row_rel_err"] = float(
                    ((out.reshape(o16.shape).double() - o16).norm(dim=-1) / o16.norm(dim=-1)).max())
                row["flashmla_fp8_ms"] = ms(fm_fp8)
            except Exception as e:  # noqa: BLE001 - a peer's failure is reported, not fatal
                row["flashmla_error"] = repr(e)[:300]
        if fm_bf16 is not None and H in (64, 128):
            try:
                with tuning.use(tuning.Tuning(decode_kernel="flashmla")):
                    row["fp8_flashmla_check"] = check_request0(*fp8_call(), qn, qp, fp8_rows, k8, table)
                    row["fp8_flashmla_ms"] = ms(fp8_call)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                row["fp8_flashmla_error"] = repr(e)[:300]
        if sweep:
            row["fp8_configs_ms"] = {}
            for bh, bn, w, st in SWEEP:
                cfg = K.DecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st, max_splits=256)
                name = f"h{bh}n{bn}w{w}s{st}"
                try:
                    ok = check_request0(*fp8_triton_call(cfg), qn, qp, fp8_rows, k8, table)
                    row["fp8_configs_ms"][name] = ms(lambda: fp8_triton_call(cfg)) if ok == "ok" else ok
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: reported per config
                    row["fp8_configs_ms"][name] = repr(e)[:200]
        tokens = B * KV
        for key, per_token in (("bf16", 2 * (R + P)), ("fp8", fp8.token_bytes(R, P)),
                               ("fp8_triton", fp8.token_bytes(R, P)), ("fp8_dequant", fp8.token_bytes(R, P)), ("flashmla_bf16", 2 * (R + P)),
                               ("flashmla_fp8", R + P), ("fp8_flashmla", fp8.token_bytes(R, P))):
            if isinstance(row.get(f"{key}_ms"), float):
                row[f"{key}_gbps"] = tokens * per_token / row[f"{key}_ms"] / 1e6
                row[f"{key}_bw_frac"] = row[f"{key}_gbps"] / copy_gbps
        row["fp8_speedup"] = row["bf16_ms"] / row["fp8_ms"]
        for peer in ("flashmla_bf16", "flashmla_fp8"):
            if isinstance(row.get(f"{peer}_ms"), float):
                row[f"fp8_vs_{peer}"] = row[f"{peer}_ms"] / row["fp8_ms"]
                if isinstance(row.get("fp8_flashmla_ms"), float):
                    row[f"fp8_flashmla_vs_{peer}"] = row[f"{peer}_ms"] / row["fp8_flashmla_ms"]
        rows.append(row)
        row_done(row)
        del ckv, kpe, c8, s8, k8
        torch.cuda.empty_cache()
    doc = dict(device=torch.cuda.get_device_name(), copy_gbps=copy_gbps,
               token_bytes=dict(bf16=2 * (R + P), fp8=fp8.token_bytes(R, P)), rows=rows)
    emit(doc, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
