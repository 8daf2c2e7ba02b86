"""kernels/_launch.py: the cached launch path must pick, for every call, the compiled kernel Triton's own
`JITFunction.run` picks, and hand its launcher the same arguments.

No GPU here: Triton's real run path runs (its binder, specialization and key), with a fake driver (device 0, one
stream) and a fake compile that returns a recording kernel per specialization. So every call can be checked against
what Triton itself would have launched."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from mla_compile.kernels import _launch  # noqa: E402


@triton.jit
def _probe_kernel(X, Y, Opt, n, scale, flag, s0, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pass


@triton.jit
def _probe_desc_kernel(Desc, X, n, BLOCK: tl.constexpr):
    pass


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # pragma: no cover - depends on the Triton build
    gluon = None
else:
    @gluon.jit
    def _probe_gluon_kernel(Desc, X, n, BLOCK: gl.constexpr):
        pass


class _FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _RecordingKernel:
    """What Triton's compile would return for one specialization; records each launch."""

    def __init__(self, signature, constexprs, attrs, options, launches):
        self.spec = (tuple(signature.items()), tuple(sorted(constexprs.items(), key=repr)),
                     tuple(sorted(attrs.items(), key=repr)), options.num_warps)
        self.function, self.packed_metadata = object(), object()
        self._launches = launches

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        assert function is self.function and packed_metadata is self.packed_metadata
        self._launches.append((self, (g0, g1, g2), stream, launch_metadata, enter, exit_, args))


@pytest.fixture
def fake_gpu(monkeypatch):
    launches = []
    compiles = []

    def fake_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _RecordingKernel(signature, constexprs, attrs, options, launches)
        self.device_caches[device][0][key] = kernel
        compiles.append(kernel)
        return kernel

    monkeypatch.setattr(type(_probe_kernel), "_do_compile", fake_compile)
    monkeypatch.setattr(_launch, "_INTERPRETED", False)
    previous = driver._active
    driver.set_active(_FakeDriver())
    for fn in _probes():
        fn.device_caches.clear()
        fn.__dict__.pop("_mla_fast_launch", None)
    yield launches, compiles
    driver._active = previous  # reset_active() would make the default driver, which fails without a GPU
    for fn in _probes():
        fn.device_caches.clear()
        fn.__dict__.pop("_mla_fast_launch", None)


def _probes():
    return (_probe_kernel, _probe_desc_kernel) + ((_probe_gluon_kernel,) if gluon is not None else ())


def _same_as_triton(fn, grid, args, kwargs, launches):
    """Launch through the cached path (twice: the first call of a signature goes through Triton, the second comes
    from the cache), then through Triton's own run: same kernel, same launcher arguments."""
    wrapper = _launch.fast(fn)
    wrapper[grid](*args, **kwargs)
    assert len(wrapper._entries) >= 1
    wrapper[grid](*args, **kwargs)
    fast_call = launches[-1]
    assert fast_call[4] is None, "the second call came from the cache"
    fn[grid](*args, **kwargs)
    triton_call = launches[-1]
    assert fast_call[0] is triton_call[0], "the cached path launched another specialization than Triton picks"
    assert fast_call[1:3] == triton_call[1:3]
    # no hook installed: Triton hands its launcher metadata and empty hook chains, the cached path None (the same)
    assert fast_call[3:6] == (None, None, None) or fast_call[3:6] == triton_call[3:6]
    assert all(h is None or h.calls == [] for h in triton_call[4:6])
    assert len(fast_call[6]) == len(triton_call[6])
    for a, b in zip(fast_call[6], triton_call[6]):
        assert a is b or a == b


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]
_INTS = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 1, 2**31, 2**32, 2**40, -1, -16]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cached_launch_picks_tritons_kernel(fake_gpu, data):
    launches, _ = fake_gpu
    base = torch.zeros(64, dtype=data.draw(st.sampled_from(_DTYPES)))
    x = base[data.draw(st.integers(0, 8)):]  # offsets 0..8 elements: aligned to 16 bytes or not
    y = torch.zeros(8, dtype=data.draw(st.sampled_from(_DTYPES)))
    opt = data.draw(st.sampled_from([None, "tensor"]))
    opt = torch.zeros(4) if opt == "tensor" else None
    n, s0 = data.draw(st.sampled_from(_INTS)), data.draw(st.sampled_from(_INTS))
    flag = data.draw(st.sampled_from([True, False, 0, 1]))
    scale = data.draw(st.sampled_from([0.5, 1.0, 1e-3, 16.0]))
    kwargs = dict(BLOCK=data.draw(st.sampled_from([16, 32])), num_warps=data.draw(st.sampled_from([4, 8])))
    if data.draw(st.booleans()):
        kwargs["PDL"] = True
    grid = data.draw(st.sampled_from([(1,), (2, 3), (4, 5, 6)]))
    _same_as_triton(_probe_kernel, grid, (x, y, opt, n, scale, flag, s0), kwargs, launches)


