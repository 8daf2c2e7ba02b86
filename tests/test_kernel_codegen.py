"""What the default decode kernels compile to on Hopper, checked on a CPU machine: Triton compiles for sm_90a
ahead of time (no GPU needed) and its bundled ptxas reports registers and spills.

These guard the properties the H200 sweeps showed the speed depends on (RESULTS.md, sweep rounds 6-9):
the pointer kernel's cache loads must be 16-byte async copies (a runtime R/P once left 2-byte loads and cost
~10%), nothing spills, and the H=128 TMA kernel runs Hopper's warpgroup MMA on TMA-loaded tiles.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mla_compile.kernels import decode as D  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton's bundled ptxas is missing")

R, P = 512, 64
POINTERS = {"Qn": "*bf16", "Qp": "*bf16", "Ckv": "*bf16", "Kpe": "*bf16", "Table": "*i32", "Lens": "*i32",
            "Idx": "*i32", "O": "*fp32", "L": "*fp32"}
# what a real launch specialises as multiples of 16: aligned pointers and the cache / q / out strides
DIVISIBLE = set(POINTERS) | {"s_qnb", "s_qnh", "s_qpb", "s_qph", "s_cp", "s_cs", "s_kp", "s_ks", "s_on", "s_ob", "s_oh"}


def compile_sm90(kernel, constexprs: dict, descriptors: dict, cfg: D.DecodeConfig) -> dict:
    """PTX of `kernel` for sm_90a with the launch's constexprs, plus ptxas's register/spill report."""
    constexprs = dict(constexprs, DOT_PREC="tf32", DOT_UPCAST=False)  # the GPU's dot mode for bf16
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = descriptors.get(name) or POINTERS.get(name) or ("fp32" if name == "scale_log2" else "i32")
            if name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                text=True, check=True).stderr
    return {"ptx": ptx, "registers": int(re.findall(r"Used (\d+) registers", report)[-1]),
            "spill_bytes": int(re.findall(r"(\d+) bytes spill stores", report)[-1])}


@pytest.mark.parametrize("page_size", [1, 64])
def test_few_heads_pointer_kernel_streams_the_cache_in_16_byte_async_copies(page_size):
    cfg = D.default_config(16, R, page_size)
    assert not cfg.tma
    out = compile_sm90(D._stage1_kernel, D.pointer_constexprs(cfg, R, P, page_size, False, torch.bfloat16), {}, cfg)
    ptx = out["ptx"]
    assert re.search(r"cp\.async\.cg\.shared\.global[^;]*, 0x10,", ptx), "cache tiles are not 16-byte async copies"
    assert not re.search(r"ld\.global(\.[a-z:0-9]+)*\.[bu]16 ", ptx), "2-byte global loads in the tile loop"
    assert "mma.sync" in ptx
    assert out["spill_bytes"] == 0, out["registers"]


def test_many_heads_tma_kernel_feeds_warpgroup_mma():
    cfg = D.default_config(128, R, 64)
    assert cfg.tma
    descriptors = {"CkvDesc": f"tensordesc<bf16[{cfg.block_n}, {R // 2}]>", "KpeDesc": f"tensordesc<bf16[{cfg.block_n}, {P}]>"}
    out = compile_sm90(D._stage1_tma_kernel, D.tma_constexprs(cfg, R, P, torch.bfloat16), descriptors, cfg)
    assert "cp.async.bulk.tensor" in out["ptx"], "full tiles are not TMA copies"
    assert "wgmma.mma_async" in out["ptx"], "no warpgroup MMA"
    assert out["spill_bytes"] <= 1024, out  # ptxas' offline count; the H200 reports 0 spills for this config
