"""flashtile.triton.relaunch: compiled kernels relaunched without Triton's binder.

On the CPU the interpreter runs every launch through Triton, so these tests switch the relaunch path on
by hand: they check that the key separates what Triton specialises on, that every kernel's launch site
follows the tensors / scalars / constexprs contract, and that a relaunch hands the compiled kernel every
argument in signature order. On a GPU (FLASHTILE_TEST_DEVICE=cuda) the real relaunch runs: its results
must equal, bit for bit, those of the first call of the same shape (which went through Triton's binder).
"""

from __future__ import annotations

import pytest
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

import flashtile
from flashtile.triton import relaunch

from conftest import DEVICE, INTERPRETED, random_qkv


_KERNEL = object()  # the key takes the kernel's identity only


def _key(tensors=(), scalars=(), **options):
    return relaunch.launch_key(_KERNEL, tensors, scalars, options)


@pytest.fixture
def on_cpu_device(monkeypatch):
    monkeypatch.setattr(relaunch, "_device", lambda: 0)


def test_launch_key_separates_what_triton_specialises_on(on_cpu_device):
    x = torch.empty(64, dtype=torch.float16)
    base = _key((x,), (16, 2.0), BLOCK=16, num_warps=4)
    assert base == _key((torch.empty(64, dtype=torch.float16),), (16, 2.0), BLOCK=16, num_warps=4)
    different = [
        _key((x.view(torch.bfloat16),), (16, 2.0), BLOCK=16, num_warps=4),  # dtype
        _key((x[1:],), (16, 2.0), BLOCK=16, num_warps=4),  # 2 bytes off a 16-byte boundary
        _key((x,), (17, 2.0), BLOCK=16, num_warps=4),  # an int's value
        _key((x,), (16, 2), BLOCK=16, num_warps=4),  # an int where a float was
        _key((x,), (16, 2.0), BLOCK=32, num_warps=4),  # a constexpr
        _key((x,), (16, 2.0), BLOCK=16, num_warps=8),  # a launch option
    ]
    assert all(key != base for key in different)
    assert _key((x,), (1,)) != _key((x,), (True,))  # True == 1 in Python; Triton passes them differently
    rows = torch.empty(4, 64, 8, dtype=torch.float16)
    box = TensorDescriptor(rows, [4, 64, 8], list(rows.stride()), [1, 16, 8])
    wider = TensorDescriptor(rows, [4, 64, 8], list(rows.stride()), [1, 32, 8])
    assert _key((box,)) == _key((TensorDescriptor(torch.empty_like(rows), [4, 64, 8], list(rows.stride()),
                                                  [1, 16, 8]),))
    assert _key((box,)) != _key((wider,))


def test_a_stand_in_without_a_jit_function_is_launched_through_itself_every_time(monkeypatch, on_cpu_device):
    """Tests wrap kernels in recorders (test_triton_schedules.py); such a wrapper has no `fn` to read the
    signature from, so nothing is cached for it and each launch reaches it."""
    monkeypatch.setattr(relaunch, "interpreting", lambda: False)
    monkeypatch.setattr(relaunch, "_compiled", {})
    grids = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *args, **options: grids.append(grid)

    stand_in, x = StandIn(), torch.empty(16)
    for _ in range(3):
        relaunch.launch(stand_in, (2,), (x,), (1,), BLOCK=16)
    assert grids == [(2,)] * 3
    assert not relaunch._compiled


class _FakeLauncher:
    """Stands in for Triton's compiled launcher (CudaLauncher): records the calls, through __call__ or launch."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, scratch: int = 0):
        self.global_scratch_size = self.profile_scratch_size = scratch
        self.runs, self.launches = [], []

    def __call__(self, *args):
        self.runs.append(args)

    def launch(self, *args):
        self.launches.append(args)


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel after its first launch."""

    function, packed_metadata = 1234, (4, 1, 0)

    def __init__(self, run):
        self.run = run
        self.grid_launches = []

    def __getitem__(self, grid):
        return lambda *args: self.grid_launches.append((grid, args))