def test_repeat_calls_skip_tritons_binding(fake_gpu, monkeypatch):
    launches, compiles = fake_gpu
    x, y = torch.zeros(32), torch.zeros(32)
    _launch.fast(_probe_kernel)[(3,)](x, y, None, 7, 0.5, True, 16, BLOCK=16)
    assert len(compiles) == 1
    binder_calls = []
    caches = _probe_kernel.device_caches[0]
    real_binder = caches[4]

    def counting_binder(*a, **k):
        binder_calls.append(1)
        return real_binder(*a, **k)

    _probe_kernel.device_caches[0] = (*caches[:4], counting_binder)
    x2, y2 = torch.ones(32), torch.ones(32)  # new tensors, same signature: the cached kernel, new pointers
    _launch.fast(_probe_kernel)[(3,)](x2, y2, None, 7, 0.25, True, 16, BLOCK=16)
    assert binder_calls == [] and len(compiles) == 1
    assert launches[-1][6][:2] == (x2, y2) and launches[-1][6][4] == 0.25
    _launch.fast(_probe_kernel)[(3,)](x2, y2, None, 8, 0.25, True, 16, BLOCK=16)  # a new int: Triton's path again
    assert binder_calls, "a value outside the key must go through Triton's binding"


def test_descriptor_arguments(fake_gpu):
    launches, compiles = fake_gpu
    for rows, block in ((64, [16, 32]), (64, [16, 32]), (128, [16, 32]), (64, [32, 32])):
        t = torch.zeros(rows, 64, dtype=torch.bfloat16)
        desc = TensorDescriptor.from_tensor(t, block)
        _same_as_triton(_probe_desc_kernel, (1,), (desc, t, 5), dict(BLOCK=16), launches)


@pytest.mark.skipif(gluon is None, reason="Triton without Gluon")
def test_gluon_descriptor_arguments(fake_gpu):
    """Gluon's descriptors carry a shared-memory layout; two layouts over the same tensor are two specializations."""
    launches, compiles = fake_gpu
    t = torch.zeros(64, 64, dtype=torch.bfloat16)
    for swizzle in (128, 64, 128):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
        desc = GluonDescriptor.from_tensor(t, [16, 64], layout)
        _same_as_triton(_probe_gluon_kernel, (1,), (desc, t, 5), dict(BLOCK=16), launches)
    assert len({id(k) for k in compiles}) == 2


def test_uncached_paths(fake_gpu, monkeypatch):
    """A grid function, a tensor by keyword and a launch hook all take Triton's own path (and still launch)."""
    launches, _ = fake_gpu
    x, y = torch.zeros(32), torch.zeros(32)
    _launch.fast(_probe_kernel)[lambda meta: (2,)](x, y, None, 7, 0.5, True, 16, BLOCK=16)
    assert launches[-1][1] == (2, 1, 1)
    _launch.fast(_probe_kernel)[(1,)](x, y, None, 7, 0.5, True, s0=16, BLOCK=16)
    _launch.fast(_probe_kernel)[(1,)](x, Y=y, Opt=None, n=7, scale=0.5, flag=True, s0=16, BLOCK=16)
    assert len(launches) == 3
    # a tensor passed by keyword never enters the cache: a later call with other tensors must launch those
    y2 = torch.ones(32)
    _launch.fast(_probe_kernel)[(1,)](x, Y=y2, Opt=None, n=7, scale=0.5, flag=True, s0=16, BLOCK=16)
    assert launches[-1][6][1] is y2
    from triton import knobs

    _launch.fast(_probe_kernel)[(3,)](x, y, None, 7, 0.5, True, 16, BLOCK=16)
    _launch.fast(_probe_kernel)[(3,)](x, y, None, 7, 0.5, True, 16, BLOCK=16)
    assert launches[-1][4] is None, "a cached launch without hooks"
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _launch.fast(_probe_kernel)[(3,)](x, y, None, 7, 0.5, True, 16, BLOCK=16)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert launches[-1][4] is knobs.runtime.launch_enter_hook, "a hook installed: Triton's path (hooks handed over)"


