"""kernels/scratch.py without a GPU (the raw stream query patched): where split-KV partials come from the reused
scratch buffer, and that its views are laid out as fresh allocations would be. (tests/gpu/test_op_plans_cuda.py runs
decode through it on the default stream and on a side stream.)"""

from __future__ import annotations

import threading

import pytest
import torch

from mla_compile.kernels import scratch as S


@pytest.fixture
def default_stream(monkeypatch):
    """CPU tensors standing in for device 0's: the stream query answers `streams[0]`, the buffers are per test."""
    streams = [0]
    monkeypatch.setattr(S, "_stream", lambda index: streams[0])
    monkeypatch.setattr(S, "_local", threading.local())
    return streams


def _partials(o_shape, l_shape, derive=None):
    p = S.Scratch((o_shape, l_shape), torch.device("cpu"), derive)
    p.index = 0  # as a CUDA device's
    return p


def test_views_of_one_buffer_laid_out_as_fresh_allocations(default_stream):
    p = _partials((3, 2, 5, 7), (3, 2, 5))
    o, lse = p.get()
    assert o.shape == (3, 2, 5, 7) and lse.shape == (3, 2, 5) and o.dtype == lse.dtype == torch.float32
    assert o.is_contiguous() and lse.is_contiguous()
    assert o.untyped_storage().data_ptr() == lse.untyped_storage().data_ptr()
    assert (lse.data_ptr() - o.data_ptr()) % 512 == 0 and lse.data_ptr() >= o.data_ptr() + o.numel() * 4
    again = p.get()
    assert again[0] is o and again[1] is lse  # views made once per buffer generation


def test_plans_share_the_buffer_and_it_grows(default_stream):
    small, big = _partials((1, 1, 2, 4), (1, 1, 2)), _partials((4, 8, 16, 64), (4, 8, 16))
    o_small, _ = small.get()
    buf = S._buffer(0)
    first = buf.generation
    o_big, l_big = big.get()
    assert buf.generation == first + 1 and buf.data.numel() >= big.numel >= l_big.numel()
    o_again, _ = small.get()  # the small plan's views move to the grown buffer
    assert o_again is not o_small and o_again.data_ptr() == o_big.data_ptr()
    grown = buf.data.numel()
    _partials((grown + 1,), (1,)).get()
    assert buf.data.numel() >= 2 * grown  # at least doubles: few generations


@pytest.mark.parametrize("stream", [7, None])
def test_no_scratch_off_the_default_stream(default_stream, stream, monkeypatch):
    """Another stream (a capture, CUDA-graph trees' warm-up, a user's side stream) or no CUDA: fresh tensors every
    call, no buffer made."""
    if stream is None:
        monkeypatch.setattr(S, "_stream", None)
    else:
        default_stream[0] = stream
    _assert_fresh(_partials((1, 1, 2, 4), (1, 1, 2)))


def test_cpu_partials_are_never_scratch(default_stream):
    _assert_fresh(S.Scratch(((1, 1, 2, 4), (1, 1, 2)), torch.device("cpu")))


def _assert_fresh(p):
    (o1, l1), (o2, l2) = p.get(), p.get()
    assert o1.shape == (1, 1, 2, 4) and l1.shape == (1, 1, 2) and o1.dtype == l1.dtype == torch.float32
    assert len({t.untyped_storage().data_ptr() for t in (o1, l1, o2, l2)}) == 4  # four allocations, none shared
    assert S._buffer(0).data is None


def test_each_thread_has_its_own_buffer(default_stream):
    """Two threads queueing on the default stream interleave their launches: never one buffer between them."""
    p = _partials((2, 1, 2, 4), (2, 1, 2))
    here = p.get()[0].data_ptr()
    there = []
    t = threading.Thread(target=lambda: there.append(p.get()[0].data_ptr()))
    t.start()
    t.join()
    assert there and there[0] != here
    assert p.get()[0].data_ptr() == here  # back on this thread: its own buffer again


def test_derived_views_are_made_once_per_generation(default_stream):
    """A split-K linear's column views of its partials (kernels/linear.py): derived once, then returned as they are."""
    made = []
    p = _partials((2, 3, 10), (1,), derive=lambda part, _: made.append(1) or (part, part[:, :, :4], part[:, :, 4:]))
    part, left, right = p.get()
    assert left.stride() == right.stride() == part.stride() and right.data_ptr() == part.data_ptr() + 16
    assert p.get()[1] is left and made == [1]


def test_counters_ride_on_the_default_stream_buffer(default_stream):
    """Arrival counters (a split-K linear summing in its split launch, kernels/linear.py): zeroed int32 slots after
    the tensors, shared by the plans of this thread's buffer; never made twice unless more are asked for."""
    p = S.Scratch([(2, 3, 10)], torch.device("cpu"), counters=40)
    p.index = 0
    part, counters = p.get()
    assert part.shape == (2, 3, 10) and counters.dtype == torch.int32 and counters.shape == (40,)
    assert not counters.any()
    buf = S._buffer(0)
    assert counters.data_ptr() == buf.counters.data_ptr()
    q = S.Scratch([(1,)], torch.device("cpu"), counters=7)
    q.index = 0
    assert q.get()[1].data_ptr() == counters.data_ptr()  # one set of counters per buffer
    n = buf.counters.numel() + 1
    more = S.Scratch([(1,)], torch.device("cpu"), counters=n)
    more.index = 0
    grown = more.get()[1]
    assert grown.numel() == n and buf.counters.numel() >= n and not grown.any()
    assert p.get()[1].data_ptr() == buf.counters.data_ptr()  # the older plan's view follows the new counters


@pytest.mark.parametrize("stream", [7, None])
def test_no_counters_off_the_default_stream(default_stream, stream, monkeypatch):
    """Where partials are fresh (another stream, no CUDA, a CPU tensor) a plan gets None for its counters: its
    launches must not share slots with another stream's."""
    if stream is None:
        monkeypatch.setattr(S, "_stream", None)
    else:
        default_stream[0] = stream
    p = S.Scratch([(2, 3)], torch.device("cpu"), counters=4)
    p.index = 0
    part, counters = p.get()
    assert part.shape == (2, 3) and counters is None and S._buffer(0).counters is None
    assert S.Scratch([(2, 3)], torch.device("cpu"), counters=4).get()[1] is None


def test_fresh_tensors_are_derived_too():
    """`fresh()` (a caller that never reuses, or an unsafe stream): new tensors, derived the same way."""
    p = S.Scratch([(2, 3, 10)], torch.device("cpu"), lambda part: (part, part[:, :, :4]))
    part, left = p.fresh()
    assert part.shape == (2, 3, 10) and left.data_ptr() == part.data_ptr() and p.fresh()[0].data_ptr() != part.data_ptr()


@pytest.mark.parametrize("shape", [(3, 16, 512), (1, 16), (2, 1, 7), (0, 16), (), (2, 3, 4, 5), (2, 1, 4, 5, 6)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_empty_maker_gives_fresh_row_major_tensors(shape, dtype):
    """A plan's output maker (`empty_maker`: empty_like of an expanded one-element template on the CPU): every call a
    new tensor of its own storage, the shape, dtype and device asked for, row-major strides even for size-1 dims."""
    fresh = S.empty_maker(shape, dtype, torch.device("cpu"))
    a, b = fresh(), fresh()
    want = torch.empty(shape, dtype=dtype)
    for t in (a, b):
        assert t.shape == want.shape and t.dtype == dtype and t.device.type == "cpu" and t.stride() == want.stride()
    if a.numel():
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        assert a.untyped_storage().nbytes() == a.numel() * a.element_size()  # not a view of the template
