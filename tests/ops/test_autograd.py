"""Autograd formulas of `mla::decode`, `mla::sparse_decode` and `mla::merge_states`.

gradcheck in float64 (numerical vs analytical Jacobians of the ops themselves) on paged caches with shuffled
block tables, empty rows, -1 / repeated indices and non-finite partial states; gradients that must be exactly
zero (unused slots, empty rows) even when unused slots hold NaN; low-precision backward against float64; and
a compiled HF DeepseekV3 decode step with grad enabled (attention rewritten into mla.decode) against eager HF.
"""

from __future__ import annotations

import pytest
import torch

import mla_compile  # noqa: F401
import reference as ref

F64 = torch.float64


def finite_lse(fn):
    """(out, lse) with lse's -inf rows (empty) set to 0: a constant -inf has no finite difference."""
    def wrapped(*args):
        out, lse = fn(*args)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)
    return wrapped


def paged(lens, PS, R, P, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    _, (c, k), bt, sl, _ = ref.build_paged(lens, PS, (R, P), dtype, generator=g, shuffle=True, extra_cols=1)
    return g, c, k, bt, sl


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


# (page_size, H, R, P, lens): unused slots hold NaN, block tables are shuffled with garbage past each row's pages
DECODE_SHAPES = [(1, 2, 5, 3, [3, 0]), (3, 2, 4, 2, [7, 1, 0, 4]), (4, 1, 6, 2, [0, 0])]


@pytest.mark.parametrize("transposed_q", [False, True])
@pytest.mark.parametrize("PS,H,R,P,lens", DECODE_SHAPES)
def test_gradcheck_decode(PS, H, R, P, lens, transposed_q):
    g, c, k, bt, sl = paged(lens, PS, R, P)
    B = len(lens)
    qn = torch.randn(H, B, R, generator=g, dtype=F64).transpose(0, 1) if transposed_q else \
        torch.randn(B, H, R, generator=g, dtype=F64)
    qp = torch.randn(B, H, P, generator=g, dtype=F64)
    fn = finite_lse(lambda a, b, x, y: torch.ops.mla.decode(a, b, x, y, bt, sl, 0.7))
    assert torch.autograd.gradcheck(fn, leaves(qn, qp, c, k))


@pytest.mark.parametrize("PS,H,R,P", [(1, 2, 5, 3), (3, 3, 4, 2)])
def test_gradcheck_sparse_decode(PS, H, R, P):
    g, c, k, bt, sl = paged([6, 2, 0], PS, R, P, seed=1)
    s0, s1 = ref.request_slots(bt, PS, 0, 6), ref.request_slots(bt, PS, 1, 2)
    # out of order, -1 first, a slot listed twice (attended twice: both entries' gradients land in it)
    idx = torch.tensor([[-1, s0[4], s0[1], s0[1], s0[0]], [s1[1], -1, s1[0], -1, -1], [-1] * 5], dtype=torch.int32)
    qn, qp = torch.randn(3, H, R, generator=g, dtype=F64), torch.randn(3, H, P, generator=g, dtype=F64)
    fn = finite_lse(lambda a, b, x, y: torch.ops.mla.sparse_decode(a, b, x, y, idx, 0.4))
    assert torch.autograd.gradcheck(fn, leaves(qn, qp, c, k))


@pytest.mark.parametrize("N,B,H,R", [(1, 2, 1, 3), (3, 2, 2, 4)])
def test_gradcheck_merge_states(N, B, H, R):
    g = torch.Generator().manual_seed(N)
    outs = torch.randn(N, B, H, R, generator=g, dtype=F64)
    lses = torch.randn(N, B, H, generator=g, dtype=F64) * 3
    lses[0, 0, 0] = float("-inf")  # an empty part
    if N > 1:
        lses[1, 1, 0] = float("nan")  # a foreign kernel's empty row: weighs 0 whatever its out holds
        outs[1, 1, 0] = 1e30
        lses[:, 0, 1] = float("-inf")  # every part empty: (0, -inf)
    fn = finite_lse(torch.ops.mla.merge_states)
    assert torch.autograd.gradcheck(fn, leaves(outs, lses))


def test_float64_forward_matches_the_reference():
    """float64 (new for these ops: gradcheck's precision) computes in float64 and returns a float64 lse."""
    g, c, k, bt, sl = paged([5, 0, 3], 2, 6, 3, seed=8)
    qn, qp = torch.randn(3, 2, 6, generator=g, dtype=F64), torch.randn(3, 2, 3, generator=g, dtype=F64)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, 0.6)
    r_out, r_lse = ref.ref_decode(qn, qp, c, k, bt, sl, 0.6)
    assert out.dtype == lse.dtype == F64
    torch.testing.assert_close(out, r_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, r_lse, rtol=1e-12, atol=1e-12)
    idx = torch.tensor([[-1] + ref.request_slots(bt, 2, 0, 5)[::-1], [-1] * 6, ref.request_slots(bt, 2, 2, 3) * 2],
                       dtype=torch.int32)
    out, lse = torch.ops.mla.sparse_decode(qn, qp, c, k, idx, 0.6)
    r_out, r_lse = ref.ref_sparse_decode(qn, qp, c, k, idx, 0.6)
    torch.testing.assert_close(out, r_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, r_lse, rtol=1e-12, atol=1e-12)
    outs, lses = torch.randn(3, 2, 2, 4, generator=g, dtype=F64), torch.randn(3, 2, 2, generator=g, dtype=F64)
    lses[1, 0, 0] = float("-inf")
    for a, b in zip(torch.ops.mla.merge_states(outs, lses), ref.ref_merge(outs, lses)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_merge_states_gradient_matches_the_reference_definition():
    """The merge as an explicit logsumexp / softmax over parts (torch autograd through the float64 definition)."""
    g = torch.Generator().manual_seed(5)
    outs, lses = leaves(torch.randn(4, 2, 3, 6, generator=g, dtype=F64), torch.randn(4, 2, 3, generator=g, dtype=F64))
    w_out, w_lse = torch.randn(2, 3, 6, generator=g, dtype=F64), torch.randn(2, 3, generator=g, dtype=F64)
    out, lse = torch.ops.mla.merge_states(outs, lses)
    got = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (outs, lses))
    r_lse = torch.logsumexp(lses, dim=0)
    r_out = (torch.softmax(lses, dim=0)[..., None] * outs).sum(0)
    want = torch.autograd.grad((r_out * w_out).sum() + (r_lse * w_lse).sum(), (outs, lses))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def decode_grads(q_nope, q_pe, c, k, bt, sl, scale, w_out, w_lse):
    qn, qp, c, k = leaves(q_nope, q_pe, c, k)
    out, lse = torch.ops.mla.decode(qn, qp, c, k, bt, sl, scale)
    loss = (out.float() * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w_lse).sum()
    return torch.autograd.grad(loss, (qn, qp, c, k))