def test_bound_launch_replays_tritons_kernel_without_building_a_key(fake_gpu, monkeypatch):
    """A plan's bound launch (`_launch.bind`): the first call goes through Triton and remembers its kernel; later
    calls (other tensors, the same signature) launch that kernel with the new arguments and build no key, and it
    is the kernel Triton's own run picks for them."""
    launches, compiles = fake_gpu
    bound = _launch.bind(_probe_kernel, (3, 2), BLOCK=16, num_warps=4)
    x, y = torch.zeros(32), torch.zeros(32)
    first = bound(x, y, None, 7, 0.5, True, 16)
    assert len(compiles) == 1 and bound.entry is not None and first is compiles[0]

    def no_key(*a, **k):
        raise AssertionError("a bound launch built a key")

    monkeypatch.setattr(_launch, "_key", no_key)
    x2, y2 = torch.ones(32), torch.ones(32)
    assert bound(x2, y2, None, 7, 0.25, True, 16) is compiles[0]
    ours = launches[-1]
    assert ours[1] == (3, 2, 1) and ours[6][:2] == (x2, y2) and ours[6][4] == 0.25
    _probe_kernel[(3, 2)](x2, y2, None, 7, 0.25, True, 16, BLOCK=16, num_warps=4)
    triton_call = launches[-1]
    assert ours[0] is triton_call[0] and len(ours[6]) == len(triton_call[6])
    assert all(a is b or a == b for a, b in zip(ours[6], triton_call[6]))
    monkeypatch.setattr(_launch, "ENABLED", False)  # the escape hatch: Triton's own path, still launching
    bound(x, y, None, 7, 0.5, True, 16)
    assert launches[-1][6][:2] == (x, y)


def test_bound_launch_with_templates_takes_bases(fake_gpu, monkeypatch):
    """A bound launch holding a descriptor's template takes the base tensor in its place: on the path through
    Triton (the first call, and with fast launches off) the kernel gets the descriptor rebased over that tensor,
    the one Triton picks for a fresh descriptor over it; on the remembered path the same kernel and arguments."""
    launches, compiles = fake_gpu
    cache = torch.zeros(128, 64, dtype=torch.bfloat16)
    template = _launch.without_bases([TensorDescriptor(cache, [128, 64], [64, 1], [16, 32])])[0]
    bound = _launch.bind(_probe_desc_kernel, (2,), _launch.templated_at(0, [template]), BLOCK=16)
    x = torch.zeros(8)
    for base in (cache, torch.ones_like(cache), cache):
        bound(base, x, 5)
        ours = launches[-1]
        _probe_desc_kernel[(2,)](TensorDescriptor.from_tensor(base, [16, 32]), x, 5, BLOCK=16)
        theirs = launches[-1]
        assert ours[0] is theirs[0] and len(ours[6]) == len(theirs[6])
        d, f = ours[6][0], theirs[6][0]
        assert d.base is base and [list(d.shape), list(d.strides), list(d.block_shape)] == \
               [list(f.shape), list(f.strides), list(f.block_shape)]
        assert ours[6][1:] == theirs[6][1:]
    assert bound.entry is not None and len(compiles) == 1
    monkeypatch.setattr(_launch, "ENABLED", False)
    bound(cache, x, 5)
    assert launches[-1][6][0].base is cache


