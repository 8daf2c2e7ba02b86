"""Which scale does FlashMLA's V3.2 sparse FP8 kernel apply? Our cache (amax / 448 float32 scales) through it, its
lse against float64 references whose dequantization uses the scale as stored, its exponent alone (mantissa dropped:
2^floor(log2 s)), and bf16(s). One GPU, a few seconds. Question behind it: the GPU test over amax / 448 scales
missed the bf16-rounding reference by 0.07 in lse (H100, 2026-12-06)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import reference as ref  # noqa: E402
from mla_compile import fp8  # noqa: E402
from mla_compile.kernels import flashmla_fp8 as FM8  # noqa: E402

DEV, R, P, PS, SCALE = "cuda", 512, 64, 64, 0.07
g = torch.Generator().manual_seed(0)
_, c, s, k = fp8.allocate(8, PS, R, P, device=DEV)
n = 8 * PS
x = torch.randn(n, R, generator=g) * torch.rand(n, 1, generator=g) * 4
torch.ops.mla.cache_write_fp8(c, k, s, x.to(DEV), torch.randn(n, P, generator=g).to(DEV, torch.bfloat16),
                              torch.arange(n, device=DEV))
B, H, K = 4, 64, 256
idx = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(B)]).int().to(DEV)
qn = torch.randn(B, H, R, generator=g).to(DEV, torch.bfloat16)
qp = torch.randn(B, H, P, generator=g).to(DEV, torch.bfloat16)
out, lse = FM8.sparse_decode(qn, qp, c, k, idx, s, SCALE)
sc = s.cpu().double()
for name, scale in (("as stored", sc), ("exponent only", torch.exp2(torch.floor(torch.log2(sc)))),
                    ("next power up", torch.exp2(torch.ceil(torch.log2(sc)))), ("bf16(s)", sc.bfloat16().double())):
    lat = ref.ref_dequantize_fp8(c.cpu(), scale.float()).double()
    w_out, w_lse = ref.ref_sparse_decode(qn.cpu().double(), qp.cpu().double(), lat, k.cpu().double(), idx.cpu(), SCALE)
    err = (lse.cpu().double() - w_lse).abs().max().item()
    oerr = ((out.cpu().double() - w_out).norm() / w_out.norm()).item()
    print(f"{name:14s} lse max err {err:.2e}  out rel err {oerr:.2e}")
