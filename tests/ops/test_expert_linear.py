"""`mla::expert_linear` (ops/experts.py) on the CPU: opcheck, bad inputs, gradients, a hypothesis fuzz against a
float64 per-pair loop, and its Triton kernel (kernels/experts.py) under TRITON_INTERPRET=1 in a child process
(this file run as a script: TRITON_INTERPRET must be set before triton is imported)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mla_compile.ops.experts  # noqa: F401  (registers mla::expert_linear)

HERE = os.path.dirname(os.path.abspath(__file__))

op = torch.ops.mla.expert_linear.default


def expert_linear_ref(x, weight, expert_ids) -> torch.Tensor:
    """float64 [S, O]: one matrix-vector product per pair with its expert's weight (negative ids from the end)."""
    E = weight.shape[0]
    rows = [weight[e % E].double() @ x[s].double() for s, e in enumerate(expert_ids.tolist())]
    return torch.stack(rows) if rows else torch.zeros((0, weight.shape[1]), dtype=torch.float64)


def make_args(S, E, O, I, dtype=torch.float32, transposed=False, id_dtype=torch.int64, negative=True, seed=0):
    """x [S, I], weight [E, O, I] (transposed: a [E, I, O] tensor viewed as [E, O, I], HF's `is_transposed`
    layout), ids in [-E, E) (negative) or [0, E)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, I, generator=g).to(dtype)
    w = (torch.randn(E, I, O, generator=g).to(dtype).transpose(1, 2) if transposed
         else torch.randn(E, O, I, generator=g).to(dtype))
    ids = torch.randint(-E if negative else 0, E, (S,), generator=g).to(id_dtype)
    return x, w, ids


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}

# (S, E, O, I, transposed, id dtype): decode-like, HF's transposed layout, int32 ids, one expert, no pairs,
# empty contraction, no output rows
SHAPES = [(6, 4, 24, 16, False, torch.int64), (5, 3, 7, 13, True, torch.int64), (4, 2, 8, 8, False, torch.int32),
          (3, 1, 5, 9, False, torch.int64), (0, 3, 4, 8, False, torch.int64), (3, 2, 4, 0, False, torch.int64),
          (2, 2, 0, 4, True, torch.int64)]


@pytest.mark.parametrize("S,E,O,I,transposed,id_dtype", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(S, E, O, I, transposed, id_dtype, dtype):
    x, w, ids = make_args(S, E, O, I, dtype, transposed, id_dtype)
    torch.library.opcheck(op, (x, w, ids))
    torch.library.opcheck(op, (x.requires_grad_(), w.requires_grad_(), ids))


@pytest.mark.parametrize("S,E,O,I,transposed,id_dtype", SHAPES)
def test_matches_float64_loop(S, E, O, I, transposed, id_dtype):
    x, w, ids = make_args(S, E, O, I, torch.float64, transposed, id_dtype)
    y = op(x, w, ids)
    assert y.shape == (S, O) and y.dtype == torch.float64 and y.is_contiguous()
    torch.testing.assert_close(y, expert_linear_ref(x, w, ids), rtol=1e-12, atol=1e-12)


def test_equals_hf_gather_then_bmm():
    # what passes/expert_gather.py replaces: HF's batched_mm form, for both weight layouts
    x, w, ids = make_args(10, 4, 12, 20, torch.float64)
    torch.testing.assert_close(op(x, w, ids), torch.bmm(w[ids], x[:, :, None])[:, :, 0], rtol=1e-12, atol=1e-12)
    wt = w.transpose(1, 2).contiguous()  # [E, I, O]
    torch.testing.assert_close(op(x, wt.transpose(1, 2), ids), torch.bmm(x[:, None, :], wt[ids])[:, 0, :],
                               rtol=1e-12, atol=1e-12)


def test_cuda_float64_definition_matches():
    # the CUDA impl's float64 path (HF's gather + bmm, no host sync), checked here where it can run
    from mla_compile.ops.experts import _gathered

    x, w, ids = make_args(9, 4, 6, 10, torch.float64, transposed=True)
    torch.testing.assert_close(_gathered(x, w, ids), expert_linear_ref(x, w, ids), rtol=1e-12, atol=1e-12)


def test_gradients():
    x, w, ids = make_args(7, 3, 5, 6, torch.float64, transposed=True)
    torch.autograd.gradcheck(lambda a, b: op(a, b, ids), (x.requires_grad_(), w.requires_grad_()))


@given(S=st.integers(0, 12), E=st.integers(1, 5), O=st.integers(1, 20), I=st.integers(0, 40),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       transposed=st.booleans(), id_dtype=st.sampled_from([torch.int64, torch.int32]), seed=st.integers(0, 2**31 - 1))
def test_fuzz_against_float64(S, E, O, I, dtype, transposed, id_dtype, seed):
    x, w, ids = make_args(S, E, O, I, dtype, transposed, id_dtype, seed=seed)
    y = op(x, w, ids)
    assert y.shape == (S, O) and y.dtype == dtype
    want = expert_linear_ref(x, w, ids)
    if want.numel() and want.norm() > 0:
        # each output against the size of its products (|x| . |w|): a dot product's rounding scales with its terms,
        # not with a result that cancels (S=1 O=1 I=19 fp32 came out 1.02e-5 off relative to the result)
        scale = expert_linear_ref(x.double().abs(), w.double().abs(), ids).clamp_min(1e-30)
        err = float(((y.double() - want.double()).abs() / scale).max())
        assert err < TOL[dtype], f"err {err:.2e} of |x| . |w|"
    else:
        assert not y.any()


def _bad(name):
    x, w, ids = make_args(4, 3, 5, 6)
    return {
        "x_rank": ((x[None], w, ids), "x"),
        "x_int": ((x.long(), w.long(), ids), "x"),
        "weight_rank": ((x, w[0], ids), "weight"),
        "weight_dtype": ((x, w.double(), ids), "weight"),
        "weight_in_features": ((x, w[:, :, :5], ids), "weight"),
        "ids_float": ((x, w, ids.float()), "expert_ids"),
        "ids_rank": ((x, w, ids[None]), "expert_ids"),
        "ids_length": ((x, w, ids[:3]), "expert_ids"),
        "ids_too_big": ((x, w, torch.tensor([0, 1, 3, 2])), "expert_ids"),
        "ids_too_negative": ((x, w, torch.tensor([0, -4, 1, 2])), "expert_ids"),
        "device": ((x, w.to("meta"), ids), "weight"),
    }[name]


@pytest.mark.parametrize("case", ["x_rank", "x_int", "weight_rank", "weight_dtype", "weight_in_features", "ids_float",
                                  "ids_rank", "ids_length", "ids_too_big", "ids_too_negative", "device"])
def test_bad_inputs_name_the_argument(case):
    args, name = _bad(case)
    with pytest.raises(ValueError, match=f"^{name}: "):
        op(*args)


def test_fake_impl_checks_metadata_not_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, _ = make_args(4, 3, 5, 6)
    with FakeTensorMode() as mode:
        fx_, fw = mode.from_tensor(x), mode.from_tensor(w)
        out = op(fx_, fw, mode.from_tensor(torch.tensor([0, 1, 7, 2])))  # values unknown at trace time
        assert out.shape == (4, 5)
        with pytest.raises(ValueError, match="^expert_ids: "):
            op(fx_, fw, mode.from_tensor(torch.zeros(3, dtype=torch.int64)))


# ------------------------------------------------------------------------------ the Triton kernel, interpreted
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_under_interpreter():
    from interpreter_child import interpreter_verdict

    verdict = interpreter_verdict(__file__)
    assert verdict == "ok", verdict


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_compiles_for_sm90_with_vector_weight_loads(transposed):
    """The kernel as launched for bf16 experts, compiled for sm_90a ahead of time (tools/aot.py, no GPU): the weight
    tile arrives as 16-byte vector loads along whichever of I (nn.Linear rows) or O (HF's transposed experts) is
    contiguous, nothing spills, and with PDL the wait comes before every memory access."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root: tools/ is dev tooling
    from test_kernel_codegen import _MEMORY_OP
    from tools import aot

    from mla_compile.kernels import experts as K

    if not aot.available():
        pytest.skip("triton's bundled ptxas is missing")
    ptrs = {"X": "*bf16", "W": "*bf16", "IDS": "*i64", "Y": "*bf16"}
    unit = {"s_xi": 1, "s_yo": 1, **({"s_wo": 1} if transposed else {"s_wi": 1})}  # Triton specialises unit strides
    divisible = set(ptrs) | {"s_xs", "s_we", "s_wo", "s_wi", "s_ys", "N_IN", "N_OUT"} - set(unit)
    for pdl in (False, True):
        constexprs = dict(BLOCK_O=K.BLOCK_O, BLOCK_I=K.BLOCK_I, EVEN_I=True, PDL=pdl, **unit)
        out = aot.compile_sm90(K._expert_linear_kernel, constexprs, ptrs, 4, 3, divisible,
                               gluon=True)  # gluon=True: no dot-mode constexprs (the kernel has no tl.dot)
        ptx = out["ptx"]
        vectors = len(re.findall(r"ld\.global(?:\.[a-z:0-9]+)*\.v4\.b32", ptx))
        assert vectors * 8 * 32 * 4 >= K.BLOCK_O * K.BLOCK_I, f"weight tile not in 16-byte loads ({vectors} per thread)"
        assert out["spill_bytes"] == 0, out["registers"]
        wait = ptx.find("griddepcontrol.wait")
        if pdl:
            first_access = _MEMORY_OP.search(ptx)
            assert first_access is not None and 0 <= wait < first_access.start(), "a memory access before the wait"
        else:
            assert wait < 0


# (S, E, O, I, transposed, id dtype, block_o, block_i): the default blocks with an O tail and an I tail, HF's
# transposed layout, int32 ids, I a multiple of the block (unmasked loads), more pairs than experts, S 0 / I 0
KERNEL_CASES = [(5, 3, 70, 130, False, torch.int64, 64, 128), (4, 2, 64, 256, True, torch.int64, 64, 128),
                (9, 2, 33, 48, False, torch.int32, 16, 16), (16, 4, 32, 64, True, torch.int32, 32, 32),
                (0, 2, 8, 8, False, torch.int64, 64, 128), (3, 2, 5, 0, False, torch.int64, 64, 128)]


def _child():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from test_triton_interpret import _patch_interpreter_for_numpy2

    _patch_interpreter_for_numpy2()
    torch.set_num_threads(1)
    from mla_compile.kernels.experts import expert_linear

    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for i, (S, E, O, I, tr, id_dtype, bo, bi) in enumerate(KERNEL_CASES):
                x, w, ids = make_args(S, E, O, I, dtype, tr, id_dtype, seed=i)
                y = expert_linear(x, w, ids, block_o=bo, block_i=bi)
                want = expert_linear_ref(x, w, ids)
                case = f"{dtype} S={S} E={E} O={O} I={I} transposed={tr} {id_dtype}"
                assert y.shape == (S, O) and y.dtype == dtype and y.is_contiguous(), case
                if I == 0:
                    assert not y.any(), f"{case}: an empty contraction must give zeros"
                elif S:
                    assert rel(y, want) < TOL[dtype], f"{case}: rel err {rel(y, want):.2e}"
        verdict = "ok"
    except Exception as e:  # noqa: BLE001 - reported to the parent test
        import traceback

        traceback.print_exc()
        verdict = f"{type(e).__name__}: {e}"
    print("VERDICT " + json.dumps(verdict))


if __name__ == "__main__":
    _child()
