"""The Gluon names the Hopper forward uses, for every Triton release flashtile supports.

Gluon (`triton.experimental.gluon`) is Triton's explicit-layout dialect; its API still moves between releases.
The kernels import the few names that differ from here instead of carrying copies per release:

- TMA copies: triton 3.6 names them `async_copy_global_to_shared` / `async_copy_shared_to_global`; newer releases
  call them `async_load` / `async_store` and keep the old names as deprecated aliases.
- `gl.warp_specialize(functions_and_args, worker_num_warps, worker_num_regs)`: the register list is required in
  3.6 and optional later; the kernels always pass it (it becomes `setmaxnreg`).
- The barrier of one partition's warps: `gl.thread_barrier()` in 3.6, `gl.barrier()` in newer releases.
- TMA reduce-add of a shared-memory tile into global memory (`cp.reduce.async.bulk.tensor ... add`):
  `tma.async_atomic_add(desc, coord, src)` in newer releases; triton 3.6's Gluon has no Python wrapper for it, but its
  op builder has the same `create_async_tma_reduce(kind, desc, coord, src)`, so `tma_reduce_add` builds the op
  itself there. Like a TMA store it completes in the bulk-async group: `tma.store_wait` waits for it.

`AVAILABLE` is False where the installed Triton has no Gluon (or no Hopper module): the launcher then never picks
the Gluon forward, and `explain()` says why.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as error:  # a Triton without Gluon: the Triton kernels still run
    AVAILABLE = False
    UNAVAILABLE_REASON = f"this Triton has no Gluon for Hopper ({error})"
else:
    AVAILABLE = True
    UNAVAILABLE_REASON = ""
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    if hasattr(tma, "async_atomic_add"):
        tma_reduce_add = tma.async_atomic_add
    else:
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """Add the shared-memory tile `src` into the global tile of `tensor_desc` at `coord` by TMA (a bulk
            asynchronous reduce; `tma.store_wait` waits for it to have read `src`)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

__all__ = ["AVAILABLE", "UNAVAILABLE_REASON", "gluon", "gl", "fence_async_shared", "mbarrier", "tma", "tma_load",
           "tma_store", "tma_reduce_add", "thread_barrier", "warpgroup_mma", "warpgroup_mma_wait", "TensorDescriptor"]