def test_plan_descriptors_equal_fresh_ones(fake_gpu):
    """kernels/decode.py copies a plan's validated descriptor templates with each call's cache as the base: the
    copy is what a fresh TensorDescriptor over the [slots, width] view would be, and launches the same kernel."""
    launches, _ = fake_gpu
    ckv, kpe = torch.zeros(4, 64, 512, dtype=torch.bfloat16), torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    templates = _launch.without_bases((TensorDescriptor(ckv, [256, 512], [512, 1], [64, 256]),
                                       TensorDescriptor(kpe, [256, 64], [64, 1], [64, 64])))
    ckv2, kpe2 = torch.ones_like(ckv), torch.ones_like(kpe)
    copies = _launch.rebased(templates, (ckv2, kpe2))
    fresh = (TensorDescriptor.from_tensor(ckv2.view(256, 512), [64, 256]),
             TensorDescriptor.from_tensor(kpe2.view(256, 64), [64, 64]))
    for c, f, base in zip(copies, fresh, (ckv2, kpe2)):
        assert type(c) is type(f) and c.base is base and c.base.data_ptr() == f.base.data_ptr()
        assert [list(c.shape), list(c.strides), list(c.block_shape), c.padding] == \
               [list(f.shape), list(f.strides), list(f.block_shape), f.padding]
    assert all(t.base is None for t in templates)  # the templates keep no tensor alive
    _launch.fast(_probe_desc_kernel)[(1,)](copies[0], ckv2, 5, BLOCK=16)
    _launch.fast(_probe_desc_kernel)[(1,)](fresh[0], ckv2, 5, BLOCK=16)
    assert launches[-1][0] is launches[-2][0]


def test_gluon_plan_descriptors_equal_fresh_ones():
    """The Gluon kernels' plans (decode_wgmma / decode_seesaw `stage1_plan`) keep descriptor templates the same
    way: a rebased copy is the descriptor `_gluon.descriptors` would build for that call's caches."""
    from mla_compile.kernels import _gluon as G

    if G.gluon is None:
        pytest.skip("no Gluon in this Triton")
    ckv, kpe = torch.zeros(4, 64, 512, dtype=torch.bfloat16), torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    templates = G.descriptor_templates(ckv, kpe)
    assert all(t.base is None for t in templates)
    ckv2, kpe2 = torch.ones_like(ckv), torch.ones_like(kpe)
    for c, f, base in zip(_launch.rebased(templates, (ckv2, kpe2)), G.descriptors(ckv2, kpe2), (ckv2, kpe2)):
        assert type(c) is type(f) and c.base is base and c.base.data_ptr() == f.base.data_ptr()
        assert [list(c.shape), list(c.strides), list(c.block_shape), c.layout, c.padding] == \
               [list(f.shape), list(f.strides), list(f.block_shape), f.layout, f.padding]


class _FakeUtils:
    """The driver's `fill_tma_descriptor` (a cuTensorMapEncodeTiled call): a distinct map object per encoding,
    its arguments recorded."""

    def __init__(self):
        self.encoded = []

    def fill_tma_descriptor(self, ptr, swizzle, elem_size, elem_type, block_size, shape, strides, padding):
        self.encoded.append((ptr, swizzle, elem_size, elem_type, tuple(block_size), tuple(shape), tuple(strides),
                             padding))
        return ("map", len(self.encoded))


class CudaLauncher:  # the name `_launch._raw_launcher` asks for: Triton's own launcher class
    def __init__(self, launch):
        self.launch, self.launch_cooperative_grid, self.launch_pdl = launch, False, False
        self.global_scratch_size = self.profile_scratch_size = 0


