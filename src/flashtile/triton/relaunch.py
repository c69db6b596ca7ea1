"""Launching a Triton kernel again without Triton's argument binder, on the Triton versions this was tested on.

`kernel[grid](...)` runs Triton's binder on every call: it classifies each argument (pointer dtype and
16-byte alignment, integer value class, descriptor block shape), hashes the result and looks the compiled
kernel up. On the H200's host that costs ~20 us of the ~33 us a launch of a 36-argument kernel takes
(13.1 us for the same compiled kernel relaunched directly; docs/launch-overhead.md), and a 1k-token
forward or a decode step is short enough to feel it.

`launch` keeps the compiled kernel Triton returned under a key of its own, and relaunches it directly
when the key comes back. The key is finer than Triton's specialisation, so equal keys always mean the
same compiled kernel: the dtype and 16-byte alignment of every tensor, the dtype and block shape of
every host-side tensor descriptor, the exact value and type of every scalar argument, every constexpr
and launch option, and the current device. A new key goes through `kernel[grid]` (which compiles if it
must) and records the result. `launch_fixed` does the same for a `FixedLaunch`, a kernel whose scalars,
constexprs and tensor dtypes a caller has fixed once (a decode plan): its key is that object, the device
and the tensors' alignment, so a launch hashes neither the scalars nor the constexprs and reads no dtype.

A relaunch passes tensors as their addresses (ints), which Triton's launcher takes as they are, and calls
the compiled launcher itself, without launch metadata or hooks, and past the Python wrapper that Triton
3.6 puts in front of it for kernels with host-side TMA descriptors (which encodes every descriptor on every
launch: here each encoding is kept per address and layout, `_descriptor_launcher`). That launcher's
argument order and closure are Triton's private layout, read from Triton 3.6.0: the relaunch runs only on
the versions in FAST_LAUNCH_VERSIONS (the GPU tests check there that it gives the bits of Triton's own
launch), and every launch goes through `kernel[grid]` on any other version, under the interpreter, and
when FLASHTILE_FAST_LAUNCH=0 is set in the environment when flashtile is imported.

Contract of a kernel launched this way: its parameters are the tensors first, then the scalars, then
the constexprs (passed by keyword; a constexpr left out takes its default). An object without the JIT
function's `fn` (a test's stand-in that wraps a kernel) is launched through `[grid]` every time.
Triton's launch hooks (`knobs.runtime.launch_enter_hook`, used by profilers) are honoured: with a hook
installed, relaunches go through `compiled[grid]` with the tensors, as Triton's own relaunch does.
Triton's debug knobs are read when a key is first seen.

A kernel that Triton or ptxas cannot compile (or whose first launch fails) raises KernelCompileError, which
names the kernel, its tile and launch options and the grid.
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton
from triton.errors import TritonError
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import KernelCompileError
from .configs import interpreting

# keys are per distinct call shape; a process that sees more than this many starts over
MAX_ENTRIES = 4096
# encoded TMA descriptors kept per compiled kernel (one per address and layout of a tensor it streams)
MAX_ENCODED_DESCRIPTORS = 1024

# Triton releases whose compiled launcher was read and whose relaunch is tested on the GPU (module docstring)
FAST_LAUNCH_VERSIONS = ("3.6.0",)
FAST_LAUNCH_SWITCH = "FLASHTILE_FAST_LAUNCH"
# the constexprs and launch options that name a kernel's tile in KernelCompileError
TILE_OPTIONS = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "BLOCK_S", "num_warps", "num_stages", "maxnreg",
                "USE_TMA", "WARP_SPECIALIZE")


def fast_launch_enabled(version: str | None = None, environ=None) -> bool:
    """Whether relaunches skip Triton's binder: only on a Triton release in FAST_LAUNCH_VERSIONS, and not where
    FLASHTILE_FAST_LAUNCH is 0 (or false, off, no)."""
    switch = (os.environ if environ is None else environ).get(FAST_LAUNCH_SWITCH, "1").strip().lower()
    return (version or triton.__version__) in FAST_LAUNCH_VERSIONS and switch not in ("0", "false", "off", "no")


FAST_LAUNCH = fast_launch_enabled()


_compiled: dict = {}


@dataclass(frozen=True, eq=False)
class FixedLaunch:
    """A kernel with its scalar arguments and constexprs / launch options fixed, for `launch_fixed`.

    Compared and hashed by identity: whoever builds one keeps it for as long as the scalars hold (a
    decode plan per validated layout), and every relaunch finds its compiled kernel by that identity.
    Its tensor arguments are plain torch tensors whose dtypes are fixed with it (the layout fixes them), so
    a relaunch keys on the tensors' 16-byte alignment only."""

    kernel: Any
    scalars: tuple
    options: dict


def _descriptor_types() -> tuple[type, ...]:
    """The host-side tensor descriptor classes: Triton's, and Gluon's where this Triton has Gluon."""
    from . import gluon_compat

    return (TensorDescriptor, gluon_compat.TensorDescriptor) if gluon_compat.AVAILABLE else (TensorDescriptor,)


DESCRIPTOR_TYPES = _descriptor_types()


