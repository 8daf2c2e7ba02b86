"""The decode stage-1 and few-token linear kernels compiled for Hopper (sm_90a) without a GPU: Triton's
ahead-of-time compiler plus its bundled ptxas give the PTX and the register / spill counts of exactly what a launch
would build.

Development tooling, outside the package (nothing at run time imports it): used by tests/kernels/test_kernel_codegen.py
(CI guards on the default kernels) and `benchmarks/decode_sweep.py --aot` (prune tile configs before spending GPU
time). Import it with the repository root on sys.path: `from tools import aot`.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_compile.kernels import decode as D

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
_POINTERS = {"Qn": "*bf16", "Qp": "*bf16", "Ckv": "*bf16", "Kpe": "*bf16", "Table": "*i32", "Lens": "*i32",
             "O": "*fp32", "L": "*fp32"}
# what a real launch specialises as multiples of 16: aligned pointers and the cache / q / out strides (a table
# stride can be anything)
_DIVISIBLE = set(_POINTERS) | {"s_qnb", "s_qnh", "s_qpb", "s_qph", "s_cp", "s_cs", "s_kp", "s_ks", "s_on", "s_ob",
                               "s_oh"}


def available() -> bool:
    return os.path.exists(PTXAS)


def compile_sm90(kernel, constexprs: dict, descriptors: dict, num_warps: int, num_stages: int,
                 divisible: set | None = None, gluon: bool = False) -> dict:
    """`kernel` for sm_90a with a launch's constexprs (bf16 dot mode): {"ptx", "ttgir", "shared_bytes", "registers",
    "spill_bytes", "advisories" (ptxas' C75xx codes)}.
    `descriptors` gives argument types by name (default: the decode kernels' pointers, else i32); `divisible`
    the arguments a launch specialises as multiples of 16 (default: the decode kernels')."""
    divisible = _DIVISIBLE if divisible is None else divisible
    if not gluon:  # the Triton kernels' dot mode; Gluon kernels pick their MMAs themselves
        constexprs = dict(constexprs, DOT_PREC="tf32", DOT_UPCAST=False)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = descriptors.get(name) or _POINTERS.get(name) or ("fp32" if name == "scale_log2" else "i32")
        if name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    compiled = triton.compile(source(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                text=True, check=True).stderr
    return {"ptx": ptx, "ttgir": compiled.asm["ttgir"], "shared_bytes": compiled.metadata.shared,
            "registers": int(re.findall(r"Used (\d+) registers", report)[-1]),
            "spill_bytes": int(re.findall(r"(\d+) bytes spill stores", report)[-1]),
            # ptxas' warpgroup-MMA advisories, e.g. C7514 "wgmma.mma_async instructions are serialized" (every MMA of
            # the kernel waits for the one before: a "defer" seesaw variant measured 40% slower on the H200) or
            # C7517 "warpgroup.wait is injected" (one wait added where the code did not ask for it)
            "advisories": re.findall(r"\((C75\d\d)\)", report)}


def stage1_sm90(cfg: D.DecodeConfig, R: int = 512, P: int = 64, page_size: int = 64, sparse: bool = False,
                pdl: bool = False, merged: bool = False) -> dict:
    """The stage-1 kernel `decode` would launch for this config and cache layout (bf16, row-contiguous caches),
    compiled for sm_90a (`pdl`: as launched with programmatic dependent launch; `merged`: the pointer kernel's build
    that merges its own splits, `_stage1_merged_kernel`, at B 1's merge tiling); adds "kernel" ("tma" / "pointer")
    and "instructions" (PTX instruction count)."""
    tma = not sparse and D.tma_tiles_fit(cfg, page_size, R, P)
    if tma:
        desc = {"CkvDesc": f"tensordesc<bf16[{cfg.block_n}, {R // 2}]>", "KpeDesc": f"tensordesc<bf16[{cfg.block_n}, {P}]>"}
        out = compile_sm90(D._stage1_tma_kernel, dict(D.tma_constexprs(cfg, R, P, torch.bfloat16), PDL=pdl), desc,
                           cfg.num_warps, cfg.num_stages)
    elif merged:
        out = compile_sm90(D._stage1_merged_kernel, dict(D.pointer_constexprs(cfg, R, P, page_size, sparse,
                                                                              torch.bfloat16), PDL=pdl, MERGE_N=16,
                                                         MERGE_R=64, MERGE_ONE_PASS=True),
                           {"C": "*i32", "Out": "*bf16", "Lse": "*fp32"}, cfg.num_warps, cfg.num_stages)
    else:
        out = compile_sm90(D._stage1_kernel, dict(D.pointer_constexprs(cfg, R, P, page_size, sparse, torch.bfloat16),
                                                  PDL=pdl), {}, cfg.num_warps, cfg.num_stages)
    ops = collections.Counter(re.findall(r"^\s+(?:@!?%p\d+ )?([a-z]+[a-z0-9._:]*)", out["ptx"], re.M))
    return dict(out, kernel="tma" if tma else "pointer", instructions=sum(ops.values()))


GLUON_KERNELS = ("wgmma", "gather", "seesaw")


def wgmma_stage1_sm90(R: int = 512, P: int = 64, page_size: int = 64, dtype: str = "bf16", kernel: str = "wgmma",
                      sparse: bool = False, multi: bool = False, pdl: bool = False) -> dict:
    """A Gluon many-head stage-1 kernel compiled for sm_90a: `kernel` "wgmma" decode_wgmma.py's TMA kernel,
    "gather" its gather kernel (pages smaller than a tile; `sparse` index lists), "seesaw" the warp-specialised
    one (decode_seesaw.py); `multi`: the build for several query tokens per request (a limit per row); `pdl`: the
    build launched with programmatic dependent launch (not the seesaw's: _gluon.pdl_launch)."""
    from triton.experimental.gluon import language as gl

    from mla_compile.kernels import decode_seesaw as S
    from mla_compile.kernels import decode_wgmma as W

    if kernel not in GLUON_KERNELS:
        raise ValueError(f"kernel: expected one of {GLUON_KERNELS}, got {kernel!r}")
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    rows = S.TILE_N if kernel == "seesaw" else W.BLOCK_N  # the TMA boxes' tokens
    desc = {name: f"tensordesc<{dtype}[{rows}, {width}],{gl.NVMMASharedLayout.get_default_for([rows, width], gdt)!r}>"
            for name, width in (("CkvDesc", R // 2), ("KpeDesc", P))}
    desc.update({name: f"*{dtype}" for name in ("Qn", "Qp", "Ckv", "Kpe")})
    if kernel == "seesaw":  # 4 + 4 + 1 warps
        if pdl:
            raise ValueError("pdl: the seesaw kernel is warp-specialised and takes no PDL (kernels/_gluon.py)")
        return compile_sm90(S._stage1_seesaw_kernel, S.constexprs(R, P, page_size, multi), desc, S.NUM_WARPS, 1,
                            gluon=True)
    extra = {"PDL": pdl}  # a constexpr: left out, the compile would take it as a runtime argument
    if kernel == "gather":
        return compile_sm90(W._stage1_gather_kernel, {**W.gather_constexprs(R, P, page_size, sparse, multi), **extra},
                            desc, W.NUM_WARPS, 1, gluon=True)
    return compile_sm90(W._stage1_wgmma_kernel, {**W.constexprs(R, P, page_size, multi), **extra}, desc, W.NUM_WARPS,
                        1, gluon=True)


def linear_sm90(M: int, K: int, N: int, cfg=None, pdl: bool = False) -> dict:
    """The few-token linear kernel (kernels/linear.py) that `fused_linear` launches for x [M, K] and a weight
    pair of N rows in all (bf16, row-contiguous), compiled for sm_90a. Unit strides are constexprs, as Triton
    specialises them at launch."""
    from mla_compile.kernels import linear as Lin

    cfg = cfg or Lin.default_linear_config(M, K, N)
    ptrs = {"X": "*bf16", "W0": "*bf16", "W1": "*bf16"}
    out_ty = "*fp32" if cfg.split_k > 1 else "*bf16"
    ptrs.update(Y0=out_ty, Y1=out_ty)
    constexprs = dict(BLOCK_M=Lin.MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
                      s_xk=1, s_w0k=1, s_w1k=1, s_y0n=1, s_y1n=1, PDL=pdl)
    divisible = set(ptrs) | {"s_xm", "s_w0n", "s_w1n", "s_y0m", "s_y1m", "s_ys", "K", "k_split", "y0_at", "y1_at"}
    return compile_sm90(Lin._linear_kernel, constexprs, ptrs, cfg.num_warps, cfg.num_stages, divisible)


def per_head_linear_sm90(transposed: bool, block_n: int = 16, K: int = 512, pdl: bool = False) -> dict:
    """`mla::per_head_linear`'s kernel as launched for MLA's W_UV (weight rows K-contiguous) or, `transposed`, W_UK
    (a transposed view: N contiguous), bf16, compiled for sm_90a."""
    from mla_compile.kernels import linear as Lin

    ptrs = {"X": "*bf16", "W": "*bf16", "Y": "*bf16"}
    unit = {"s_xk": 1, "s_yn": 1, **({"s_wn": 1} if transposed else {"s_wk": 1})}
    block_k = min(128, K)
    constexprs = dict(BLOCK_M=Lin.MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0, PDL=pdl, **unit)
    divisible = set(ptrs) | {"s_xm", "s_xh", "s_wh", "s_wn", "s_wk", "s_ym", "s_yh", "K", "N"} - set(unit)
    return compile_sm90(Lin._per_head_kernel, constexprs, ptrs, 4, 3, divisible)



def swapab_sm90(tiling=None, H: int = 16, page_size: int = 64, dtype: str = "bf16", pdl: bool = False,
                merged: bool = False) -> dict:
    """kernels/decode_swapab.py's few-head stage-1 kernel over a bf16 / fp16 cache at `tiling` (default: the one `H`
    heads get), compiled for sm_90a (`compile_sm90`'s answer); `merged`: the build that merges its own splits
    (`_swapab_merged_kernel`, at B 1's merge tiling)."""
    from triton.experimental.gluon import language as gl

    from mla_compile.kernels import decode_swapab as S

    t = tiling or S.default_tiling(H)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    desc = {name: f"tensordesc<{dtype}[{S.BLOCK_T}, {width}],"
                  f"{gl.NVMMASharedLayout.get_default_for([S.BLOCK_T, width], gdt)!r}>"
            for name, width in (("CkvDesc", S.R // 2), ("KpeDesc", S.P))}
    desc.update({name: f"*{dtype}" for name in ("Qn", "Qp", "Ckv", "Kpe")})
    extra = {"PDL": pdl}  # a constexpr: left out, the compile would take it as a runtime argument
    if merged:
        desc.update(C="*i32", Out=f"*{dtype}", Lse="*fp32")
        extra.update(MERGE_N=16, MERGE_R=64, MERGE_ONE_PASS=True)
    return compile_sm90(S._swapab_merged_kernel if merged else S._swapab_kernel, {**t.constexprs(page_size), **extra},
                        desc, t.warps, 1, gluon=True)


def fp8_swapab_sm90(tiling=None, H: int = 16, page_size: int = 64, gather: bool = False,
                    tokens: bool = False, pdl: bool = False) -> dict:
    """kernels/decode_fp8_swapab.py's stage-1 kernel for an FP8 cache at `tiling` (default: the one `H` heads get),
    compiled for sm_90a (`compile_sm90`'s answer); `gather`: its GATHER form (cp.async row copies through the table,
    any page size: the three views as 16-byte aligned pointers, their strides in 16-byte units unspecialised, as
    656-byte tokens give them); `tokens`: its TOKENS form (page size 1: the TMA form's descriptors and GATHER's
    pointers, each tile either)."""
    from mla_compile.kernels import decode_fp8_swapab as F

    t = tiling or F.default_tiling(H)
    divisible = {"Qn", "Qp", "Table", "Lens", "O", "L", "s_qnb", "s_qnh", "s_qpb", "s_qph", "s_on", "s_ob", "s_oh"}
    if gather and not tokens:
        desc = {"EDesc": "*fp8e4nv", "SDesc": "*fp32", "RDesc": "*bf16", "Qn": "*bf16", "Qp": "*bf16"}
        divisible |= {"EDesc", "SDesc", "RDesc"}
    else:
        e_l, s_l, r_l = F._layouts()
        desc = {"EDesc": f"tensordesc<fp8e4nv[{F.BLOCK_T}, {F.E_BOX}],{e_l!r}>",
                "SDesc": f"tensordesc<fp32[{F.BLOCK_T}, {F.GROUPS}],{s_l!r}>",
                "RDesc": f"tensordesc<bf16[{F.BLOCK_T}, {F.P}],{r_l!r}>",
                "Qn": "*bf16", "Qp": "*bf16"}
    if tokens:
        desc.update(EPtr="*fp8e4nv", SPtr="*fp32", RPtr="*bf16")
        divisible |= {"EPtr", "SPtr", "RPtr"}
    extra = {"PDL": pdl}  # a constexpr: left out, the compile would take it as a runtime argument
    return compile_sm90(F._fp8_swapab_kernel, {**t.constexprs(page_size, gather, tokens), **extra}, desc, t.warps, 1,
                        divisible, gluon=True)