class _JitFunction:
    """Stands in for a JIT function: what _constexpr_tail reads is the Python function behind the kernel."""

    @staticmethod
    def fn(X, Y, n, BLOCK: "tl.constexpr" = 16):  # noqa: F821 - an annotation, as Triton kernels write it
        pass


def _fake_relaunch_path(monkeypatch, first_launch):
    """Switch the relaunch path on as on a GPU with a Triton release it is enabled for, with `first_launch`
    standing for Triton's own launch."""
    monkeypatch.setattr(relaunch, "interpreting", lambda: False)
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", True)
    monkeypatch.setattr(relaunch, "_compiled", {})
    monkeypatch.setattr(relaunch, "_stream_getter", lambda: lambda device: 77 + device)
    monkeypatch.setattr(relaunch, "_first_launch", first_launch)


def _relaunch_fake(monkeypatch, compiled):
    """Launch a stand-in JIT function twice through relaunch.launch: the second launch is a relaunch of
    `compiled` (the first one's result). Returns the tensors passed."""
    _fake_relaunch_path(monkeypatch, lambda kernel, grid, args, options: compiled)
    x, y, kernel = torch.empty(16), torch.empty(16)[2:], _JitFunction()  # one kernel object: its identity is keyed
    for _ in range(2):
        relaunch.launch(kernel, (3, 2), (x, y), (5,), BLOCK=32)
    return x, y


def test_a_relaunch_calls_the_compiled_launcher_with_addresses_and_no_hooks(monkeypatch, on_cpu_device):
    """With Triton 3.6 and no scratch memory: the compiled launcher itself, with the base arguments in its
    order (grid, stream, function, cooperative, pdl, no scratch, metadata, no launch metadata, no hooks) and
    each tensor as its address."""
    launcher = _FakeLauncher()
    compiled = _FakeCompiled(launcher)
    x, y = _relaunch_fake(monkeypatch, compiled)
    assert not launcher.runs and not compiled.grid_launches
    assert launcher.launches == [(3, 2, 1, 77, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                                  x.data_ptr(), y.data_ptr(), 5, 32)]


def test_a_kernel_that_needs_scratch_memory_is_relaunched_through_triton(monkeypatch, on_cpu_device):
    """Scratch memory is allocated by Triton's own launch path: such a kernel is relaunched with compiled[grid]."""
    launcher = _FakeLauncher(scratch=256)
    compiled = _FakeCompiled(launcher)
    x, y = _relaunch_fake(monkeypatch, compiled)
    assert not launcher.launches and not launcher.runs
    assert compiled.grid_launches == [((3, 2, 1), (x, y, 5, 32))]


@pytest.mark.parametrize("version, switch, enabled", [("3.6.0", None, True), ("3.6.0", "0", False),
                                                     ("3.6.0", "off", False), ("3.6.0", "1", True),
                                                     ("3.6.1", None, False), ("3.9.0", None, False),
                                                     ("3.9.0", "1", False)])
def test_the_fast_launch_runs_only_on_tested_triton_releases_and_can_be_switched_off(version, switch, enabled):
    environ = {} if switch is None else {relaunch.FAST_LAUNCH_SWITCH: switch}
    assert relaunch.fast_launch_enabled(version, environ) is enabled


def test_without_the_fast_launch_every_launch_goes_through_triton(monkeypatch, on_cpu_device):
    """FAST_LAUNCH off (another Triton release, or FLASHTILE_FAST_LAUNCH=0): kernel[grid] every time, with the
    tensors themselves, and nothing is kept."""
    monkeypatch.setattr(relaunch, "interpreting", lambda: False)
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", False)
    monkeypatch.setattr(relaunch, "_compiled", {})
    launches = []

    class Kernel(_JitFunction):
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append((grid, args, options))

    kernel, x = Kernel(), torch.empty(16)
    for _ in range(2):
        relaunch.launch(kernel, (3, 2), (x,), (5,), BLOCK=32)
        relaunch.launch_fixed(relaunch.FixedLaunch(kernel, (5,), {"BLOCK": 32}), (3, 2, 1), (x,))
    assert [(grid, args[0] is x, args[1:], options) for grid, args, options in launches] == [
        ((3, 2), True, (5,), {"BLOCK": 32}), ((3, 2, 1), True, (5,), {"BLOCK": 32})] * 2
    assert not relaunch._compiled


