"""The backend carries a Tuning (mla_compile/tuning.py): its keys in `options=`, or a whole `Tuning`; the rewrites
compile under it, the compiled graph runs under it (an op reading `tuning.current()` at run time sees it), and it
keys Inductor's caches (another Tuning, another compiled graph)."""

from __future__ import annotations

import pytest
import torch

from mla_compile import backend, tuning
from mla_compile.tuning import Tuning

SEEN = []


@torch.library.custom_op("mla_test::record_tuning", mutates_args=())
def record_tuning(x: torch.Tensor) -> torch.Tensor:
    SEEN.append(tuning.current())
    return x.clone()


@record_tuning.register_fake
def _(x):
    return torch.empty_like(x)


def test_options_give_a_tuning_by_keys_or_whole():
    opts, inductor = backend.parse_options({"absorb": "bmm", "decode_kernel": "triton", "max_autotune": False})
    assert opts.tuning == Tuning(absorb="bmm", decode_kernel="triton") and inductor == {"max_autotune": False}
    whole = Tuning(split_argmax_max_rows=4)
    assert backend.parse_options({"tuning": whole})[0].tuning is whole
    assert backend.parse_options(None)[0].tuning == tuning.DEFAULT


@pytest.mark.parametrize("options, match", [
    ({"decode_kernel": "fastest"}, "decode_kernel"),
    ({"tuning": "triton"}, "tuning"),
    ({"tuning": Tuning(), "absorb": "bmm"}, "not both"),
    ({"absorbs": "bmm"}, "decode_kernel"),  # the unknown-key message lists the Tuning keys too
])
def test_bad_tuning_options_raise_options_error(options, match):
    with pytest.raises(backend.OptionsError, match=match):
        backend.parse_options(options)


def test_tuning_keys_the_pass_manager_uuid():
    default = backend.build_pass_manager(backend.BackendOptions()).uuid()
    assert default == backend.build_pass_manager(backend.BackendOptions()).uuid()
    other = backend.build_pass_manager(backend.BackendOptions(tuning=Tuning(absorb="bmm"))).uuid()
    assert other != default


def test_compiled_graph_runs_under_its_tuning():
    torch._dynamo.reset()
    SEEN.clear()
    tune = Tuning(decode_kernel="triton")
    f = torch.compile(lambda x: record_tuning(x * 2) + 1, backend="mla_dcp", options={"decode_kernel": "triton"})
    x = torch.randn(4)
    assert torch.equal(f(x), x * 2 + 1)
    SEEN.clear()
    f(x)
    assert SEEN == [tune] and tuning.current() == tuning.DEFAULT
    g = torch.compile(lambda x: record_tuning(x * 3), backend="mla_dcp")
    SEEN.clear()
    g(x)
    assert SEEN == [tuning.DEFAULT]
