"""DCP's per-rank step on one GPU: each rank's local `mla.decode` over its token-cyclic shard (what `mla.dcp_decode`
runs before its all-gather), with the kernel `auto` picks for the shard's layout, merged by `mla.merge_states`: the
float64 decode over the whole cache. Shards in pages of 64 (the swap-AB kernel's TMA form at H < 64, the seesaw
kernel at 128 heads) and as page-size-1 token tables, a request's local tokens consecutive rows (the swap-AB TOKENS
form's TMA boxes) or shuffled rows (its row copies; the Gluon gather kernel at 128 heads). The multi-GPU run of the
whole op: benchmarks/dcp_gpu.py. Skipped without a CUDA device."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

import mla_compile  # noqa: E402,F401  (registers the ops)
import reference as ref  # noqa: E402
from mla_compile import layout, paged  # noqa: E402
from mla_compile.kernels import dispatch  # noqa: E402
from mla_compile.ops import dcp  # noqa: E402
from test_kernels_cuda import assert_attention  # noqa: E402

DT = torch.bfloat16
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
LAYOUTS = {"pages64": (64, True), "tokens_runs": (1, False), "tokens_shuffled": (1, True)}  # page size, shuffled


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("H", [16, 40, 128])
def test_rank_local_decodes_merge_to_full_decode(H, n, layout_name):
    PS, shuffle = LAYOUTS[layout_name]
    lens = [0, 1, n - 1, n + 1, 700, 64 * n + 3, 2000]
    g = torch.Generator().manual_seed(H * 10 + n)
    ckv = [torch.randn(L, 512, generator=g).to(DT).cuda() for L in lens]
    kpe = [torch.randn(L, 64, generator=g).to(DT).cuda() for L in lens]
    q = torch.randn(len(lens), H, 512, generator=g).to(DT).cuda()
    qp = torch.randn(len(lens), H, 64, generator=g).to(DT).cuda()
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    full = paged.fill_paged([c.cpu() for c in ckv], [k.cpu() for k in kpe], 64, generator=g)
    ref_o, ref_l = ref.ref_decode(q.cpu(), qp.cpu(), full.ckv_cache, full.kpe_cache, full.block_table,
                                  seq.cpu(), 0.07)
    outs, lses, kernels = [], [], set()
    for r in range(n):
        sh = paged.fill_sharded(ckv, kpe, PS, n, r, shuffle=shuffle, spare_pages=2,
                                generator=torch.Generator().manual_seed(r))
        local = layout.local_lens(seq, n, r)
        kernels.add(dispatch.decode_kernel(q, qp, sh.ckv_cache, sh.kpe_cache, block_table=sh.block_table).name)
        o, l = torch.ops.mla.decode(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, local, 0.07)
        o, l = dcp.unpack_states(dcp.pack_states(o, l), 512)  # what goes on the wire
        outs.append(o)
        lses.append(l)
    out, lse = torch.ops.mla.merge_states(torch.stack(outs), torch.stack(lses))
    assert_attention(out, lse, ref_o, ref_l, DT)
    if SM90:  # the kernels auto takes for a shard (the same as for any cache of that layout)
        want = ("swapab" if H < 64 else "seesaw" if PS == 64 else "wgmma")
        assert kernels == {want}, kernels
