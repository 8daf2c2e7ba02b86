"""Programmatic dependent launch (on by default for sm_90+; MLA_COMPILE_PDL, kernels/_util.py): each of our kernels may be scheduled
while the kernel before it on the stream drains, and waits for it before touching memory. A missing or late wait
is a race, not an error: these tests capture chains where every op reads what the kernel right before it wrote
(and overwrites buffers the one before read), replay them with new inputs many times, and check every replay
against float64 references. Skipped without an sm_90+ GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="needs an sm_90+ CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

import mla_compile  # noqa: E402,F401  (registers the ops)
import reference as ref  # noqa: E402
from gpu_util import capture, rel as _rel  # noqa: E402
from mla_compile import paged  # noqa: E402

REPLAYS = 20


@pytest.fixture(autouse=True)
def _pdl(monkeypatch):
    monkeypatch.setenv("MLA_COMPILE_PDL", "1")
    monkeypatch.delenv("MLA_COMPILE_DECODE_BACKEND", raising=False)  # auto: our kernels for these separate caches


def _compiled_with_pdl(kernel) -> list[bool]:
    return [k.metadata.launch_pdl for cache in kernel.device_caches.values() for k in cache[0].values()]


def test_our_launches_carry_pdl_unless_turned_off(monkeypatch):
    from mla_compile.kernels import _util, linear

    monkeypatch.delenv("MLA_COMPILE_PDL")  # the default ("auto"): on for sm_90+
    assert _util.pdl_launch(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    torch.ops.mla.fused_linear(x, [torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)])
    assert True in _compiled_with_pdl(linear._linear_kernel)
    monkeypatch.setenv("MLA_COMPILE_PDL", "0")
    assert _util.pdl_launch(torch.device("cuda")) == {}


def test_weights_rewritten_by_the_kernel_right_before_are_read_fresh():
    """Weights are inputs like any other: rewritten in place by the kernel right before (and between replays),
    the few-token kernels must read them as they are now (no read of a weight before the PDL wait)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(1024, 2048, device="cuda", generator=g).to(torch.bfloat16)
    wh = torch.randn(16, 512, 128, device="cuda", generator=g).to(torch.bfloat16)
    xh = torch.randn(8, 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    scale = torch.ones((), device="cuda")

    def chain():
        w.mul_(scale.to(w.dtype))  # the kernel right before rewrites the weight
        (y,) = torch.ops.mla.fused_linear(x, [w])
        wh.mul_(scale.to(wh.dtype))
        return y, torch.ops.mla.per_head_linear(xh, wh)

    graph, (y, yh) = capture(chain)
    for i in range(REPLAYS):
        w.copy_(torch.randn(w.shape, device="cuda", generator=g))
        wh.copy_(torch.randn(wh.shape, device="cuda", generator=g))
        scale.fill_(1.0 + 0.5 * (i % 2))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(y, x.double() @ w.double().T) < 1e-2, f"replay {i}"
        assert _rel(yh, torch.einsum("bhk,hnk->bhn", xh.double(), wh.double())) < 1e-2, f"replay {i}"


def test_linear_chain_each_op_reads_the_previous_kernels_output():
    """x -> (torch) scale -> fused_linear -> linear_partials (split K) -> (torch) sum -> fused_linear: every
    kernel of ours starts right behind the one that produced its input."""
    g = torch.Generator(device="cuda").manual_seed(0)
    K, N1, N2 = 2048, 4096, 1024
    x = torch.randn(8, K, device="cuda", generator=g).to(torch.bfloat16)
    w1 = (torch.randn(N1, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(N2, N1, device="cuda", generator=g) * N1 ** -0.5).to(torch.bfloat16)
    w3 = (torch.randn(512, N2, device="cuda", generator=g) * N2 ** -0.5).to(torch.bfloat16)
    scale = torch.ones((), device="cuda")

    def chain():
        (h1,) = torch.ops.mla.fused_linear(x * scale.to(x.dtype), [w1])
        h2 = torch.ops.mla.linear_partials(h1, [w2], 4).sum(0).to(torch.bfloat16)
        (h3,) = torch.ops.mla.fused_linear(h2, [w3])
        return h1, h2, h3

    graph, (h1, h2, h3) = capture(chain)
    for i in range(REPLAYS):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        scale.fill_(1.0 + 0.25 * (i % 3))
        graph.replay()
        torch.cuda.synchronize()
        xs = (x * scale.to(x.dtype)).double()
        assert _rel(h1, xs @ w1.double().T) < 1e-2
        assert _rel(h2, h1.double() @ w2.double().T) < 1e-2, f"replay {i}: split-K partials read a stale input"
        assert _rel(h3, h2.double() @ w3.double().T) < 1e-2, f"replay {i}"


@pytest.mark.parametrize("H,PS", [(16, 1), (16, 64), (128, 64)])
def test_decode_right_after_the_q_producer_and_the_cache_write(H, PS):
    """`cache_write` of each request's newest token, then the kernel that makes q, then stage 1 -> merge -> a torch
    consumer; lengths, q and the new token change between replays. The reference reads the cache as the replay
    left it: a stage 1 that ran ahead of the write would have seen the old row."""
    _decode_chain(H, PS)


@pytest.mark.parametrize("H,PS,backend,kernel", [(16, 64, "auto", "swapab"), (16, 1, "swapab", "swapab"),
                                                 (64, 1, "auto", "gather"), (64, 64, "wgmma", "wgmma")])
def test_gluon_decode_with_pdl_right_after_the_q_producer_and_the_cache_write(H, PS, backend, kernel, monkeypatch):
    """The same chain with the Gluon stage-1 kernels launched with PDL (their default; MLA_COMPILE_GLUON_PDL=0 is off):
    the swap-AB kernel over pages and over a token table (its TOKENS form), decode_wgmma's gather and TMA kernels."""
    from mla_compile import tuning
    from mla_compile.kernels import decode_swapab, decode_wgmma

    monkeypatch.delenv(tuning.GLUON_PDL_ENV, raising=False)
    monkeypatch.delenv(tuning.PDL_ENV, raising=False)
    monkeypatch.setenv(tuning.DECODE_KERNEL_ENV, backend)
    _decode_chain(H, PS)
    # the swap-AB build itself, not only the values: a "swapab" choice once ran the Triton kernels' plan unseen
    fn = {"swapab": decode_swapab._swapab_kernel, "gather": decode_wgmma._stage1_gather_kernel,
          "wgmma": decode_wgmma._stage1_wgmma_kernel}[kernel]
    assert True in _compiled_with_pdl(fn), f"{kernel} was not launched with PDL"


def _decode_chain(H, PS):
    g = torch.Generator().manual_seed(H + PS)
    full = [1500, 700, 2100, 64]
    R, P, B = 512, 64, len(full)
    ckv = [torch.randn(n, R, generator=g).to(torch.bfloat16).cuda() for n in full]
    kpe = [torch.randn(n, P, generator=g).to(torch.bfloat16).cuda() for n in full]
    b = paged.fill_paged(ckv, kpe, PS, shuffle=True, spare_pages=3, generator=torch.Generator().manual_seed(1))
    q_src = torch.randn(B, H, R + P, generator=g).to(torch.bfloat16).cuda()
    new_c = torch.zeros(B, R, dtype=torch.bfloat16, device="cuda")
    new_k = torch.zeros(B, P, dtype=torch.bfloat16, device="cuda")
    seq_lens = b.seq_lens.clone()
    slots = torch.zeros(B, dtype=torch.int64, device="cuda")

    def step():
        torch.ops.mla.cache_write(b.ckv_cache, b.kpe_cache, new_c, new_k, slots)
        q = q_src * 1.0  # the producer kernel right before stage 1
        out, lse = torch.ops.mla.decode(q[..., :R], q[..., R:], b.ckv_cache, b.kpe_cache, b.block_table, seq_lens,
                                        0.05)
        return out * 1.0, lse

    graph, (out, lse) = capture(step)
    for i in range(REPLAYS):
        n = [max(1, x - 37 * (i % 4)) for x in full]  # the token written is the last of each request
        pos = torch.tensor([x - 1 for x in n], device="cuda")
        slots.copy_(b.block_table.gather(1, (pos // PS)[:, None]).squeeze(1).long() * PS + pos % PS)
        seq_lens.copy_(torch.tensor(n, dtype=seq_lens.dtype))
        q_src.copy_(torch.randn(q_src.shape, generator=g).to(torch.bfloat16))
        new_c.copy_((torch.randn(new_c.shape, generator=g) * 4).to(torch.bfloat16))  # dominates the softmax
        new_k.copy_((torch.randn(new_k.shape, generator=g) * 4).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want_out, want_lse = ref.ref_decode(q_src[..., :R].cpu(), q_src[..., R:].cpu(), b.ckv_cache.cpu(),
                                            b.kpe_cache.cpu(), b.block_table.cpu(), seq_lens.cpu(), 0.05)
        assert _rel(out, want_out) < 2e-2, f"replay {i}: {_rel(out, want_out):.2e}"
        assert float((lse.cpu().double() - want_lse).abs().max()) < 0.2, f"replay {i}"
