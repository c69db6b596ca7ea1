"""Run the benchmark grid: inputs, timing, accuracy, memory, executed kernels, and the run header.

Shapes follow the FlashAttention benchmark convention: `tokens_per_batch` tokens per batch
(batch = tokens_per_batch // seqlen, at least 1) and `model_width` = heads * headdim, with
seqlen_q = seqlen_k = seqlen. Inputs are torch.randn in the benchmark dtype, in flash layout
(batch, seqlen, heads, headdim), and every timed callable cycles through two input sets so that
caches do not hold the previous call's operands.

Each row (provider x shape x causal x mode) is measured as:
  - time: on CUDA the median of triton.testing.do_bench (which flushes L2 between runs), on the CPU
    the median of `flashtile._measure.median_time_ms`; after a warm-up;
  - accuracy: ||x - ref|| / ||ref|| and max |x - ref| against float64 attention on a sub-sample (batch 0,
    the first and last head, the last min(256, seqlen_q) query rows): of the output for "fwd", of dq for
    "bwd" and "fwd+bwd" (a query row's dq depends on that row alone, so the sub-sample is exact);
  - peak memory growth during one call, and the names of the kernels (CUDA) or heaviest aten
    operators (CPU) that one call executed.
A provider that cannot run a problem gives a "skipped" row with the reason; one that raises, or whose
kernels show it did not run what was asked, gives a "failed" row with the reason. The grid goes on.

The header records the machine, the versions, and two ceilings measured at start: a large matmul in
the benchmark dtype (TFLOP/s) and a device copy (GB/s, bytes read + written). Each row reports its
fraction of the matmul ceiling and of the roofline bound that `flashtile.iomodel` predicts from them, with
the HBM bytes that model counts for the row (the provider's `io_cost`; measured bytes need a hardware
profiler, which the bench does not run).

`make_config(schedules=True)` (`flashtile bench --schedules`) runs the schedules of flashtile's registry
(schedule:fa1 ... schedule:decode) instead of the peers, every one on the same inputs.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import flashtile
from flashtile._measure import median_time_ms, peak_memory_growth_bytes, timed_kernels
from flashtile.bench.providers import Forward, Problem, Provider, ProviderSkip, schedule_providers, select_providers
from flashtile.iomodel import MODES, AttentionShape, Roofline, benchmark_flops, datasheet_roofline
from flashtile.reference import attention_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CAUSAL_CHOICES = {"both": (False, True), "yes": (True,), "no": (False,)}
MAX_HEADDIM = 256
INPUT_SETS = 2
ORACLE_ROWS = 256
KERNELS_KEPT = 5
# timed ms above the profiler's GPU time of one call by more than this: the row is marked host-bound
HOST_BOUND_MARGIN = 0.10
SEED = 0


@dataclass(frozen=True)
class Timing:
    """How long each measurement runs: do_bench's warm-up and repetition budgets in milliseconds
    on CUDA; the number of timed calls after one warm-up call on the CPU."""

    warmup_ms: int
    rep_ms: int
    cpu_repeats: int

    def describe(self, device: torch.device) -> str:
        if device.type == "cuda":
            return (f"median of triton.testing.do_bench (warmup {self.warmup_ms} ms, rep {self.rep_ms} ms, L2 "
                    f"flushed), {INPUT_SETS} rotating input sets")
        return f"median of {self.cpu_repeats} calls after 1 warm-up, {INPUT_SETS} rotating input sets"


@dataclass(frozen=True)
class _GridDefaults:
    headdims: tuple[int, ...]
    seqlens: tuple[int, ...]
    modes: tuple[str, ...]
    tokens_per_batch: int
    model_width: int
    timing: Timing


DEFAULT_MAX_CALL_SECONDS = 2.0

_FULL = _GridDefaults(headdims=(64, 128), seqlens=(1024, 4096, 16384), modes=MODES, tokens_per_batch=16384,
                      model_width=2048, timing=Timing(warmup_ms=25, rep_ms=100, cpu_repeats=5))
# --quick: a CI-sized grid on the CPU; a minutes-sized smoke test on CUDA
_QUICK = {
    "cpu": _GridDefaults(headdims=(64,), seqlens=(256, 512), modes=("fwd", "fwd+bwd"), tokens_per_batch=1024,
                         model_width=256, timing=Timing(warmup_ms=5, rep_ms=20, cpu_repeats=3)),
    "cuda": _GridDefaults(headdims=(128,), seqlens=(1024, 4096), modes=("fwd", "fwd+bwd"), tokens_per_batch=16384,
                          model_width=2048, timing=Timing(warmup_ms=5, rep_ms=20, cpu_repeats=3)),
}
# --schedules on the CPU: the schedules are Triton kernels, run by Triton's interpreter there (about a second for
# a call of a few hundred tokens), so a tiny grid: one sequence of 32 tokens, 2 heads of 16
_SCHEDULES_CPU = _GridDefaults(headdims=(16,), seqlens=(32,), modes=("fwd", "fwd+bwd"), tokens_per_batch=32,
                               model_width=32, timing=Timing(warmup_ms=5, rep_ms=20, cpu_repeats=1))
SCHEDULES_CPU_REASON = ("--schedules: the schedules are Triton kernels, which run on CPU tensors only under Triton's "
                        "interpreter: set TRITON_INTERPRET=1 (its grid is tiny: d=16, N=32, one sequence of 2 heads; "
                        "explicit --headdim / --seqlens still win), or use --device cuda")


@dataclass(frozen=True)
class BenchConfig:
    """A validated grid: every (headdim, seqlen, causal, mode, provider) combination is one row."""

    device: torch.device
    dtype_name: str
    headdims: tuple[int, ...]
    seqlens: tuple[int, ...]
    causal: tuple[bool, ...]
    modes: tuple[str, ...]
    providers: tuple[Provider, ...]
    tokens_per_batch: int
    model_width: int
    timing: Timing
    quick: bool
    # a provider whose single call takes longer is skipped with that reason (None: no limit): a
    # float32 reference path at 16k tokens would otherwise hold the grid for minutes per row
    max_call_seconds: float | None = DEFAULT_MAX_CALL_SECONDS

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    def shape(self, headdim: int, seqlen: int, causal: bool) -> AttentionShape:
        return AttentionShape(batch=max(1, self.tokens_per_batch // seqlen), nheads=max(1, self.model_width // headdim),
                              seqlen_q=seqlen, seqlen_k=seqlen, headdim=headdim, causal=causal)

    @property
    def row_count(self) -> int:
        return len(self.headdims) * len(self.seqlens) * len(self.causal) * len(self.modes) * len(self.providers)


def int_list(text: str, argument: str, low: int, high: int | None) -> tuple[int, ...]:
    values = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            raise ValueError(f"{argument}: {item.strip()!r} is not an integer (expected a comma-separated list, "
                             f"e.g. {argument} 64,128)") from None
        if value < low or (high is not None and value > high):
            rule = f"in {low}..{high}" if high is not None else f">= {low}"
            raise ValueError(f"{argument}: {value} is not {rule}")
        values.append(value)
    return tuple(dict.fromkeys(values))


def make_config(*, device: str | None = None, dtype: str | None = None, headdim: str | None = None,
                seqlens: str | None = None, causal: str = "both", mode: str | None = None,
                providers: str | None = None, quick: bool = False,
                max_call_seconds: str | float | None = None, schedules: bool = False) -> BenchConfig:
    """Validate the command line's values (strings as typed, None = default) into a BenchConfig.

    Defaults: device cuda when available, else cpu; dtype bf16 on cuda, fp32 on cpu; the FlashAttention
    grid (head dims 64,128; seqlens 1024,4096,16384; all modes; 16384 tokens, width 2048), or with
    quick=True a small one (see `_QUICK`). Values given explicitly win over --quick's.
    max_call_seconds: rows whose single call takes longer are skipped with that reason (default
    DEFAULT_MAX_CALL_SECONDS; 0 means no limit).
    schedules: run the registry's schedules (providers.schedule_providers) instead of the providers; on the CPU
    only under Triton's interpreter (TRITON_INTERPRET=1), on a tiny grid (_SCHEDULES_CPU) unless given one.
    Raises ValueError naming the argument for any bad value, --schedules with --providers, and --schedules on the
    CPU without the interpreter.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device: {device!r} is not one of cuda, cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: cuda was asked for, but torch {torch.__version__} sees no CUDA device")
    if dtype is None:
        dtype = "bf16" if device == "cuda" else "fp32"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if causal not in CAUSAL_CHOICES:
        raise ValueError(f"--causal: {causal!r} is not one of {', '.join(CAUSAL_CHOICES)}")
    defaults = _QUICK[device] if quick else _FULL
    if schedules:
        if providers is not None:
            raise ValueError("--schedules runs the registry's schedules; it cannot be combined with --providers "
                             "(name schedule:fa1 ... schedule:decode in --providers instead)")
        if device == "cpu":
            from flashtile.triton.configs import interpreting

            if not interpreting():
                raise ValueError(SCHEDULES_CPU_REASON)
            defaults = _SCHEDULES_CPU
    modes = defaults.modes
    if mode is not None:
        modes = tuple(dict.fromkeys(m.strip() for m in mode.split(",")))
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise ValueError(f"--mode: {unknown[0]!r} is not one of {', '.join(MODES)}")
    names = None if providers is None else [p.strip() for p in providers.split(",")]
    return BenchConfig(
        device=torch.device(device), dtype_name=dtype,
        headdims=defaults.headdims if headdim is None else int_list(headdim, "--headdim", 1, MAX_HEADDIM),
        seqlens=defaults.seqlens if seqlens is None else int_list(seqlens, "--seqlens", 1, None),
        causal=CAUSAL_CHOICES[causal], modes=modes,
        providers=tuple(schedule_providers() if schedules else select_providers(names)),
        tokens_per_batch=defaults.tokens_per_batch, model_width=defaults.model_width, timing=defaults.timing,
        quick=quick, max_call_seconds=seconds_limit(max_call_seconds))