class _FailingKernel(_JitFunction):
    """Stands in for a JIT function that Triton cannot compile."""

    def __init__(self, error):
        self.error = error

    def __getitem__(self, grid):
        def fail(*args, **options):
            raise self.error
        return fail


@pytest.mark.parametrize("fast", (True, False), ids=("fast-launch", "triton-launch"))
def test_a_compile_failure_names_the_kernel_and_its_tile(monkeypatch, on_cpu_device, fast):
    from triton.runtime.errors import PTXASError

    monkeypatch.setattr(relaunch, "interpreting", lambda: False)
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", fast)
    monkeypatch.setattr(relaunch, "_compiled", {})
    kernel = _FailingKernel(PTXASError("PTXAS error: `ptxas` failed with error code -11\n" + "ptx text\n" * 1000))
    with pytest.raises(relaunch.KernelCompileError) as raised:
        relaunch.launch(kernel, (3, 2), (torch.empty(16),), (5,), BLOCK_M=128, BLOCK_N=64, num_warps=8,
                        num_stages=3, USE_TMA=True)
    message = str(raised.value)
    assert message.startswith("flashtile could not compile or launch fn (BLOCK_M=128, BLOCK_N=64, num_warps=8, "
                              "num_stages=3, USE_TMA=True; grid (3, 2)) with Triton "), message
    assert message.endswith("PTXAS error: `ptxas` failed with error code -11") and len(message) < 400, message
    assert isinstance(raised.value.__cause__, PTXASError)
    # errors that are not Triton's pass through as they are (a test's stand-in asserting, say)
    with pytest.raises(AssertionError, match="not a compiler error"):
        relaunch.launch(_FailingKernel(AssertionError("not a compiler error")), (1,), (), ())


def test_a_fixed_launch_is_keyed_by_its_tensors_alignment(monkeypatch, on_cpu_device):
    """launch_fixed relaunches one compiled kernel for tensors at any 16-byte-aligned addresses, each launch with
    its own tensors' addresses, and goes through Triton again (a key of its own) when a tensor sits off a 16-byte
    boundary, which Triton specialises pointers on."""
    firsts = []

    def first_launch(kernel, grid, args, options):
        firsts.append(args)
        return _FakeCompiled(_FakeLauncher())

    _fake_relaunch_path(monkeypatch, first_launch)
    fixed = relaunch.FixedLaunch(_JitFunction(), (5,), {"BLOCK": 32})
    aligned = [(torch.empty(16), torch.empty(16)) for _ in range(2)]
    misaligned = [(torch.empty(16), torch.empty(18)[2:]) for _ in range(2)]  # 8 bytes off a boundary
    for tensors in (aligned[0], aligned[1], misaligned[0], misaligned[1], aligned[0]):
        relaunch.launch_fixed(fixed, (3, 2, 1), tensors)
    assert [args[:2] for args in firsts] == [aligned[0], misaligned[0]]
    launches = [entry[0].run.launches for entry in relaunch._compiled.values()]
    assert [[call[13:15] for call in calls] for calls in launches] == [
        [tuple(t.data_ptr() for t in aligned[1]), tuple(t.data_ptr() for t in aligned[0])],
        [tuple(t.data_ptr() for t in misaligned[1])]]


def _descriptor_wrapper(launcher, tensordesc_indices, tensordesc_meta):
    """Shaped as Triton 3.6 wraps the compiled launcher of a kernel with host-side descriptors: a closure over
    the compiled launcher, the descriptors' signature positions and their metadata (what relaunch reads)."""
    def inner(*args):
        raise AssertionError(f"a relaunch must go past the descriptor wrapper (of {launcher}: "
                             f"{tensordesc_indices}, {tensordesc_meta})")
    return inner


