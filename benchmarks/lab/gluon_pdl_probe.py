"""Which swap-AB build an eager `mla.decode` at H 16 runs with MLA_COMPILE_GLUON_PDL=1, and whether it was compiled
with PDL: test_pdl_cuda.py's Gluon PDL case found no compiled swap-AB kernel in `_swapab_kernel.device_caches`
(H100, 2026-12-06) though the gather / TMA kernels of decode_wgmma had theirs. One GPU, seconds."""
import os

os.environ.setdefault("MLA_COMPILE_GLUON_PDL", "1")

import torch  # noqa: E402

import mla_compile  # noqa: E402,F401
from mla_compile import paged  # noqa: E402
from mla_compile.kernels import decode_swapab as S  # noqa: E402
from mla_compile.kernels import dispatch  # noqa: E402

g = torch.Generator().manual_seed(0)
for PS in (64, 1):
    ckv = [torch.randn(700, 512, generator=g).bfloat16().cuda() for _ in range(2)]
    kpe = [torch.randn(700, 64, generator=g).bfloat16().cuda() for _ in range(2)]
    b = paged.fill_paged(ckv, kpe, PS)
    qn, qp = torch.randn(2, 16, 512).bfloat16().cuda(), torch.randn(2, 16, 64).bfloat16().cuda()
    print("PS", PS, dispatch.decode_kernel(qn, qp, b.ckv_cache, b.kpe_cache, block_table=b.block_table))
    torch.ops.mla.decode(qn, qp, b.ckv_cache, b.kpe_cache, b.block_table, b.seq_lens, 0.05)
    torch.cuda.synchronize()
    for name in dir(S):
        fn = getattr(S, name)
        if hasattr(fn, "device_caches"):
            print(" ", name, type(fn).__name__, {d: (len(c), [type(x).__name__ for x in c][:5]) for d, c in
                                                 fn.device_caches.items()})
            for d, c in fn.device_caches.items():
                for k in c[0].values():
                    print("    compiled:", type(k).__name__, "launch_pdl", getattr(k.metadata, "launch_pdl", None))
            fl = fn.__dict__.get("_mla_fast_launch")
            print("    fast launch entries:", None if fl is None else len(fl._entries))