@pytest.mark.skipif(_launch._WRAPPER_CODE is None, reason="a Triton without the NVIDIA driver's descriptor wrapper")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bound_launch_encodes_each_descriptor_once_per_base(data, monkeypatch):
    """A kernel with TMA descriptors: Triton's launcher is a Python wrapper that encodes every descriptor into a
    CUtensorMap on every launch (driver.py `wrap_handle_tensordesc`). A bound launch calls the C launcher under it
    with the same arguments the wrapper would pass, encoding a descriptor only for a base address it has not seen
    at that position. Given the descriptors' templates (`bind(..., templates)`), the call passes the base tensors
    in their places and the launcher still gets the wrapper's arguments."""
    from triton.backends.nvidia import driver as nvidia

    utils = _FakeUtils()
    monkeypatch.setattr(driver, "_active", type("D", (), {"utils": utils})())
    monkeypatch.setattr(_launch, "_device", lambda: 0)
    monkeypatch.setattr(_launch, "_stream", lambda index: 1234)
    n_args = data.draw(st.integers(1, 12))
    positions = sorted(data.draw(st.sets(st.integers(0, n_args - 1), min_size=1, max_size=min(3, n_args))))
    signature = {i: ("tensordesc<bf16[64,64]>" if i in positions else "i32") for i in range(n_args + 2)}
    metas = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 64], fp4_padded=False) for _ in positions]
    c_calls = []
    wrapper = nvidia.wrap_handle_tensordesc(lambda *a: c_calls.append(a), signature, metas)
    entry = _launch._Entry(type("K", (), {"run": CudaLauncher(wrapper), "function": 7, "packed_metadata": 8})(),
                           tail=(16, 32))  # two constexprs after the positional arguments
    template = _launch.without_bases([TensorDescriptor(torch.zeros(128, 64, dtype=torch.bfloat16), [128, 64],
                                                       [64, 1], [64, 64])])[0]
    based = data.draw(st.booleans())
    bound = _launch.bind(_probe_kernel, (3, 2), {p: template for p in positions} if based else None)
    bound.remember(entry, n_args)
    assert bound.descriptors is not None and bound.raw is not wrapper, "the C launcher under the wrapper"
    caches = [torch.zeros(128, 64, dtype=torch.bfloat16) for _ in range(3)]

    def args_over(bases):
        args = list(range(100, 100 + n_args))
        for p, base in zip(positions, bases):
            args[p] = TensorDescriptor(base, [128, 64], [64, 1], [64, 64])
        return tuple(args)

    seen = set()
    for _ in range(data.draw(st.integers(1, 6))):
        bases = [data.draw(st.sampled_from(caches)) for _ in positions]
        args = args_over(bases)
        encoded_before = len(utils.encoded)
        bound(*(tuple(a.base if p in positions else a for p, a in enumerate(args)) if based else args))
        ours = c_calls[-1]
        fresh = [(p, b.data_ptr()) for p, b in zip(positions, bases) if (p, b.data_ptr()) not in seen]
        seen.update(fresh)
        assert len(utils.encoded) - encoded_before == len(fresh), "one encoding per new (position, base)"
        n_encoded = len(utils.encoded)
        wrapper(3, 2, 1, 1234, 7, False, False, None, None, 8, None, None, None, *args, 16, 32)  # Triton's way
        theirs = c_calls[-1]
        assert [e[0] for e in utils.encoded[n_encoded:]] == [b.data_ptr() for b in bases]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            if isinstance(a, tuple) and a[:1] == ("map",):  # a map: encoded from the same base and geometry
                assert utils.encoded[a[1] - 1] == utils.encoded[b[1] - 1]
            else:
                assert a == b


def test_swapab_plan_over_a_token_table():
    """swapab's TOKENS form (page size 1 under a token table): the plan's descriptors are [slots, width] boxes of a
    64-token tile (rows at the caches' stride), the build is PS 1 at the tiling asked for; pages that are neither
    whole tiles nor one token, rows at no TMA stride, and a tiling that is no build are refused before any launch."""
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_swapab as S

    if G.gluon is None:
        pytest.skip("no Gluon in this Triton")
    qn, qp = torch.zeros(2, 40, 512, dtype=torch.bfloat16), torch.zeros(2, 40, 64, dtype=torch.bfloat16)
    o, l = torch.empty(4, 2, 40, 512, device="meta"), torch.empty(4, 2, 40, device="meta")

    def plan(ckv, kpe, tiling=None):
        table = torch.zeros(2, 128, dtype=torch.int32)
        return S.stage1_plan(qn, qp, ckv, kpe, table, 0.1, o, l, o.stride(0), l.stride(0), 4, tiling)

    ckv, kpe = torch.zeros(300, 1, 512, dtype=torch.bfloat16), torch.zeros(300, 1, 64, dtype=torch.bfloat16)
    bound, templates, numbers = plan(ckv, kpe)
    assert [(list(t.shape), list(t.block_shape)) for t in templates] == [([300, 512], [64, 256]), ([300, 64], [64, 64])]
    assert bound.kwargs["PS"] == 1 and bound.kwargs["N"] == 64 and bound.g == (2, 4, 1)  # 40 heads: one block of 64
    assert bound.kwargs["WG"] == 2
    bound, _, _ = plan(ckv, kpe, S.Tiling(32, 8))
    assert bound.kwargs["N"] == 32 and bound.kwargs["WG"] == 2 and bound.g == (2 * 2, 4, 1)  # blocks of 32 heads
    with pytest.raises(ValueError, match="tiling"):
        plan(ckv, kpe, S.Tiling(16, 8))
    with pytest.raises(ValueError, match="token table"):
        plan(torch.zeros(20, 16, 512, dtype=torch.bfloat16), torch.zeros(20, 16, 64, dtype=torch.bfloat16))
    odd = torch.zeros(300, 1, 516, dtype=torch.bfloat16)  # rows 1032 bytes apart: no TMA stride
    with pytest.raises(ValueError, match="token table"):
        plan(odd[..., :512], odd[..., 452:])
    # one [N, 1, 576] buffer's two column ranges (SGLang's page-1 MLA cache, a fused-rows cache's flat view): the
    # descriptors step 576 elements a row
    wide = torch.zeros(300, 1, 576, dtype=torch.bfloat16)
    _, templates, _ = plan(wide[..., :512], wide[..., 512:])
    assert [list(t.strides) for t in templates] == [[576, 1], [576, 1]]