def _keys_and_arguments(tensors: tuple) -> tuple[tuple, list]:
    """The key part of each tensor (a tensor's dtype and 16-byte alignment, a descriptor's dtype, block shape
    and shared-memory layout, which a Gluon descriptor carries) and what the launcher is given for it: a tensor's
    address as an int, a descriptor as it is."""
    keys, arguments = [], []
    for t in tensors:
        if isinstance(t, DESCRIPTOR_TYPES):
            keys.append((t.base.dtype, tuple(t.block_shape), getattr(t, "layout", None)))
            arguments.append(t)
        else:
            address = t.data_ptr()
            keys.append((t.dtype, address % 16 == 0))
            arguments.append(address)
    return tuple(keys), arguments


def _device() -> int:
    # Triton loads and launches a compiled kernel on the current device (not the tensors')
    return torch.cuda.current_device()


def _value_key(kernel, device: int, tensor_keys: tuple, scalars: tuple, options: dict) -> tuple:
    return id(kernel), device, tensor_keys, scalars, tuple(map(type, scalars)), tuple(options.items())


def launch_key(kernel, tensors: tuple, scalars: tuple, options: dict) -> tuple:
    """The key under which `launch` keeps the compiled kernel for these arguments (see the module docstring)."""
    return _value_key(kernel, _device(), _keys_and_arguments(tensors)[0], scalars, options)


def _constexpr_tail(kernel, positional: int, options: dict) -> tuple:
    """The values of the kernel's parameters after the positional ones, in signature order (defaults filled)."""
    tail = []
    for param in list(inspect.signature(kernel.fn).parameters.values())[positional:]:
        if "constexpr" not in str(param.annotation):
            raise TypeError(f"{kernel.fn.__name__}: parameter {param.name} after the tensors and scalars is not a "
                            "constexpr; relaunch.launch needs tensors, scalars, then constexprs")
        tail.append(options[param.name] if param.name in options else param.default)
    return tuple(tail)


def _kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or type(kernel).__name__


def _first_launch(kernel, grid: tuple, args: tuple, options: dict):
    """Triton's own launch (binding, compiling if needed); returns the compiled kernel. A failure of Triton's
    (a compiler or ptxas error, too little shared memory, a failed launch) becomes a KernelCompileError."""
    try:
        return kernel[grid](*args, **options)
    except (TritonError, RuntimeError) as error:
        if isinstance(error, KernelCompileError) or not (isinstance(error, TritonError) or "Triton" in str(error)):
            raise
        tile = ", ".join(f"{name}={options[name]}" for name in TILE_OPTIONS if name in options)
        first_line = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise KernelCompileError(f"flashtile could not compile or launch {_kernel_name(kernel)} ({tile}; grid "
                                 f"{tuple(grid)}) with Triton {triton.__version__}: {first_line[:500]}") from error


def _hooked() -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps them in HookChains, older versions None or a callable)."""
    runtime = triton.knobs.runtime
    return any(hook is not None and getattr(hook, "calls", True) for hook in
               (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _stream_getter() -> Callable[[int], int]:
    # the function Triton's own launch asks for the current stream (torch's raw stream on NVIDIA)
    return triton.runtime.driver.active.get_current_stream


def _tensor_map_encoder() -> tuple[Callable, dict]:
    """Triton 3.6's CUtensorMap encoder and its map from the kernel's element-type codes to the driver's."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    return triton.runtime.driver.active.utils.fill_tma_descriptor, TMA_DTYPE_DEVICE_TO_HOST


def _descriptor_launcher(launcher) -> tuple[Callable, Callable[[tuple], list]] | None:
    """For Triton 3.6's launcher of a kernel with host-side tensor descriptors: the compiled launcher it wraps and
    a function that turns our arguments into that launcher's, or None (no descriptors, or a wrapper of another
    shape: then `launcher` is called as it is).

    Triton 3.6 wraps the compiled launcher of such a kernel in a Python function that walks every argument and
    encodes each descriptor into a CUtensorMap on every launch. The encoding is a pure function of the tensor's
    address, shape and strides and of the kernel's box, swizzle and element type, so it is kept here under
    exactly those values (a tensor freed and another allocated at its address with the same layout has the same
    map), and each launch only looks the maps up. The compiled launcher reads the map's bytes into the launch's
    parameters, so one map can serve any number of launches.
    """
    free = dict(zip(getattr(getattr(launcher, "__code__", None), "co_freevars", ()),
                    (cell.cell_contents for cell in getattr(launcher, "__closure__", None) or ())))
    compiled_launcher, positions, metas = (free.get(name) for name in
                                           ("launcher", "tensordesc_indices", "tensordesc_meta"))
    if (compiled_launcher is None or not positions or not metas or len(metas) != len(positions)
            or any(meta is None or meta.get("fp4_padded") for meta in metas)):
        return None  # no descriptors, descriptors lowered to pointers, or packed fp4: Triton's own wrapper
    encode, host_element_type = _tensor_map_encoder()
    # (position, swizzle, element size, host element type, box) in signature order, the order of the metadata;
    # spliced last to first, so that each position still counts the arguments before it
    plans = [(position, meta["swizzle"], meta["elem_size"], host_element_type[meta["elem_type"]],
              meta["block_size"]) for position, meta in zip(sorted(positions), metas)][::-1]
    encoded: dict = {}

    def expand(arguments: tuple) -> list:
        arguments = list(arguments)
        for position, swizzle, element_size, element_type, box in plans:
            descriptor = arguments[position]
            address = descriptor.base.data_ptr()
            key = (position, address, *descriptor.shape, *descriptor.strides, descriptor.padding)
            expanded = encoded.get(key)
            if expanded is None:
                if len(encoded) >= MAX_ENCODED_DESCRIPTORS:
                    encoded.clear()
                tensor_map = encode(address, swizzle, element_size, element_type, box, descriptor.shape,
                                    descriptor.strides, int(descriptor.padding == "nan"))
                expanded = encoded[key] = (tensor_map, *descriptor.shape, *descriptor.strides)
            arguments[position:position + 1] = expanded
        return arguments

    return compiled_launcher, expand