def test_a_relaunch_encodes_each_descriptor_once_per_address_and_layout(monkeypatch, on_cpu_device):
    """Kernels with host-side TMA descriptors: the compiled launcher behind Triton 3.6's wrapper gets each
    descriptor as (tensor map, *shape, *strides) in its place; a map is encoded once per address and layout
    and encoded again when either changes."""
    encoded = []

    def encode(address, swizzle, element_size, element_type, box, shape, strides, padding):
        encoded.append((address, swizzle, element_size, element_type, tuple(box), tuple(shape), tuple(strides),
                        padding))
        return f"map{len(encoded)}"

    monkeypatch.setattr(relaunch, "_tensor_map_encoder", lambda: (encode, {5: 50, 7: 70}))
    compiled_launches = []
    metas = [dict(swizzle=128, elem_size=2, elem_type=5, block_size=[1, 16, 8], fp4_padded=False),
             dict(swizzle=64, elem_size=4, elem_type=7, block_size=[1, 32, 8], fp4_padded=False)]
    wrapper = _descriptor_wrapper(lambda *args: compiled_launches.append(args), {1, 3}, metas)
    launcher = _FakeLauncher()
    launcher.launch = wrapper
    compiled = _FakeCompiled(launcher)
    _fake_relaunch_path(monkeypatch, lambda kernel, grid, args, options: compiled)
    monkeypatch.setattr(relaunch, "_stream_getter", lambda: lambda device: 77)

    class JitFunction:
        @staticmethod
        def fn(X, DescA, Y, DescB, n, BLOCK: "tl.constexpr" = 16):  # noqa: F821
            pass

    kernel = JitFunction()
    rows, cols = torch.empty(4, 64, 8, dtype=torch.float16), torch.empty(4, 64, 8, dtype=torch.float32)
    x, y = torch.empty(16), torch.empty(16)

    def descriptors(a, b):
        return (TensorDescriptor(a, [4, 64, 8], list(a.stride()), [1, 16, 8]),
                TensorDescriptor(b, [4, 64, 8], list(b.stride()), [1, 32, 8]))

    def run(a, b):
        desc_a, desc_b = descriptors(a, b)
        relaunch.launch(kernel, (3,), (x, desc_a, y, desc_b), (5,), BLOCK=32)

    run(rows, cols)  # the first launch goes through Triton (recorded): nothing encoded here
    run(rows, cols)
    run(rows, cols)  # same addresses and layouts: no new encoding
    strides_a, strides_b = list(rows.stride()), list(cols.stride())
    assert encoded == [(cols.data_ptr(), 64, 4, 70, (1, 32, 8), (4, 64, 8), tuple(strides_b), 0),
                       (rows.data_ptr(), 128, 2, 50, (1, 16, 8), (4, 64, 8), tuple(strides_a), 0)]
    base = (3, 1, 1, 77, 1234, False, True, None, None, (4, 1, 0), None, None, None)
    expected = (*base, x.data_ptr(), "map2", 4, 64, 8, *strides_a, y.data_ptr(), "map1", 4, 64, 8, *strides_b, 5, 32)
    assert compiled_launches == [expected, expected]
    other = torch.empty_like(rows)  # another address, the same layout: encoded again
    run(other, cols)
    assert len(encoded) == 3 and encoded[-1][0] == other.data_ptr()
    assert compiled_launches[-1][14] == "map3" and compiled_launches[-1][22] == "map1"


def test_a_launch_hook_gets_triton_own_launch_with_the_tensors(monkeypatch, on_cpu_device):
    """A profiler's launch hook needs Triton's launch metadata: with one installed, relaunches go through
    compiled[grid] with the tensors themselves."""
    hooks = triton.knobs.runtime.launch_enter_hook
    assert not relaunch._hooked()
    hook = lambda metadata: None  # noqa: E731
    hooks.add(hook)
    try:
        assert relaunch._hooked()
        launcher = _FakeLauncher()
        compiled = _FakeCompiled(launcher)
        x, y = _relaunch_fake(monkeypatch, compiled)
    finally:
        hooks.remove(hook)
    assert not launcher.launches and not launcher.runs
    assert len(compiled.grid_launches) == 1
    grid, args = compiled.grid_launches[0]
    assert grid == (3, 2, 1) and args[0] is x and args[1] is y and args[2:] == (5, 32)


