"""What `flashtile bench` compares, and whether each contender can run a given problem.

A provider computes attention on q, k, v in flash layout (batch, seqlen, heads, headdim) and returns
out in the same layout; providers built on torch's (batch, heads, seqlen, headdim) layout get
transposed views, never copies. Causal masks are bottom-right aligned (flash-attn's convention); the
benchmark grid has seqlen_q == seqlen_k, where torch's top-left alignment agrees with it.

Each provider answers three questions:
  - `unavailable_reason(problem)`: cheap checks before anything runs (not installed, wrong device,
    too little memory); None when it may run.
  - `prepare(problem)`: set-up outside the timed region (compiling, block masks, probing whether a
    forced backend accepts the problem); returns the forward function, or raises `ProviderSkip`.
  - `kernels_reason(kernels)`: whether the kernel names that executed show the run was not what was
    asked for (FlexAttention falling back to eager); None when they look right.

The contenders: one "flashtile[<backend>]" per flashtile backend (so a new backend shows up by
itself), "flashtile[triton:tma]" / "flashtile[triton:gluon]" / "flashtile[triton:tma-ws]" / "flashtile[triton:bwd0]" ...
"flashtile[triton:bwd3]"
with a Triton forward schedule or a backward schedule forced (two or one launch, pointer or TMA loads; only when named),
torch SDPA with each backend
forced ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math"), FlexAttention under torch.compile ("flex", CUDA only), naive materialised attention
("naive"), the optional packages flash-attn 2 ("flash_attn") and FlashAttention 4's CuTe-DSL
interface ("flash_attn.cute"), and the schedules of flashtile's registry ("schedule:fa1" ... "schedule:decode", only when
named or with `flashtile bench --schedules`).
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import flashtile
from flashtile import _dispatch
from flashtile._validate import prepare_flash_attn
from flashtile.errors import BackendUnavailableError
from flashtile.iomodel import AttentionShape, Cost, cost, fa1_forward_cost, tiled_cost

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# naive attention is skipped when its score matrix would take more than this much memory
NAIVE_CUDA_FREE_FRACTION = 0.4
NAIVE_CPU_LIMIT_BYTES = 4 * 2**30
# torch.compile recompiles flex_attention once per shape; the default limit (8) would be reached
# within one grid and then torch would run flex_attention eagerly, materialising the scores
FLEX_RECOMPILE_LIMIT = 1000


@dataclass(frozen=True)
class Problem:
    """One benchmark cell: the sizes (`shape`), the dtype and device of q, k and v, and the mode
    ("fwd", "bwd" or "fwd+bwd")."""

    shape: AttentionShape
    dtype: torch.dtype
    device: torch.device
    mode: str

    @property
    def needs_grad(self) -> bool:
        return self.mode != "fwd"


class ProviderSkip(Exception):
    """The provider cannot run this problem; the message says why."""


class Provider:
    """Base class: a named attention implementation. Subclasses set `name` and `io_model`
    ("tiled" or "materialised": which `flashtile.iomodel` accounting bounds its time)."""

    name: str
    io_model: str

    def unavailable_reason(self, problem: Problem) -> str | None:
        return None

    def prepare(self, problem: Problem) -> Forward:
        raise NotImplementedError

    def kernels_reason(self, kernels: list[str]) -> str | None:
        return None

    def io_cost(self, shape: AttentionShape, mode: str, element_bytes: int) -> Cost:
        """FLOPs and HBM bytes that bound this provider's time: `flashtile.iomodel.cost` of its io_model."""
        return cost(self.io_model, shape, mode, element_bytes)