def test_fp8_swapab_plan_over_a_token_table(fake_gpu, monkeypatch):
    """decode_fp8_swapab over a page-size-1 token table (the HF pass's): the TOKENS form by default for blocks of 16
    heads (TOKENS_IN_AUTO, TOKENS_MAX_N), MLA_COMPILE_SWAPAB_TOKENS = 1 / 0 over that default, or asked for
    (`tokens=True`); else the GATHER form. The TOKENS plan holds the TMA form's descriptor templates ([slots, width]
    boxes, rows at the 656-byte token stride) and launches the kernel with them rebased over the call's views in
    their place and the same views as the row copies' pointers after the numbers, as Triton's binder types them
    (descriptors, pointers); the other forms pass those pointers as None (constexprs: their builds unchanged). A
    TOKENS form asked for over pages (64 or 16 tokens) is refused before any launch."""
    from mla_compile import fp8
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_fp8_swapab as F

    if G.gluon is None:
        pytest.skip("no Gluon in this Triton")
    launches, _ = fake_gpu
    kernel = F._fp8_swapab_kernel
    kernel.device_caches.clear()
    kernel.__dict__.pop("_mla_fast_launch", None)
    _, ckv, scale, kpe = fp8.allocate(300, 1)
    qn, qp = torch.zeros(2, 16, 512, dtype=torch.bfloat16), torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    o, l = torch.zeros(4, 2, 16, 512), torch.zeros(4, 2, 16)
    table, lens = torch.zeros(2, 128, dtype=torch.int32), torch.tensor([100, 7], dtype=torch.int32)

    def plan(tokens=None, views=(ckv, scale, kpe)):
        c, s, k = views
        return F.stage1_plan(qn, qp, c, k, s, table, 0.1, o, l, o.stride(0), l.stride(0), 4, tokens=tokens)

    try:
        assert F.token_rows(ckv, kpe, scale)
        monkeypatch.setattr(F, "TOKENS_IN_AUTO", False)
        monkeypatch.delenv("MLA_COMPILE_SWAPAB_TOKENS", raising=False)
        gather = plan()
        assert gather[1] is None and gather[3] is False
        monkeypatch.setattr(F, "TOKENS_IN_AUTO", True)
        assert plan()[3] is True and plan(False)[3] is False
        q32 = torch.zeros(2, 32, 512, dtype=torch.bfloat16), torch.zeros(2, 32, 64, dtype=torch.bfloat16)
        o32, l32 = torch.zeros(4, 2, 32, 512), torch.zeros(4, 2, 32)
        wide = F.stage1_plan(*q32, ckv, kpe, scale, table, 0.1, o32, l32, o32.stride(0), l32.stride(0), 4)
        assert wide[3] is False  # blocks of 32 heads keep GATHER by default (TOKENS_MAX_N)
        monkeypatch.setenv("MLA_COMPILE_SWAPAB_TOKENS", "0")  # the switch over the default
        assert plan()[3] is False
        monkeypatch.setattr(F, "TOKENS_IN_AUTO", False)
        monkeypatch.setenv("MLA_COMPILE_SWAPAB_TOKENS", "1")
        assert plan()[3] is True
        monkeypatch.delenv("MLA_COMPILE_SWAPAB_TOKENS")
        tokens = plan(True)
        assert tokens[3] is True and tokens[0].kwargs["TOKENS"] and tokens[0].kwargs["GATHER"]
        assert [(list(t.shape), list(t.strides), list(t.block_shape)) for t in tokens[1]] == [
            ([300, 512], [656, 1], [64, 256]), ([300, 4], [164, 1], [64, 4]), ([300, 64], [328, 1], [64, 64])]
        names = kernel.arg_names
        for p, pointers in ((gather, "constexpr"), (tokens, "*")):
            for _ in range(2):  # through Triton, then the remembered kernel
                F.run_stage1(p, qn, qp, ckv, kpe, scale, table, lens, o, l)
                spec, args = dict(launches[-1][0].spec[0]), launches[-1][6]
                first = names.index("EPtr")
                assert names[first:first + 3] == ["EPtr", "SPtr", "RPtr"]
                if pointers == "*":
                    assert [spec[n] for n in ("EPtr", "SPtr", "RPtr")] == ["*fp8e4nv", "*fp32", "*bf16"]
                    assert all(spec[n].startswith("tensordesc<") for n in ("EDesc", "SDesc", "RDesc"))
                    assert [a.base for a in args[2:5]] == [ckv, scale, kpe]
                    assert list(args[first:first + 3]) == [ckv, scale, kpe]
                else:  # GATHER: the views as pointers at the descriptors' place, no more pointers
                    assert [spec[n] for n in ("EPtr", "SPtr", "RPtr")] == ["constexpr"] * 3
                    assert list(args[2:5]) == [ckv, scale, kpe] and args[first:first + 3] == (None,) * 3
        _, c64, s64, k64 = fp8.allocate(4, 64)
        with pytest.raises(ValueError, match="TOKENS"):
            plan(True, (c64, s64, k64))
        with pytest.raises(ValueError, match="TOKENS"):
            plan(True, tuple(t.view(16, 16, -1) for t in (c64, s64, k64)))  # page 16: GATHER's only
    finally:
        kernel.device_caches.clear()
        kernel.__dict__.pop("_mla_fast_launch", None)


