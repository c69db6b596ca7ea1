"""Timing, peak memory and "what actually ran", for the demo and the benchmark.

Time: median of repeated runs after warm-up (CUDA events on the GPU, a monotonic clock on the CPU).
Peak memory growth: on CUDA, torch's allocator peak above what was allocated before the call; on
the CPU, the process's peak resident set size above its resident size before the call (Linux
/proc/self/clear_refs resets the peak), which also counts memory that native kernels allocate
internally. What ran: the profiler's device kernels on CUDA, and the heaviest aten operators on
the CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import statistics
import sys
import time
from typing import Callable, Iterator

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in milliseconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"/proc/self/status has no {field}")
    return int(match.group(1))


@functools.cache
def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must exist (glibc)
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def _release_freed_memory() -> None:
    """Make resident size track live memory: glibc otherwise keeps freed blocks resident and
    raises its mmap threshold after each large free, hiding later allocations from the RSS."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, so large blocks are mmapped and unmapped on free
        libc.malloc_trim(0)


def cpu_peak_tracking_available() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM (the peak resident size) to the current resident size
        _proc_status_kib("VmHWM")
        return True
    except OSError:
        return False


def peak_memory_growth_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory above the level before fn() ran, in bytes; None where it cannot be measured."""
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu":
        return None
    _release_freed_memory()
    if not cpu_peak_tracking_available():
        return None
    before = _proc_status_kib("VmRSS")
    fn()
    return max(0, _proc_status_kib("VmHWM") - before) * 1024


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Hide the trace lines that the profiler's native library (kineto, torch 2.13) writes to fd 2
    at every start and stop, whatever its log level."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# names the profiler reports with device time that are its own bookkeeping, not work of the call
_PROFILER_ARTIFACTS = {"Activity Buffer Request"}


def timed_kernels(fn: Callable[[], object], device: torch.device) -> list[tuple[str, float]]:
    """(name, microseconds) of what one call of fn() executed, heaviest first: CUDA kernels with their
    device time on the GPU, the aten ops with their CPU time on the CPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with _native_stderr_silenced(), torch.profiler.profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.key_averages()
    if device.type == "cuda":
        candidates = [e for e in events if e.self_device_time_total > 0 and e.key not in _PROFILER_ARTIFACTS]
        # prefer device-side events (kernels, memsets) where the profiler labels them: the host operators
        # that enclose kernels also carry device time and would otherwise be listed beside them
        kernels = [e for e in candidates if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        timed = [(e.key, e.self_device_time_total) for e in (kernels or candidates)]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events if e.key.startswith("aten::")]
    return sorted(timed, key=lambda item: item[1], reverse=True)


def executed_kernels(fn: Callable[[], object], device: torch.device, limit: int = 3) -> list[str]:
    """Names of what fn() executed: CUDA kernels on the GPU, the heaviest aten ops on the CPU."""
    return [name for name, _ in timed_kernels(fn, device)[:limit]]