class FlashtileProvider(Provider):
    """flashtile.flash_attn_func with one backend forced through flashtile.use_backend, and optionally
    one of the Triton schedules forced by name (otherwise the tile table chooses)."""

    io_model = "tiled"
    # named schedules: the tile settings each forces
    # tma-ws at the warp-specialized forward's fastest tiles (with the table's 8 warps triton 3.6 would not
    # specialize)
    SCHEDULES = {"tma": {"forward_schedule": 1},
                 "gluon": {"forward_schedule": 3},
                 "tma-ws": {"forward_schedule": 2, "block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 2},
                 "bwd0": {"backward_schedule": 0},
                 "bwd1": {"backward_schedule": 1},
                 "bwd2": {"backward_schedule": 2},
                 "bwd3": {"backward_schedule": 3}}

    def __init__(self, backend: str, schedule: str | None = None):
        self.backend, self.schedule = backend, schedule
        self.tiles = {} if schedule is None else self.SCHEDULES[schedule]
        self.name = f"flashtile[{backend}{'' if schedule is None else ':' + schedule}]"
        # the forced schedules are for comparing schedules; the default grid runs what users get
        self.in_default_grid = schedule is None

    def unavailable_reason(self, problem: Problem) -> str | None:
        s = problem.shape
        # zero-stride views describe the call to flashtile's validator without allocating the inputs
        q, k, v = (torch.empty(s.headdim, dtype=problem.dtype, device=problem.device).expand(
            s.batch, length, s.nheads, s.headdim) for length in (s.seqlen_q, s.seqlen_k, s.seqlen_k))
        call = prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=s.causal, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                  return_lse=False)
        reason = _dispatch.BACKENDS[self.backend].unavailable_reason(call.problem)
        if reason is None and "forward_schedule" in self.tiles and problem.device.type == "cuda" and \
                torch.cuda.get_device_capability(problem.device) < (9, 0):
            reason = "the TMA forward schedules need a GPU of compute capability 9.0 or newer"
        return reason

    def prepare(self, problem: Problem) -> Forward:
        backend, causal, tiles = self.backend, problem.shape.causal, self.tiles

        def forward(q, k, v):
            with flashtile.use_backend(backend, **tiles):
                return flashtile.flash_attn_func(q, k, v, causal=causal)

        return forward


def _probe_call(problem: Problem):
    """flashtile's validated call for `problem`, from zero-stride views (nothing allocated)."""
    s = problem.shape
    q, k, v = (torch.empty(s.headdim, dtype=problem.dtype, device=problem.device).expand(
        s.batch, length, s.nheads, s.headdim) for length in (s.seqlen_q, s.seqlen_k, s.seqlen_k))
    return prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=s.causal, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              return_lse=False)