def test_decode_plan_at_few_heads_launches_the_swap_ab_kernel(fake_gpu, monkeypatch):
    """What `mla.decode` runs where dispatch picks swapab (few heads on sm_90, pages of whole 64-token tiles): the
    op's plan (`dispatch.decode_plan`) launches decode_swapab's kernel, its descriptors' bases the two caches, then
    the merge. (The plan once fell through to the Triton kernels' default config: the choice never reached the op.)"""
    from mla_compile.kernels import _gluon as G
    from mla_compile.kernels import decode_swapab as S
    from mla_compile.kernels import dispatch, merge

    if G.gluon is None:
        pytest.skip("no Gluon in this Triton")
    launches, _ = fake_gpu
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    kernels = (S._swapab_kernel, merge._merge_kernel)
    for k in kernels:
        k.device_caches.clear()
        k.__dict__.pop("_mla_fast_launch", None)
    try:
        ckv, kpe = torch.zeros(4, 64, 512, dtype=torch.bfloat16), torch.zeros(4, 64, 64, dtype=torch.bfloat16)
        qn, qp = torch.zeros(2, 16, 512, dtype=torch.bfloat16), torch.zeros(2, 16, 64, dtype=torch.bfloat16)
        table, lens = torch.arange(4, dtype=torch.int32).view(2, 2), torch.tensor([100, 7], dtype=torch.int32)
        assert dispatch.decode_kernel(qn, qp, ckv, kpe, block_table=table).name == "swapab"
        plan, keep = dispatch.decode_plan(qn, qp, ckv, kpe, table, lens, 0.1)
        assert keep
        out, lse = plan(qn, qp, ckv, kpe, table, lens, None)
        assert out.shape == (2, 16, 512) and lse.shape == (2, 16)
        names = set(S._swapab_kernel.arg_names)  # the swap-AB kernel's launches: its arguments, its descriptors
        stage1 = [x for x in launches if set(dict(x[0].spec[0])) <= names and "CkvDesc" in dict(x[0].spec[0])]
        assert len(stage1) == 1, [dict(x[0].spec[0]).keys() for x in launches]
        spec, args = dict(stage1[0][0].spec[0]), stage1[0][6]
        assert spec["CkvDesc"].startswith("tensordesc<") and spec["KpeDesc"].startswith("tensordesc<")
        assert args[2].base is ckv and args[3].base is kpe
        assert len(launches) == 2  # stage 1, then the merge of its splits
    finally:
        for k in kernels:
            k.device_caches.clear()
            k.__dict__.pop("_mla_fast_launch", None)