def _hookless_launcher(compiled) -> Callable | None:
    """A function (grid, device, arguments) that launches `compiled` with no launch metadata or hooks through its
    compiled launcher (Triton 3.6's layout, module docstring), or None where `compiled` does not have that
    layout (a test's recorder) or needs scratch memory, which Triton's own launch allocates: those relaunch
    through compiled[grid]."""
    run, function, metadata = (getattr(compiled, name, None) for name in ("run", "function", "packed_metadata"))
    launcher = getattr(run, "launch", None)
    if (launcher is None or function is None or metadata is None or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0):
        return None
    stream_of = _stream_getter()
    cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
    unwrapped = _descriptor_launcher(launcher)
    if unwrapped is not None:
        compiled_launcher, expand = unwrapped

        def launch_encoded(grid, device, arguments):
            compiled_launcher(grid[0], grid[1], grid[2], stream_of(device), function, cooperative, pdl, None,
                              None, metadata, None, None, None, *expand(arguments))
        return launch_encoded

    def launch_direct(grid, device, arguments):
        launcher(grid[0], grid[1], grid[2], stream_of(device), function, cooperative, pdl, None, None, metadata,
                 None, None, None, *arguments)
    return launch_direct


def _launch_keyed(key, kernel, grid: tuple, tensors: tuple, tensor_arguments: list, scalars: tuple, options: dict,
                  device: int) -> None:
    entry = _compiled.get(key)
    if entry is None:
        compiled = _first_launch(kernel, grid, (*tensors, *scalars), options)
        if getattr(kernel, "fn", None) is None:
            return  # a stand-in without a Python function behind it (tests' recorders): launched through itself
        if len(_compiled) >= MAX_ENTRIES:
            _compiled.clear()
        _compiled[key] = (compiled, _constexpr_tail(kernel, len(tensors) + len(scalars), options),
                          _hookless_launcher(compiled))
        return
    compiled, tail, hookless = entry
    if len(grid) != 3:  # the launchers take three (decode plans keep theirs as three)
        grid = tuple(grid) + (1,) * (3 - len(grid))
    if hookless is not None and not _hooked():
        hookless(grid, device, (*tensor_arguments, *scalars, *tail))
    else:
        compiled[grid](*tensors, *scalars, *tail)


def launch(kernel, grid: tuple, tensors: tuple, scalars: tuple, **options) -> None:
    """kernel[grid](*tensors, *scalars, **options), relaunching the compiled kernel when the key is known.

    tensors: torch tensors and host-side TensorDescriptors (the kernel's leading parameters); scalars:
    ints, floats and bools (the next ones); options: the constexprs by name and Triton's launch options
    (num_warps, num_stages). grid: up to three ints. Raises KernelCompileError where the kernel does not compile.
    """
    if interpreting() or not FAST_LAUNCH:
        _first_launch(kernel, grid, (*tensors, *scalars), options)
        return
    device = _device()
    tensor_keys, tensor_arguments = _keys_and_arguments(tensors)
    _launch_keyed(_value_key(kernel, device, tensor_keys, scalars, options), kernel, grid, tensors, tensor_arguments,
                  scalars, options, device)


def launch_fixed(fixed: FixedLaunch, grid: tuple, tensors: tuple) -> None:
    """launch(fixed.kernel, grid, tensors, fixed.scalars, **fixed.options), keyed by `fixed` itself, the device
    and the tensors' alignment (their dtypes are fixed with `fixed`). grid: up to three ints."""
    if interpreting() or not FAST_LAUNCH:
        _first_launch(fixed.kernel, grid, (*tensors, *fixed.scalars), fixed.options)
        return
    device = _device()
    addresses = [t.data_ptr() for t in tensors]
    # Triton specialises each pointer on 16-byte alignment; one check covers the usual case, all aligned
    alignment = True if not functools.reduce(operator.or_, addresses) & 15 else tuple(a & 15 == 0 for a in addresses)
    # the key holds `fixed`, so its identity cannot be reused while the entry lives
    _launch_keyed((fixed, device, alignment), fixed.kernel, grid, tensors, addresses, fixed.scalars, fixed.options,
                  device)