class ScheduleProvider(Provider):
    """One schedule of flashtile's registry (flashtile.schedules(): fa1, fa2, fa3, fa4, decode) forced through
    use_backend("triton", schedule=name): `flashtile bench --schedules` runs them all on the same inputs. The decode
    schedule serves KV-cache calls: its rows attend the same q, k and v through flash_attn_with_kvcache with k and v
    as a full cache (forward only; `flashtile bench --mode decode` measures it at decoding shapes)."""

    NAMES = ("fa1", "fa2", "fa3", "fa4", "decode")
    # the forward kernel each schedule's rows must show (fa4 shares fa3's Gluon kernel, or where fa3 cannot serve the
    # call fa2's Triton kernels, by name: fa4 is those kernels compiled with its constexprs)
    FORWARD_KERNELS = {"fa1": ("attention_fwd_fa1_kernel",),
                       "fa2": ("attention_fwd_kernel", "attention_fwd_tma_kernel"),
                       "fa3": ("attention_fwd_gluon_kernel",),
                       "fa4": ("attention_fwd_gluon_kernel", "attention_fwd_kernel", "attention_fwd_tma_kernel"),
                       "decode": ("attention_decode_kernel", "attention_decode_combine_kernel")}
    # keys per FA1 block for the IO model: the FA1 kernel's default on a GPU (fwd_fa1.default_fa1_blocks)
    FA1_MODEL_BLOCK_N = 64

    def __init__(self, schedule: str):
        if schedule not in self.NAMES:
            raise ValueError(f"schedule must be one of {', '.join(self.NAMES)}, got {schedule!r}")
        self.schedule = schedule
        self.name = f"schedule:{schedule}"
        self.io_model = "tiled, O / m / l per key block" if schedule == "fa1" else "tiled"
        self.in_default_grid = False

    def unavailable_reason(self, problem: Problem) -> str | None:
        if self.schedule == "decode":
            if problem.mode != "fwd":
                return "the decode schedule serves flash_attn_with_kvcache, which has no backward"
            (record,) = [s for s in flashtile.schedules(problem.device, problem.dtype) if s.name == "decode"]
            return None if record.available else record.reason
        try:
            with flashtile.use_backend("triton", schedule=self.schedule):
                _dispatch.plan(_probe_call(problem).problem)
        except BackendUnavailableError as error:
            # the dispatcher's message names the schedule and the request; the row keeps the reason
            return str(error).split("cannot serve this call: ", 1)[-1]
        return None

    def prepare(self, problem: Problem) -> Forward:
        schedule, causal = self.schedule, problem.shape.causal

        def forward(q, k, v):
            with flashtile.use_backend("triton", schedule=schedule):
                if schedule == "decode":
                    # k and v as a full cache (no cache_seqlens, nothing appended): the same function, causal
                    # bottom-right as flash_attn_func
                    return flashtile.flash_attn_with_kvcache(q, k, v, causal=causal)
                return flashtile.flash_attn_func(q, k, v, causal=causal)

        return forward

    def kernels_reason(self, kernels: list[str]) -> str | None:
        ours = [name for name in kernels if name.startswith("attention_")]
        if ours and not any(name in self.FORWARD_KERNELS[self.schedule] for name in ours):
            return (f"schedule {self.schedule!r} should run {' or '.join(self.FORWARD_KERNELS[self.schedule])}, "
                    f"but the kernels were {', '.join(ours)}")
        return None

    def io_cost(self, shape: AttentionShape, mode: str, element_bytes: int) -> Cost:
        """The tiled model; for fa1 its forward also moves O, m and l through memory once per key block."""
        if self.schedule != "fa1":
            return tiled_cost(shape, mode, element_bytes)
        forward = fa1_forward_cost(shape, element_bytes, self.FA1_MODEL_BLOCK_N)
        if mode == "fwd":
            return forward
        backward = tiled_cost(shape, "bwd", element_bytes)
        return backward if mode == "bwd" else forward + backward


def schedule_providers() -> list[Provider]:
    """The registry's dense-call schedules, for `flashtile bench --schedules`."""
    return [ScheduleProvider(name) for name in ScheduleProvider.NAMES]