def seconds_limit(value: str | float | None) -> float | None:
    """--max-call-seconds as typed: None gives DEFAULT_MAX_CALL_SECONDS, 0 gives None (no limit)."""
    if value is None:
        return DEFAULT_MAX_CALL_SECONDS
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--max-call-seconds: {value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"--max-call-seconds: {value!r} must be >= 0 (0 = no limit)")
    return seconds or None


@dataclass
class Row:
    """One measurement. `status` is "ok", "skipped" or "failed" (with `reason`). Units: ms per call,
    TFLOP/s by `flashtile.iomodel.benchmark_flops`, fractions of the matmul ceiling and of the
    roofline bound (predicted / measured time, by `io_model`), `io_bytes` the HBM bytes that model counts, peak
    memory growth in MiB, `rel_error` and `max_abs_error` of `error_of` ("out" or "dq") against float64 on the
    sub-sample. On a GPU, `kernel_ms` is the device time of
    one call's work from the profiler (kernels, copies and memsets summed): a row whose `ms` exceeds it by
    more than HOST_BOUND_MARGIN waited on the host (see `host_bound`)."""

    provider: str
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    causal: bool
    mode: str
    dtype: str
    status: str = "ok"
    reason: str | None = None
    ms: float | None = None
    tflops: float | None = None
    matmul_fraction: float | None = None
    roofline_fraction: float | None = None
    io_model: str | None = None
    peak_mib: float | None = None
    rel_error: float | None = None
    error_of: str | None = None
    kernels: list[str] = field(default_factory=list)
    kernel_ms: float | None = None
    max_abs_error: float | None = None
    io_bytes: float | None = None

    @property
    def host_bound(self) -> bool:
        """The timed call took longer than its GPU work by more than HOST_BOUND_MARGIN: do_bench times from
        an event recorded before the call is issued, so when issuing it from Python takes longer than the GPU
        has queued, the GPU idles inside the measurement and TFLOP/s describe the host, not the kernels."""
        if self.ms is None or self.kernel_ms is None:
            return False
        return self.ms > self.kernel_ms * (1 + HOST_BOUND_MARGIN)


