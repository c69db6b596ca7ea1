"""Launching a Triton kernel again without Triton's argument binder.

`kernel[grid](*args, **constexprs)` runs Triton's binder on every call: it classifies each argument
(pointer dtype and 16-byte alignment, integer value class, descriptor block shape), hashes the result
and looks the compiled kernel up. On the H200's host that costs ~20 us of the ~33 us a launch of a
36-argument kernel takes (BENCHMARKS.md, session 4: 13.1 us for the same compiled kernel relaunched
directly), and a 1k-token forward or a decode step is short enough to feel it.

`launch` keeps the compiled kernel Triton returned under a key of its own, and relaunches it directly
when the key comes back. The key is finer than Triton's specialisation, so equal keys always mean the
same compiled kernel: the dtype and 16-byte alignment of every tensor, the dtype and block shape of
every host-side tensor descriptor, the exact value and type of every scalar argument, every constexpr
and launch option, and the current device. A new key goes through `kernel[grid]` (which compiles if it
must) and records the result. Under the interpreter every call goes through Triton.

Contract of a kernel launched this way: its parameters are the tensors first, then the scalars, then
the constexprs (passed by keyword; a constexpr left out takes its default). An object without the JIT
function's `fn` (a test's stand-in that wraps a kernel) is launched through `[grid]` every time.
Triton's launch hooks (`knobs.runtime.launch_enter_hook`, used by profilers) are honoured as Triton's
own relaunch does; Triton's debug knobs are read when a key is first seen.
"""

from __future__ import annotations

import inspect

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import interpreting

# keys are per distinct call shape; a process that sees more than this many starts over
MAX_ENTRIES = 4096

_compiled: dict = {}


def _tensor_key(t) -> tuple:
    if isinstance(t, TensorDescriptor):
        return t.base.dtype, tuple(t.block_shape)
    return t.dtype, t.data_ptr() % 16 == 0


def _device() -> int:
    # Triton loads and launches a compiled kernel on the current device (not the tensors')
    return torch.cuda.current_device()


def launch_key(kernel, tensors: tuple, scalars: tuple, options: dict) -> tuple:
    """The key under which `launch` keeps the compiled kernel for these arguments (see the module docstring)."""
    return (id(kernel), _device(), tuple(map(_tensor_key, tensors)), scalars, tuple(map(type, scalars)),
            tuple(options.items()))


def _constexpr_tail(kernel, positional: int, options: dict) -> tuple:
    """The values of the kernel's parameters after the positional ones, in signature order (defaults filled)."""
    tail = []
    for param in list(inspect.signature(kernel.fn).parameters.values())[positional:]:
        if "constexpr" not in str(param.annotation):
            raise TypeError(f"{kernel.fn.__name__}: parameter {param.name} after the tensors and scalars is not a "
                            "constexpr; relaunch.launch needs tensors, scalars, then constexprs")
        tail.append(options[param.name] if param.name in options else param.default)
    return tuple(tail)


def _first_launch(kernel, grid: tuple, args: tuple, options: dict):
    """Triton's own launch (binding, compiling if needed); returns the compiled kernel."""
    return kernel[grid](*args, **options)


def launch(kernel, grid: tuple, tensors: tuple, scalars: tuple, **options) -> None:
    """kernel[grid](*tensors, *scalars, **options), relaunching the compiled kernel when the key is known.

    tensors: torch tensors and host-side TensorDescriptors (the kernel's leading parameters); scalars:
    ints, floats and bools (the next ones); options: the constexprs by name and Triton's launch options
    (num_warps, num_stages). grid: up to three ints.
    """
    if interpreting():
        kernel[grid](*tensors, *scalars, **options)
        return
    key = launch_key(kernel, tensors, scalars, options)
    entry = _compiled.get(key)
    if entry is None:
        compiled = _first_launch(kernel, grid, (*tensors, *scalars), options)
        if getattr(kernel, "fn", None) is None:
            return  # a stand-in without a Python function behind it (tests' recorders): launched through itself
        if len(_compiled) >= MAX_ENTRIES:
            _compiled.clear()
        _compiled[key] = (compiled, _constexpr_tail(kernel, len(tensors) + len(scalars), options))
        return
    compiled, tail = entry
    grid = tuple(grid) + (1,) * (3 - len(grid))
    compiled[grid](*tensors, *scalars, *tail)