def _bhsd(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Flash layout (batch, seqlen, heads, dim) -> torch layout (batch, heads, seqlen, dim), as views."""
    return [t.transpose(1, 2) for t in tensors]


class SdpaProvider(Provider):
    """torch.nn.functional.scaled_dot_product_attention with one backend forced by sdpa_kernel."""

    def __init__(self, label: str, backend_name: str):
        self.name = f"sdpa-{label}"
        self.backend_name = backend_name  # a member of torch.nn.attention.SDPBackend
        self.io_model = "materialised" if label == "math" else "tiled"

    def unavailable_reason(self, problem: Problem) -> str | None:
        s = problem.shape
        if s.causal and s.seqlen_q != s.seqlen_k:
            return "SDPA's is_causal is top-left aligned; only seqlen_q == seqlen_k matches the other providers"
        return None

    def prepare(self, problem: Problem) -> Forward:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, self.backend_name)
        causal = problem.shape.causal

        def forward(q, k, v):
            q, k, v = _bhsd(q, k, v)
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return out.transpose(1, 2)

        self._probe(forward, problem)
        return forward

    def _probe(self, forward: Forward, problem: Problem) -> None:
        """Run the mode once at one batch and one head: a forced backend that does not support the
        problem (dtype, head dim, device, grad) raises there, and torch's warnings say why."""
        s = problem.shape
        q, k, v = (torch.randn(1, length, 1, s.headdim, dtype=problem.dtype, device=problem.device,
                               requires_grad=problem.needs_grad) for length in (s.seqlen_q, s.seqlen_k, s.seqlen_k))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = forward(q, k, v)
                if problem.needs_grad:
                    out.sum().backward()
            except RuntimeError as error:
                if isinstance(error, torch.OutOfMemoryError):
                    raise
                why = [str(w.message).strip() for w in caught]
                raise ProviderSkip(" ".join([f"torch refused SDPBackend.{self.backend_name}: {error}".strip()] + why)) \
                    from None


class FlexProvider(Provider):
    """torch.nn.attention.flex_attention.flex_attention under torch.compile (CUDA only).

    One compiled function serves every shape; torch.compile specialises it to each new shape
    (dynamic=False), which counts as a recompilation. The recompile limits are raised and hitting
    them is made an error, process-wide, so that flex never silently runs eagerly; `kernels_reason`
    checks the executed kernels as well.
    """

    name = "flex"
    io_model = "tiled"

    def unavailable_reason(self, problem: Problem) -> str | None:
        if problem.device.type != "cuda":
            return ("FlexAttention is benchmarked on CUDA only (elsewhere torch.compile does not generate the "
                    "Triton kernels that this row measures)")
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError as error:
            return f"torch {torch.__version__} has no FlexAttention: {error}"
        config = torch._dynamo.config
        missing = [n for n in ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")
                   if not hasattr(config, n)]
        if missing:
            return f"torch {torch.__version__} lacks torch._dynamo.config.{', '.join(missing)} (needed to forbid eager fallback)"
        return None

    def prepare(self, problem: Problem) -> Forward:
        from torch.nn.attention.flex_attention import create_block_mask

        s = problem.shape
        block_mask = None
        if s.causal:
            offset = s.seqlen_k - s.seqlen_q  # bottom-right alignment

            def bottom_right_causal(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + offset

            block_mask = create_block_mask(bottom_right_causal, B=None, H=None, Q_LEN=s.seqlen_q, KV_LEN=s.seqlen_k,
                                           device=problem.device)
        compiled = _compiled_flex_attention()

        def forward(q, k, v):
            q, k, v = _bhsd(q, k, v)
            return compiled(q, k, v, block_mask=block_mask).transpose(1, 2)

        return forward

    def kernels_reason(self, kernels: list[str]) -> str | None:
        # the compiled path runs Triton templates named after flex attention ("triton_tem_fused_..."); eager
        # flex_attention runs plain aten matmul/softmax kernels instead
        if any("flex" in name.lower() or "triton_tem" in name for name in kernels):
            return None
        return "fell back to eager"


@functools.cache
def _compiled_flex_attention():
    """flex_attention under torch.compile, created once per process, with recompiling made safe."""
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, FLEX_RECOMPILE_LIMIT)
    config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


class NaiveProvider(Provider):
    """softmax(Q K^T / sqrt(d)) V in the input dtype, materialising the scores (bottom-right causal)."""

    name = "naive"
    io_model = "materialised"

    def unavailable_reason(self, problem: Problem) -> str | None:
        s = problem.shape
        needed = s.batch * s.nheads * s.seqlen_q * s.seqlen_k * problem.dtype.itemsize
        matrix = f"the {s.batch}x{s.nheads}x{s.seqlen_q}x{s.seqlen_k} score matrix needs {needed / 2**30:.1f} GiB"
        if problem.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(problem.device)
            if needed > NAIVE_CUDA_FREE_FRACTION * free:
                return f"{matrix}, more than {NAIVE_CUDA_FREE_FRACTION:.0%} of the {free / 2**30:.1f} GiB free"
        elif needed > NAIVE_CPU_LIMIT_BYTES:
            return f"{matrix}, more than the {NAIVE_CPU_LIMIT_BYTES / 2**30:.0f} GiB allowed on the CPU"
        return None

    def prepare(self, problem: Problem) -> Forward:
        s = problem.shape
        future = None
        if s.causal:
            # key j is in query i's future iff j > i + (seqlen_k - seqlen_q)
            future = torch.ones(s.seqlen_q, s.seqlen_k, dtype=torch.bool, device=problem.device).triu(
                s.seqlen_k - s.seqlen_q + 1)
        scale = 1.0 / math.sqrt(s.headdim)

        def forward(q, k, v):
            q, k, v = _bhsd(q, k, v)
            scores = (q @ k.transpose(-1, -2)) * scale
            if future is not None:
                scores = scores.masked_fill(future, float("-inf"))
            return (scores.softmax(dim=-1) @ v).transpose(1, 2)

        return forward


class OptionalPackageProvider(Provider):
    """`flash_attn_func` from an optional package: flash-attn 2 ("flash_attn") or FlashAttention 4's
    CuTe-DSL interface ("flash_attn.cute"). Both take the flash layout and causal=...; FA4 returns
    (out, lse), FA2 returns out."""

    io_model = "tiled"

    def __init__(self, module: str):
        self.name = module
        self.module = module

    def _function(self):
        """The package's flash_attn_func, or a str saying why it cannot be had."""
        try:
            module = importlib.import_module(self.module)
        except ModuleNotFoundError as error:
            # the package itself missing (for flash_attn.cute: flash_attn or its cute part) is "not
            # installed"; a package that is there but misses one of its own dependencies is not
            parts = self.module.split(".")
            if error.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
                return "not installed"
            return f"import {self.module} failed: {error}"
        except ImportError as error:
            return f"import {self.module} failed: {error}"
        function = getattr(module, "flash_attn_func", None)
        if function is None:
            return f"{self.module} is installed but exposes no flash_attn_func"
        return function

    def unavailable_reason(self, problem: Problem) -> str | None:
        function = self._function()
        if isinstance(function, str):
            return function
        if problem.device.type != "cuda":
            return f"{self.module} runs on CUDA only"
        if problem.dtype not in (torch.float16, torch.bfloat16):
            return f"{self.module} supports fp16 and bf16 only"
        return None

    def prepare(self, problem: Problem) -> Forward:
        function = self._function()
        causal = problem.shape.causal

        def forward(q, k, v):
            out = function(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        return forward


def all_providers() -> list[Provider]:
    """Every contender, in the order of the table and the plot's legend."""
    providers: list[Provider] = [FlashtileProvider(name) for name in _dispatch.BACKENDS]
    providers += [FlashtileProvider("triton", schedule) for schedule in FlashtileProvider.SCHEDULES]
    providers += [SdpaProvider(label, backend) for label, backend in (
        ("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
        ("math", "MATH"))]
    providers += [FlexProvider(), NaiveProvider(), OptionalPackageProvider("flash_attn"),
                  OptionalPackageProvider("flash_attn.cute")]
    return providers + schedule_providers()


FAMILIES = {"flashtile": "flashtile[", "sdpa": "sdpa-", "schedules": "schedule:"}


def select_providers(names: list[str] | None) -> list[Provider]:
    """The providers named (each a provider name, or a family: "flashtile" = every flashtile backend and
    forced schedule, "sdpa" = every SDPA backend, "schedules" = the registry's schedule:fa1 ... schedule:decode), in
    `all_providers` order; None selects all but the forced schedules (flashtile[triton:tma], [triton:tma-ws],
    [triton:bwd0] ... [triton:bwd3], schedule:fa1 ... schedule:decode: name them to compare).

    Raises ValueError naming --providers and listing the known names for an unknown name.
    """
    providers = all_providers()
    if names is None:
        return [p for p in providers if getattr(p, "in_default_grid", True)]
    known = [p.name for p in providers]
    wanted = set()
    for name in names:
        if name in known:
            wanted.add(name)
        elif name in FAMILIES:
            wanted.update(p for p in known if p.startswith(FAMILIES[name]))
        else:
            raise ValueError(f"--providers: unknown provider {name!r}; known providers are {', '.join(known)} "
                             f"(or the families {', '.join(FAMILIES)})")
    return [p for p in providers if p.name in wanted]