@dataclass(frozen=True)
class Ceilings:
    """What the device reaches at start: a dense `matmul_size`^3 matmul in the benchmark dtype
    (TFLOP/s) and a device-to-device copy of `copy_bytes` bytes (GB/s counting bytes read + written)."""

    matmul_tflops: float
    matmul_size: int
    copy_gbps: float
    copy_bytes: int

    def roofline(self) -> Roofline:
        return Roofline(peak_flops=self.matmul_tflops * 1e12, bandwidth=self.copy_gbps * 1e9,
                        source="measured at start")


@dataclass
class BenchResult:
    header: dict
    rows: list[Row]


@dataclass(frozen=True)
class InputSet:
    """q, k, v and the output gradient dout, in flash layout (batch, seqlen, heads, headdim)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor


def make_input_sets(shape: AttentionShape, dtype: torch.dtype, device: torch.device, requires_grad: bool,
                    count: int = INPUT_SETS) -> list[InputSet]:
    """`count` independent sets of random inputs (standard normal, never zeros: zeros run faster)."""
    def randn(seqlen: int, grad: bool) -> torch.Tensor:
        return torch.randn(shape.batch, seqlen, shape.nheads, shape.headdim, dtype=dtype, device=device,
                           requires_grad=grad)

    return [InputSet(randn(shape.seqlen_q, requires_grad), randn(shape.seqlen_k, requires_grad),
                     randn(shape.seqlen_k, requires_grad), randn(shape.seqlen_q, False)) for _ in range(count)]


def build_step(forward: Forward, sets: list[InputSet], mode: str) -> tuple[Callable[[], object], Callable[[], torch.Tensor]]:
    """(timed, checked) for one mode: timed() runs one call, cycling through the input sets;
    checked() runs one call on the first set and returns what is compared with float64: out for
    "fwd", dq for "bwd" and "fwd+bwd".

      fwd      forward(q, k, v) without autograd
      bwd      torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), out computed here, once per set
      fwd+bwd  forward, then that backward, each call
    """
    turn = itertools.cycle(range(len(sets)))
    if mode == "fwd":
        detached = [(s.q.detach(), s.k.detach(), s.v.detach()) for s in sets]
        return (lambda: forward(*detached[next(turn)])), (lambda: forward(*detached[0]))
    if mode == "bwd":
        outs = [forward(s.q, s.k, s.v) for s in sets]

        def backward(i: int):
            s = sets[i]
            return torch.autograd.grad(outs[i], (s.q, s.k, s.v), s.dout, retain_graph=True)

        return (lambda: backward(next(turn))), (lambda: backward(0)[0])
    if mode == "fwd+bwd":
        def forward_backward(i: int):
            s = sets[i]
            return torch.autograd.grad(forward(s.q, s.k, s.v), (s.q, s.k, s.v), s.dout)

        return (lambda: forward_backward(next(turn))), (lambda: forward_backward(0)[0])
    raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")


@dataclass(frozen=True)
class Subsample:
    """Where results are checked: batch 0, query heads `heads`, query rows `row_start` .. seqlen_q - 1."""

    heads: tuple[int, ...]
    row_start: int

    @classmethod
    def of(cls, seqlen_q: int, nheads: int, max_rows: int = ORACLE_ROWS) -> Subsample:
        """The first and last head and the last min(max_rows, seqlen_q) rows."""
        return cls(heads=tuple(sorted({0, nheads - 1})), row_start=seqlen_q - min(max_rows, seqlen_q))

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, seqlen_q, nheads, dim) in flash layout -> (len(heads), rows, dim)."""
        return t[0, self.row_start:, list(self.heads)].transpose(0, 1)