class _RecordingKernel:
    """Stands in for a compiled kernel: records what a relaunch passes it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


@pytest.mark.skipif(not INTERPRETED, reason="switches the relaunch path on by hand under the CPU interpreter")
def test_every_launch_site_relaunches_with_one_argument_per_kernel_parameter(monkeypatch, on_cpu_device):
    monkeypatch.setattr(relaunch, "interpreting", lambda: False)
    monkeypatch.setattr(relaunch, "FAST_LAUNCH", True)
    monkeypatch.setattr(relaunch, "_compiled", {})
    interpret = relaunch._first_launch

    def first_launch(kernel, grid, args, options):  # the interpreter runs it; a recorder stands for the result
        interpret(kernel, grid, args, options)
        return _RecordingKernel(kernel)

    monkeypatch.setattr(relaunch, "_first_launch", first_launch)

    def step():
        q, k, v = random_qkv(2, 37, 45, 4, 2, 24, 40, torch.float32, requires_grad=True)
        with flashtile.use_backend("triton", backward_schedule=0):
            flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
        with flashtile.use_backend("triton", forward_schedule=1, backward_schedule=3):  # TMA loads, one launch
            flashtile.flash_attn_func(q, k, v).sum().backward()
        k_cache, v_cache = torch.randn(2, 256, 2, 24), torch.randn(2, 256, 2, 40)
        angles = torch.rand(256, 6)
        with flashtile.use_backend("triton"):
            flashtile.flash_attn_with_kvcache(q[:, :1].detach(), k_cache, v_cache, cache_seqlens=200, num_splits=3)
            flashtile.flash_attn_with_kvcache(q[:, :1].detach(), k_cache, v_cache, k[:, :2].detach(),
                                              torch.randn(2, 2, 2, 40), angles.cos(), angles.sin(), cache_seqlens=200)

    step()
    kernels = {compiled.kernel.fn.__name__ for compiled, *_ in relaunch._compiled.values()}
    assert kernels == {"attention_fwd_kernel", "attention_fwd_tma_kernel", "attention_bwd_preprocess_kernel",
                       "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel", "attention_bwd_kernel",
                       "attention_decode_kernel", "attention_decode_combine_kernel", "kvcache_append_kernel"}, kernels
    step()  # every key is known now: each launch goes to a recording kernel
    for compiled, *_ in relaunch._compiled.values():
        assert compiled.launches, f"{compiled.kernel.fn.__name__} was not relaunched"
        for grid, args in compiled.launches:
            assert len(grid) == 3
            assert len(args) == len(compiled.kernel.arg_names), compiled.kernel.fn.__name__


ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU: run with FLASHTILE_TEST_DEVICE=cuda")
TESTED_TRITON = pytest.mark.skipif(triton.__version__ not in relaunch.FAST_LAUNCH_VERSIONS,
                                   reason=f"the fast launch is off on Triton {triton.__version__} (tested on "
                                          f"{', '.join(relaunch.FAST_LAUNCH_VERSIONS)})")


def _every_kernel_once():
    """Outputs and gradients of calls that launch every kernel: the TMA forward with the one-launch backward
    (d = 128), the two-launch TMA backward (d = 64), the pointer-load forward (an unaligned head dim), a packed
    batch and a split KV-cache decode."""
    results = []
    for headdim, causal in ((128, True), (64, False), (72, True)):
        q, k, v = random_qkv(2, 300, 333, 4, 2, headdim, headdim, torch.bfloat16, requires_grad=True)
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        results += [out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))]
    q, k, v = (t[0] for t in random_qkv(1, 500, 500, 4, 4, 64, 64, torch.bfloat16, requires_grad=True))
    cu = torch.tensor([0, 7, 300, 500], dtype=torch.int32, device=DEVICE)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 293, 293, causal=True)
    results += [out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))]
    k_cache, v_cache = (torch.randn(2, 4096, 2, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    query = torch.randn(2, 1, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    results += list(flashtile.flash_attn_with_kvcache(query, k_cache, v_cache, cache_seqlens=3000,
                                                       return_softmax_lse=True))
    # rotary tables: the rotary kernel rotates and appends, into the cache the results hold
    new = torch.randn(2, 1, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    angles = torch.rand(4096, 64, device=DEVICE)
    results += [flashtile.flash_attn_with_kvcache(query, k_cache, v_cache, new, new, angles.cos(), angles.sin(),
                                                  cache_seqlens=3000, causal=True), k_cache[:, 3000], v_cache[:, 3000]]
    return results


@ON_GPU
@TESTED_TRITON
def test_the_fast_launch_gives_the_bits_of_tritons_own_launch(monkeypatch):
    """Every kernel launched twice through Triton (FAST_LAUNCH off, as on other Triton releases or with
    FLASHTILE_FAST_LAUNCH=0) and twice with the fast launch (the second a relaunch): the same bits."""
    runs = {}
    for fast in (False, True):
        monkeypatch.setattr(relaunch, "FAST_LAUNCH", fast)
        monkeypatch.setattr(relaunch, "_compiled", {})
        runs[fast] = []
        for _ in range(2):
            torch.manual_seed(0)  # the same inputs every time
            runs[fast].append(_every_kernel_once())
        assert bool(relaunch._compiled) == fast
    reference = runs[False][0]
    for fast, attempt in ((False, 1), (True, 0), (True, 1)):
        for index, (a, b) in enumerate(zip(reference, runs[fast][attempt])):
            assert torch.equal(a, b), f"result {index} differs (fast launch {fast}, run {attempt})"


@ON_GPU
@TESTED_TRITON
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_relaunched_kernels_give_the_first_calls_bits(causal, monkeypatch):
    monkeypatch.setattr(relaunch, "_compiled", {})
    q, k, v = random_qkv(2, 1000, 1100, 8, 2, 128, 128, torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 1000, 8, 128, device=DEVICE, dtype=torch.bfloat16)

    def step():
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    first = step()  # through Triton's binder; the keys are recorded
    assert relaunch._compiled, "no compiled kernel was recorded"
    launches = len(relaunch._compiled)
    again = step()  # relaunched
    assert len(relaunch._compiled) == launches, "the second call made new keys"
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), f"{name} differs after a relaunch"
    if relaunch.FAST_LAUNCH:  # the descriptor kernels skip 3.6's wrapper: the table's forward (TMA or Gluon)
        launchers = {compiled.name: hookless.__name__ for compiled, _, hookless in relaunch._compiled.values()}
        (forward,) = [name for name in launchers if name.startswith("attention_fwd")]
        assert forward in ("attention_fwd_tma_kernel", "attention_fwd_gluon_kernel"), launchers
        assert launchers[forward] == "launch_encoded", launchers
    # copies at other addresses: every descriptor is encoded again for them (the maps follow addresses)
    copies = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtile.flash_attn_func(*copies, causal=causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, (out, *torch.autograd.grad(out, copies, grad))):
        assert torch.equal(a, b), f"{name} differs for copies of q, k, v"
    # the same kernel (pointer loads) on a q 2 bytes off a 16-byte boundary: Triton specialises pointers on
    # 16-byte alignment, so it must get a key of its own rather than the aligned q's compiled kernel
    offset = torch.empty(q.numel() + 8, device=DEVICE, dtype=q.dtype)[1:1 + q.numel()].view(q.shape)
    offset.copy_(q)
    with torch.no_grad(), flashtile.use_backend("triton", forward_schedule=0):
        flashtile.flash_attn_func(q, k, v, causal=causal)
        keys = len(relaunch._compiled)
        out = flashtile.flash_attn_func(offset, k, v, causal=causal)
    assert len(relaunch._compiled) == keys + 1, "a misaligned q was relaunched with the aligned q's kernel"
    assert (out.float() - first[0].float()).abs().max().item() < 2e-2