def test_decode_gradients_vanish_where_nothing_is_attended():
    """Unused slots (NaN there), and every input of an empty row, get exactly 0; nothing non-finite leaks."""
    g, c, k, bt, sl = paged([5, 0, 2], 2, 4, 3, dtype=torch.float32, seed=2)
    qn, qp = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 3, generator=g)
    w_out, w_lse = torch.randn(3, 2, 4, generator=g), torch.ones(3, 2)
    d_qn, d_qp, d_c, d_k = decode_grads(qn, qp, c, k, bt, sl, 0.5, w_out, w_lse)
    for d in (d_qn, d_qp, d_c, d_k):
        assert torch.isfinite(d).all()
    assert (d_qn[1] == 0).all() and (d_qp[1] == 0).all()
    used = torch.zeros(c.shape[0] * c.shape[1], dtype=torch.bool)
    for b in range(3):
        used[ref.request_slots(bt, 2, b, int(sl[b]))] = True
    assert (d_c.reshape(-1, 4)[~used] == 0).all() and (d_k.reshape(-1, 3)[~used] == 0).all()
    assert (d_c.reshape(-1, 4)[used] != 0).any(dim=-1).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_decode_gradients_match_float64(dtype, tol):
    g, c, k, bt, sl = paged([9, 3], 4, 16, 8, dtype=F64, seed=3)
    qn, qp = torch.randn(2, 4, 16, generator=g, dtype=F64), torch.randn(2, 4, 8, generator=g, dtype=F64)
    w_out, w_lse = torch.randn(2, 4, 16, generator=g, dtype=F64), torch.randn(2, 4, generator=g, dtype=F64)
    low = [t.to(dtype) for t in (qn, qp, c, k)]
    # the float64 run sees the same (rounded) inputs, so only the op's own precision is measured
    want = decode_grads(*[t.to(F64) for t in low], bt, sl, 0.25, w_out, w_lse)
    got = decode_grads(*low, bt, sl, 0.25, w_out.float(), w_lse.float())
    for a, b in zip(got, want):
        assert a.dtype == dtype
        assert ref.rel_err(a.double().nan_to_num(), b.nan_to_num()) < tol