def subsample_reference(sub: Subsample, s: InputSet, causal: bool, with_dq: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 out (and dq when `with_dq`) on the sub-sample's rows, each (len(heads), rows, dim),
    computed on the inputs' device by `flashtile.reference.attention_reference`.

    Only the sub-sample's query rows enter the reference; keeping row r0 + i at its place relative to
    the keys needs diagonal_offset = (seqlen_k - seqlen_q) + r0 (bottom-right causal alignment).
    dq comes from float64 autograd through that reference, with the same rows of dout.
    """
    heads = list(sub.heads)
    q = sub.take(s.q.detach()).to(torch.float64).unsqueeze(0).requires_grad_(with_dq)
    k, v = (t.detach()[0:1, :, heads].transpose(1, 2).to(torch.float64) for t in (s.k, s.v))
    seqlen_q, seqlen_k = s.q.shape[1], s.k.shape[1]
    out, _ = attention_reference(q, k, v, window_size=(-1, 0) if causal else (-1, -1),
                                 diagonal_offset=(seqlen_k - seqlen_q) + sub.row_start)
    dq = None
    if with_dq:
        (dq,) = torch.autograd.grad(out, q, sub.take(s.dout).to(torch.float64).unsqueeze(0))
        dq = dq[0]
    return out.detach()[0], dq


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius norms, computed in float64)."""
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _time_ms(fn: Callable[[], object], device: torch.device, timing: Timing, warm: bool = False) -> float:
    """Median milliseconds of fn(); `warm` says fn already ran once, so the CPU skips its warm-up call
    (do_bench always warms up for its own budget)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median"))
    return median_time_ms(fn, device, repeats=timing.cpu_repeats, warmup=0 if warm else 1)


def call_limit_reason(fn: Callable[[], object], device: torch.device, limit: float | None) -> str | None:
    """Why fn is not timed: one call (device work included) takes over `limit` seconds; None otherwise."""
    if limit is None:
        return None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if seconds <= limit:
        return None
    return f"one call takes {seconds:.1f} s, over the limit of {limit:g} s per call (--max-call-seconds); not timed"


def measure_copy_gbps(device: torch.device, timing: Timing) -> tuple[float, int]:
    """(GB/s counting bytes read + written, bytes) of a device copy of a tensor larger than the caches
    (1 GiB on CUDA, 256 MiB on the CPU)."""
    source = torch.randn((2**30 if device.type == "cuda" else 2**28) // 4, device=device)
    target = torch.empty_like(source)
    copy_ms = _time_ms(lambda: target.copy_(source), device, timing)
    copy_bytes = 2 * source.numel() * source.element_size()
    return copy_bytes / (copy_ms * 1e-3) / 1e9, copy_bytes


def measure_ceilings(device: torch.device, dtype: torch.dtype, timing: Timing) -> Ceilings:
    """Time an n^3 matmul in `dtype` (n = 8192 on CUDA, 2048 on the CPU) and a device copy (measure_copy_gbps)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    matmul_ms = _time_ms(lambda: a @ b, device, timing)
    del a, b
    copy_gbps, copy_bytes = measure_copy_gbps(device, timing)
    return Ceilings(matmul_tflops=2 * n**3 / (matmul_ms * 1e-3) / 1e12, matmul_size=n, copy_gbps=copy_gbps,
                    copy_bytes=copy_bytes)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi, else the CUDA driver API version torch reports."""
    if shutil.which("nvidia-smi"):
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip().splitlines()[0]
    get_version = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get_version is not None:
        version = get_version()
        return f"CUDA driver API {version // 1000}.{version % 1000 // 10}"
    return None


def collect_header(config: BenchConfig, ceilings: Ceilings) -> dict:
    """The run's metadata: machine, versions, date, grid convention, timing method and ceilings."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = config.device.type == "cuda"
    name = torch.cuda.get_device_name(config.device) if cuda else _cpu_name()
    datasheet = datasheet_roofline(name) if cuda else None
    return {
        "device": config.device.type,
        "device_name": name,
        "driver": _driver_version() if cuda else None,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "flashtile": flashtile.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": config.dtype_name,
        "quick": config.quick,
        "tokens_per_batch": config.tokens_per_batch,
        "model_width": config.model_width,
        "seed": SEED,
        "timing": config.timing.describe(config.device),
        "max_call_seconds": config.max_call_seconds,
        "flops_convention": "forward 4*B*H*Sq*Sk*d (x0.5 causal); bwd 2.5x, fwd+bwd 3.5x the forward",
        "ceilings": dataclasses.asdict(ceilings),
        "datasheet": None if datasheet is None else {"peak_tflops": datasheet.peak_flops / 1e12,
                                                     "bandwidth_gbps": datasheet.bandwidth / 1e9,
                                                     "source": datasheet.source},
    }


class _Oracle:
    """float64 references on the sub-sample, computed once per input shape and causal setting."""

    def __init__(self, sets: list[InputSet], shape: AttentionShape):
        self.sets, self.sub = sets, Subsample.of(shape.seqlen_q, shape.nheads)
        self._cache: dict[bool, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def errors(self, value: torch.Tensor, causal: bool, of: str) -> tuple[float, float]:
        """(relative error, max abs error) of `value` (out or dq, per `of`) on the sub-sample."""
        if causal not in self._cache:
            self._cache[causal] = subsample_reference(self.sub, self.sets[0], causal,
                                                      with_dq=self.sets[0].q.requires_grad)
        out, dq = self._cache[causal]
        actual, expected = self.sub.take(value), out if of == "out" else dq
        return relative_error(actual, expected), (actual.double() - expected).abs().max().item()


def _measure_row(row: Row, provider: Provider, problem: Problem, sets: list[InputSet], oracle: _Oracle,
                 config: BenchConfig, roofline: Roofline, ceilings: Ceilings) -> None:
    """Fill `row` in place: skipped, failed, or every measurement."""
    reason = provider.unavailable_reason(problem)
    if reason is not None:
        row.status, row.reason = "skipped", reason
        return
    shape, device = problem.shape, problem.device
    try:
        timed, checked = build_step(provider.prepare(problem), sets, problem.mode)
        # the first call also warms up (and compiles, for flex)
        row.error_of = "out" if problem.mode == "fwd" else "dq"
        row.rel_error, row.max_abs_error = oracle.errors(checked(), shape.causal, row.error_of)
        if not math.isfinite(row.rel_error):
            row.status, row.reason = "failed", f"{row.error_of} has NaN or inf entries"
            row.rel_error = row.max_abs_error = None
            return
        too_slow = call_limit_reason(timed, device, config.max_call_seconds)
        if too_slow is not None:
            row.status, row.reason = "skipped", too_slow
            return
        row.ms = _time_ms(timed, device, config.timing, warm=True)
        peak = peak_memory_growth_bytes(timed, device)
        row.peak_mib = None if peak is None else peak / 2**20
        executed = timed_kernels(timed, device)
        # the profiler can report one kernel under two events; keep each name once
        row.kernels = list(dict.fromkeys(name for name, _ in executed[:2 * KERNELS_KEPT]))[:KERNELS_KEPT]
        if device.type == "cuda":
            row.kernel_ms = sum(microseconds for _, microseconds in executed) / 1e3
    except ProviderSkip as skip:
        row.status, row.reason = "skipped", str(skip)
        return
    except Exception as error:  # noqa: BLE001 - whatever a provider raises belongs in its row; the grid goes on
        row.status, row.reason = "failed", f"{type(error).__name__}: {error}"
        return
    seconds = row.ms * 1e-3
    row.tflops = benchmark_flops(shape, problem.mode) / seconds / 1e12
    row.matmul_fraction = row.tflops / ceilings.matmul_tflops
    row.io_model = provider.io_model
    io_cost = provider.io_cost(shape, problem.mode, problem.dtype.itemsize)
    row.io_bytes = io_cost.hbm_bytes
    row.roofline_fraction = roofline.predicted_seconds(io_cost) / seconds
    distrust = provider.kernels_reason(row.kernels)
    if distrust is not None:
        row.status, row.reason = "failed", distrust


def run_benchmark(config: BenchConfig, progress: Callable[[str], None] = lambda message: None,
                  on_row: Callable[[BenchResult], None] = lambda partial: None) -> BenchResult:
    """Measure the ceilings, then every row of the grid. `progress` receives one line before each
    step (the caller decides where it goes); `on_row` receives the result so far after each row
    (so a run cut short by a time limit still leaves its finished rows behind)."""
    device, dtype = config.device, config.dtype
    torch.manual_seed(SEED)
    progress(f"measuring ceilings on {device.type}: {config.dtype_name} matmul and device copy")
    ceilings = measure_ceilings(device, dtype, config.timing)
    header = collect_header(config, ceilings)
    roofline = ceilings.roofline()
    needs_grad = any(mode != "fwd" for mode in config.modes)
    rows: list[Row] = []
    for headdim, seqlen in itertools.product(config.headdims, config.seqlens):
        base = config.shape(headdim, seqlen, causal=False)
        sets = make_input_sets(base, dtype, device, requires_grad=needs_grad)
        oracle = _Oracle(sets, base)
        for causal, mode, provider in itertools.product(config.causal, config.modes, config.providers):
            shape = dataclasses.replace(base, causal=causal)
            row = Row(provider=provider.name, batch=shape.batch, heads=shape.nheads, seqlen_q=shape.seqlen_q,
                      seqlen_k=shape.seqlen_k, headdim=headdim, causal=causal, mode=mode, dtype=config.dtype_name)
            progress(f"[{len(rows) + 1}/{config.row_count}] {provider.name} d={headdim} N={seqlen} "
                     f"{'causal' if causal else 'non-causal'} {mode}")
            _measure_row(row, provider, Problem(shape, dtype, device, mode), sets, oracle, config, roofline, ceilings)
            rows.append(row)
            on_row(BenchResult(header=header, rows=rows))
            if device.type == "cuda":
                # return what the row's graphs and failures left cached, so the next row's memory
                # checks and peaks start from the same place
                torch.cuda.empty_cache()
        del sets, oracle  # free this shape's inputs before the next shape allocates its own
    return BenchResult(header=header, rows=rows)
