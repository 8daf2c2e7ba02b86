"""Which launches a split-K few-token linear makes (kernels/linear.py `small_m_plan`), without a GPU: the plan is
built over CPU tensors standing in for device 0's, the stream query patched and the launches recorded, not run.

On the legacy default stream (where kernels/scratch.py hands out zeroed arrival counters) the splits are summed in
the split launch itself: one launch. Anywhere else (a capture, CUDA-graph trees, a side stream) two: the split
kernel, then the summing one. An unsplit product is one launch everywhere. (tests/gpu/test_kernels_cuda.py runs
the kernels themselves; tests/kernels/test_triton_interpret.py checks their sums against float64.)"""

from __future__ import annotations

import threading

import pytest
import torch

from mla_compile.kernels import _launch, linear, scratch


@pytest.fixture
def launches(monkeypatch):
    """(the launched kernels' names, in order; the stream the plans see: `stream[0]`, 0 = the legacy default)."""
    names, stream = [], [0]
    monkeypatch.setattr(scratch, "_stream", lambda index: stream[0])
    monkeypatch.setattr(scratch, "_local", threading.local())
    make = scratch.Scratch.__init__

    def on_device_0(self, *args, **kwargs):  # the index a CUDA device's Scratch has
        make(self, *args, **kwargs)
        self.index = 0

    monkeypatch.setattr(scratch.Scratch, "__init__", on_device_0)
    monkeypatch.setattr(_launch.Bound, "__call__",
                        lambda self, *args: names.append(self.fast.jit_function.fn.__name__))
    return names, stream


def _plan(M=8, K=2048, Ns=(1536, 576), cfg=None):
    x = torch.randn(M, K).to(torch.bfloat16)
    ws = [torch.randn(N, K).to(torch.bfloat16) for N in Ns]
    return linear.small_m_plan(x, ws, cfg), x, ws


@pytest.mark.parametrize("Ns", [(1536, 576), (2048,)])
def test_split_k_is_one_launch_on_the_default_stream(launches, Ns):
    names, _ = launches
    plan, x, ws = _plan(Ns=Ns)
    assert linear.default_linear_config(8, 2048, sum(Ns)).split_k > 1  # the case under test splits K
    for _ in range(2):
        plan(x, *ws)
    assert names == ["_linear_split_sum_kernel"] * 2
    counters = scratch._buffer(0).counters
    blocks = sum(-(-N // 32) for N in Ns)
    assert counters is not None and counters.numel() >= blocks and not counters.any()


def test_split_k_sums_in_a_second_launch_off_the_default_stream(launches):
    names, stream = launches
    plan, x, ws = _plan()
    stream[0] = 7  # a capture stream, CUDA-graph trees' stream, a user's side stream
    plan(x, *ws)
    assert names == ["_linear_kernel", "_sum_splits_kernel"]
    assert scratch._buffer(0).counters is None  # no counters handed out there


@pytest.mark.parametrize("sum_in_kernel,want", [(False, ["_linear_kernel", "_sum_splits_kernel"]),
                                                (True, ["_linear_split_sum_kernel"])])
def test_an_explicit_choice_holds_on_any_stream(launches, sum_in_kernel, want):
    names, stream = launches
    x = torch.randn(4, 2048).to(torch.bfloat16)
    ws = [torch.randn(N, 2048).to(torch.bfloat16) for N in (1536, 576)]
    for s in (0, 7):
        stream[0] = s
        names.clear()
        linear.small_m_plan(x, ws, None, sum_in_kernel)(x, *ws)
        assert names == want


def test_unsplit_product_is_one_launch(launches):
    names, _ = launches
    plan, x, ws = _plan(K=256, Ns=(64, 32), cfg=linear.LinearConfig(split_k=1))
    plan(x, *ws)
    assert names == ["_linear_kernel"]