def test_compiled_ops_with_grad_match_eager():
    """decode + sparse_decode merged by merge_states under torch.compile (Inductor traces the backward formulas)."""
    g, c, k, bt, sl = paged([6, 0, 3], 2, 8, 4, dtype=torch.float32, seed=4)
    c, k = torch.nan_to_num(c), torch.nan_to_num(k)
    idx = torch.tensor([ref.request_slots(bt, 2, 0, 4), [-1] * 4, ref.request_slots(bt, 2, 2, 3) + [-1]],
                       dtype=torch.int32)
    qn, qp = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 4, generator=g)

    def step(qn, qp, c, k):
        o1, l1 = torch.ops.mla.decode(qn, qp, c, k, bt, sl, 0.3)
        o2, l2 = torch.ops.mla.sparse_decode(qn * 2, qp, c, k, idx, 0.3)
        out, lse = torch.ops.mla.merge_states(torch.stack([o1, o2]), torch.stack([l1, l2]))
        return out.pow(2).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    def grads(fn):
        ts = leaves(qn, qp, c, k)
        return torch.autograd.grad(fn(*ts), ts)

    torch._dynamo.reset()
    for a, b in zip(grads(torch.compile(step, fullgraph=True)), grads(step)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_hf_decode_step_with_grad_matches_eager():
    """HF DeepseekV3 decode step under backend="mla_dcp" with grad enabled: attention is rewritten into
    mla.decode and every parameter's gradient matches eager HF.

    DynamicCache: its update is a torch.cat, not an in-place write. With StaticCache the Inductor backward
    (any backend on Inductor, plain "inductor" too, torch 2.13) recomputes the cache position from the
    `cumulative_length` buffer AFTER the forward's in-place `add_` (the min-cut partitioner saves the mutated
    input): the new token's latent gets no gradient (pytorch/pytorch#197039, open)."""
    pytest.importorskip("transformers")
    import hf_models as M
    from transformers import DynamicCache

    from mla_compile.integrations.hf import cache_kwargs

    model = M.deepseek_v3(num_layers=1, seed=3)
    ids, mask = M.batch(L=8)
    T = ids.shape[1]

    def step_grads(step):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, attention_mask=mask[:, :T], **cache_kwargs(model, cache), cache_position=torch.arange(T))
        model.zero_grad()
        out = step(ids[:, -1:], attention_mask=mask[:, :T + 1], **cache_kwargs(step, cache),
                   cache_position=torch.tensor([T]))
        out.logits.pow(2).mean().backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_logits, want = step_grads(model)
    got_logits, got = step_grads(torch.compile(model, backend="mla_dcp", fullgraph=True))
    assert torch._dynamo.utils.counters["mla_compile"]["mla_attention_rewritten"] == 1
    assert M.rel_err(got_logits, want_logits) < 1e-4
    assert got.keys() == want.keys()
    for name in want:
        assert M.rel_err(got[name], want[name]) < 1e-4, name
