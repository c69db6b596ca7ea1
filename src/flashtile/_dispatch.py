"""Backend selection: which implementation serves a call, with which tiles, and why.

The choice comes from, in order: the innermost `use_backend(...)` context, the environment
variables FLASHTILE_BACKEND (auto | torch | triton) and FLASHTILE_SCHEDULE (a schedule of the Triton
backend: fa1 | fa2 | fa3 | fa4 | decode; it implies triton), both read at every call, and "auto". A context
replaces the environment's request whole (its schedule too). `auto` picks the best backend available
for the tensors' device. A backend or schedule named explicitly that cannot serve the call raises
`BackendUnavailableError` saying why; nothing falls back silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from . import _schedules, torch_impl
from ._geometry import count_visited_tiles
from ._validate import AttentionProblem
from .errors import BackendUnavailableError
from .triton import configs as triton_configs

BACKEND_NAMES = ("torch", "triton")
ENV_VAR = "FLASHTILE_BACKEND"


@dataclass(frozen=True)
class _Request:
    name: str  # "auto" or one of BACKEND_NAMES
    source: str  # where the request came from, for explain()
    tile_overrides: dict[str, Any] = field(default_factory=dict)
    schedule: str | None = None  # a schedule forced on the triton backend (_schedules.SCHEDULE_NAMES)

    @functools.cached_property
    def key(self) -> tuple:
        """The request as a hashable value (overrides as sorted pairs), computed once per request object."""
        return self.name, self.source, tuple(sorted(self.tile_overrides.items())), self.schedule


_DEFAULT_REQUEST = _Request("auto", "default (auto)")


@functools.lru_cache(maxsize=64)
def _environment_request(value: str, schedule: str = "") -> _Request:
    # one request object per value of the variables, so that its key is built once (a decode step reads them every
    # call); an invalid value raises every time (lru_cache keeps no exceptions)
    value, schedule = value.strip(), schedule.strip()
    if not schedule:
        return _Request(_check_name(value.lower(), f"environment variable {ENV_VAR}"), f"{ENV_VAR}={value}")
    name = _schedules.check_schedule(schedule.lower(), f"environment variable {_schedules.SCHEDULE_ENV_VAR}")
    if value and value.lower() != "triton":
        raise ValueError(f"environment variable {_schedules.SCHEDULE_ENV_VAR} is {schedule!r}, a schedule of the "
                         f"'triton' backend, but {ENV_VAR} is {value!r}; unset {ENV_VAR} or set it to 'triton'")
    source = (f"{ENV_VAR}={value}, " if value else "") + f"{_schedules.SCHEDULE_ENV_VAR}={schedule}"
    return _Request("triton", source, schedule=name)


_context_request: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("flashtile_backend", default=None)


class TorchBackend:
    """The pure-PyTorch tiled path: runs on any device torch supports."""

    name = "torch"
    kernel = "flashtile.torch_impl (tiled online softmax, FA2 loop order, recompute backward)"
    tile_keys = ("block_q", "block_k")

    def unavailable_reason(self, problem: AttentionProblem) -> str | None:
        return None

    def check_tile_setting(self, key: str, value: int) -> None:
        if value < 1:
            raise ValueError(f"tile setting {key} must be a positive int, got {value}")

    def choose_tiles(self, problem: AttentionProblem, overrides: dict[str, Any],
                     schedule: str | None = None) -> torch_impl.TorchTiles:
        assert schedule is None, "schedules are the triton backend's (use_backend checks)"
        return dataclasses.replace(torch_impl.default_tiles(problem), **overrides)

    def describe_kernel(self, problem: AttentionProblem, tiles: torch_impl.TorchTiles) -> str:
        return f"{self.name!r} — {self.kernel}"

    def tiles_to_list(self, tiles: torch_impl.TorchTiles) -> list[int]:
        return [tiles.block_q, tiles.block_k]

    def tiles_from_list(self, values: Sequence[int]) -> torch_impl.TorchTiles:
        return torch_impl.TorchTiles(*values)

    def describe_tiles(self, problem: AttentionProblem, tiles: torch_impl.TorchTiles) -> str:
        if problem.paged:
            return (f"{tiles.describe(problem)}; per packed sequence, its keys gathered from the pages through its "
                    f"block-table row, then one dense pass (forward only)")
        if problem.varlen:
            return f"{tiles.describe(problem)}; one dense pass per packed sequence, tiles following its length"
        visited, masked, full = count_visited_tiles(problem, tiles.block_q, tiles.block_k)
        return (f"{tiles.describe(problem)}; {visited} of {full} tiles visited per (batch, K/V head) "
                f"({masked} with an element mask)")

    def forward(self, q, k, v, alibi_slopes, attn_mask, problem, tiles, cu_seqlens_q=None, cu_seqlens_k=None,
                learnable_sink=None, rng_state=None):
        if problem.varlen:
            return torch_impl.varlen_attention_forward(q, k, v, alibi_slopes, problem, tiles, cu_seqlens_q,
                                                       cu_seqlens_k, learnable_sink, rng_state)
        return torch_impl.attention_forward(q, k, v, alibi_slopes, attn_mask, problem, tiles, learnable_sink,
                                            rng_state)

    def describe_decode(self, call, tiles) -> str:
        splits = max(1, call.num_splits)
        return (f"flashtile.kvcache.attention_over_cache: one dense tiled pass per sequence and split "
                f"({splits} split(s); num_splits=0 means 1 here), {tiles.describe(call.problem)}")

    def append(self, call) -> None:
        """The KV-cache call's new tokens into its cache, rotated first when it has rotary tables: torch ops
        (kvcache.apply_rotary, then kvcache.append_to_cache) on any device."""
        from . import kvcache

        kvcache.apply_rotary(call)  # new copies of q and k; the caller's are untouched
        kvcache.append_to_cache(call)

    def decode(self, call, tiles, num_splits):
        from . import kvcache

        with torch.no_grad():  # the result carries no gradient (forward only)
            return kvcache.attention_over_cache(call, tiles, max(1, num_splits))  # splitting adds no parallelism here

    def paged_varlen_forward(self, call, tiles):
        from . import kvcache

        with torch.no_grad():  # forward only (prepare_flash_attn_varlen_paged refuses inputs that need gradients)
            return kvcache.paged_varlen_forward(call, tiles)

    def backward(self, grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask, problem, tiles,
                 cu_seqlens_q=None, cu_seqlens_k=None, learnable_sink=None, rng_state=None):
        """dq, dk, dv and the sink's gradient (None without a sink)."""
        if problem.varlen:
            return torch_impl.varlen_attention_backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes,
                                                        problem, tiles, cu_seqlens_q, cu_seqlens_k, learnable_sink,
                                                        rng_state)
        return torch_impl.attention_backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes,
                                             attn_mask, problem, tiles, learnable_sink, rng_state)


@functools.cache
def _triton_launch():
    # the kernels are defined (compiled or interpreted) on first use; an import statement in the methods cost
    # ~1 us a call (its from-list lookup), which a decode step feels
    from .triton import launch

    return launch


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The tensors' GPU as the current CUDA device while their kernels launch: Triton launches on the current
    device, and a model split across GPUs calls with tensors on another one. Nothing to do where it already is
    (or for CPU tensors under the interpreter)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class TritonBackend:
    """Fused Triton kernels: CUDA GPUs of compute capability 8.0 or newer; CPU tensors under TRITON_INTERPRET=1."""

    name = "triton"
    kernel = ("flashtile.triton: attention_fwd_kernel / attention_fwd_tma_kernel / attention_fwd_gluon_kernel "
              "(sm_90); backward "
              "attention_bwd_preprocess_kernel then attention_bwd_kernel (one launch), or attention_bwd_dq_kernel "
              "(which also computes delta) then attention_bwd_dkdv_kernel (two launches); KV cache "
              "kvcache_append_kernel (the new tokens, rotated with rotary tables) then attention_decode_kernel "
              "(+ attention_decode_combine_kernel when split)")
    tile_keys = triton_configs.TILE_KEYS

    def unavailable_reason(self, problem: AttentionProblem) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if problem.dtype == torch.float64:
            return "float64 is not supported by the Triton kernels (the 'torch' backend computes it)"
        if problem.device.type == "cuda":
            capability = torch.cuda.get_device_capability(problem.device)
            if capability < (8, 0):
                return f"the GPU has compute capability {capability}; the kernels need 8.0 or newer"
            return None
        if problem.device.type == "cpu":
            if triton_configs.interpreting():
                return None
            return "CPU tensors run the Triton kernels only under the interpreter (TRITON_INTERPRET=1, for testing)"
        return f"tensors on {problem.device.type} are not supported"

    def check_tile_setting(self, key: str, value: int) -> None:
        if key in triton_configs.FLAG_KEYS:
            if value not in (0, 1):
                raise ValueError(f"tile setting {key} must be 0 or 1, got {value}")
            return
        if key == "gluon_consumers":
            if value not in (1, 2, 3):
                raise ValueError(f"tile setting gluon_consumers must be 1, 2 or 3, got {value}")
            return
        if key == "gluon_exp2_emulated":
            if value not in (0, 2, 4, 8):
                raise ValueError(f"tile setting gluon_exp2_emulated must be 0, 2, 4 or 8, got {value}")
            return
        if key == "rescale_threshold":
            if not 0 <= value <= triton_configs.MAX_RESCALE_THRESHOLD:
                raise ValueError(f"tile setting rescale_threshold must be in 0..{triton_configs.MAX_RESCALE_THRESHOLD} "
                                 f"(base-2 units; probabilities reach 2^threshold, finite in fp16 up to 15), got "
                                 f"{value}")
            return
        if key == "exp2_poly_every":
            if value not in triton_configs.EXP2_POLY_CHOICES:
                raise ValueError(f"tile setting exp2_poly_every must be 0, 2, 4 or 8, got {value}")
            return
        if key == "gluon_block_n":
            if value not in (64, 128, 256):
                raise ValueError(f"tile setting gluon_block_n must be 64, 128 or 256, got {value}")
            return
        if key in triton_configs.ZERO_MEANS_DEFAULT and value == 0:
            return  # 0: the dQ kernel takes the dK/dV tile transposed (TritonTiles.dq_tile); no register cap
        if key.startswith(("block", "bwd_block", "dq_block")) and (value < 16 or value & (value - 1)):
            raise ValueError(f"tile setting {key} must be a power of two >= 16, got {value}")
        schedules = {"forward_schedule": triton_configs.FORWARD_SCHEDULES,
                     "backward_schedule": triton_configs.BACKWARD_SCHEDULES}.get(key)
        if schedules is not None:
            if value not in schedules:
                raise ValueError(f"tile setting {key} must be one of {sorted(schedules)}, got {value}")
        elif value < 1:
            raise ValueError(f"tile setting {key} must be a positive int, got {value}")

    def choose_tiles(self, problem: AttentionProblem, overrides: dict[str, Any],
                     schedule: str | None = None) -> triton_configs.TritonTiles:
        """The table's tiles for `problem`, or those of the forced `schedule`, with the caller's `overrides`."""
        capability = None if problem.device.type == "cpu" else torch.cuda.get_device_capability(problem.device)
        fa4_settings = [key for key in triton_configs.FA4_KEYS if key in overrides]
        if fa4_settings and schedule != "fa4":
            raise ValueError(f"tile settings {', '.join(fa4_settings)} belong to schedule 'fa4' (FlashAttention-4's "
                             f"moves); use use_backend('triton', schedule='fa4', ...), not schedule {schedule!r}")
        if overrides.get("exp2_poly_every") and problem.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"tile setting exp2_poly_every={overrides['exp2_poly_every']} needs fp16 or bf16 inputs, "
                             f"got {problem.dtype}: the cubic's relative error (1.0e-4) lies below the rounding of P "
                             "to 16 bits for its matmul, not below float32's; use exp2_poly_every=0")
        tiles = dataclasses.replace(self._schedule_tiles(problem, capability, schedule, overrides), **overrides)
        forced_forward = any(key in overrides for key in triton_configs.FORWARD_TILE_KEYS)
        if forced_forward and "forward_max_registers" not in overrides:
            # the table's register cap belongs to its own forward tile (two programs per SM at that tile)
            tiles = dataclasses.replace(tiles, forward_max_registers=0)
        forced_dq = any(key in overrides for key in triton_configs.DQ_TILE_KEYS)
        if forced_dq and "dq_max_registers" not in overrides:
            # likewise the table's dQ register cap belongs to its own dQ tile
            tiles = dataclasses.replace(tiles, dq_max_registers=0)
        if tiles.forward_schedule == 2 and tiles.forward_max_registers:
            raise ValueError("tile setting forward_max_registers cannot be combined with forward_schedule=2: "
                             "warp specialization sets each warp group's registers itself")
        if tiles.backward_one_launch:
            dq_settings = [key for key in triton_configs.DQ_KEYS if overrides.get(key)]
            if dq_settings:
                raise ValueError(f"tile settings {', '.join(dq_settings)} set the dQ kernel's tile or register cap, "
                                 f"which only the two-launch backward schedules (0, 2) have; backward_schedule is "
                                 f"{tiles.backward_schedule}")
            # the table's dQ tile belongs to its two-launch schedule: a forced one-launch schedule has none
            tiles = dataclasses.replace(tiles, **dict.fromkeys(triton_configs.DQ_KEYS, 0))
        return tiles

    @staticmethod
    def _schedule_tiles(problem: AttentionProblem, capability: tuple[int, int] | None, schedule: str | None,
                        overrides: dict[str, Any]) -> triton_configs.TritonTiles:
        """The table's tiles (schedule None), or the forced schedule's: fa2 the table without the Gluon forward
        (triton_configs.portable_tiles: forward schedule 1 on sm_90 for fp16 / bf16 up to d = 128, else 0), fa3 the
        table with forward schedule 3, fa1 the FA1 kernel's default blocks, fa4 fa2's tiles with FlashAttention-4's
        moves (triton_configs.fa4_tiles); decode the table (its kernels take their tile from the cache layout). The
        backward is the table's in every schedule."""
        if schedule is None:
            return triton_configs.default_tiles(problem, capability)
        forced = overrides.get("forward_schedule")
        if forced is not None and (schedule not in ("fa2", "fa4") or forced >= 3):
            raise ValueError(f"tile setting forward_schedule={forced} contradicts schedule {schedule!r}: "
                             "forward_schedule picks among the fa2 schedule's kernels (0, 1 or 2), which fa4 "
                             "shares")
        code = triton_configs.SCHEDULE_CODES[schedule]
        if schedule == "fa2":
            return dataclasses.replace(triton_configs.portable_tiles(problem, capability), forced_schedule=code)
        if schedule == "fa4":
            return dataclasses.replace(triton_configs.fa4_tiles(problem, capability), forced_schedule=code)
        tiles = dataclasses.replace(triton_configs.default_tiles(problem, capability), forced_schedule=code)
        if schedule == "fa3":
            return dataclasses.replace(tiles, forward_schedule=3)
        if schedule == "fa1":
            from .triton.fwd_fa1 import default_fa1_blocks  # defines the FA1 kernel: only when it is asked for

            block_m, block_n = default_fa1_blocks(problem.headdim, problem.headdim_v, problem.dtype)
            # one stage and no register cap: the FA1 launcher takes only blocks and warps
            return dataclasses.replace(tiles, block_m=block_m, block_n=block_n, num_warps=4, num_stages=1,
                                       forward_schedule=0, forward_max_registers=0, forward_separate_ragged_end=0)
        return tiles

    def describe_kernel(self, problem: AttentionProblem, tiles: triton_configs.TritonTiles) -> str:
        name = _schedules.running_schedule(problem, tiles)
        forced = " (forced)" if tiles.forced_schedule else ""
        if problem.paged:
            return (f"{self.name!r}, schedule {name!r}{forced} — forward attention_fwd_kernel with PAGED (keys "
                    f"through the block table); forward only")
        return f"{self.name!r}, schedule {name!r}{forced} — {_schedules.describe_kernels(name, problem.kvcache)}"

    def tiles_to_list(self, tiles: triton_configs.TritonTiles) -> list[int]:
        return list(dataclasses.astuple(tiles))

    def tiles_from_list(self, values: Sequence[int]) -> triton_configs.TritonTiles:
        return _triton_tiles(tuple(values))

    def describe_tiles(self, problem: AttentionProblem, tiles: triton_configs.TritonTiles) -> str:
        if problem.paged:
            return (f"{tiles.describe(problem)}; packed queries against paged K/V: attention_fwd_kernel with PAGED "
                    f"reads each key block through the block table (once per block where block_n divides the page "
                    f"size, once per key otherwise), forward only")
        if problem.varlen:
            return (f"{tiles.describe(problem)}; packed sequences: the grid covers max_seqlen rows of each "
                    f"sequence, at most {triton_configs.VARLEN_GRID_ROWS}, and each program visits only its "
                    f"sequence's blocks, looping over those past the grid")
        if tiles.forward_schedule == triton_configs.DECODE_FORWARD_SCHEDULE:
            return (f"{tiles.describe(problem)}; k and v as a full cache of {problem.seqlen_k} keys: "
                    f"{_triton_launch().decode_geometry(problem, None, 0).describe()}")
        block_m, block_n = tiles.block_m, tiles.block_n
        if tiles.forward_schedule == 3 and not triton_configs.gluon_unserved_reason(problem, tiles.gluon_tile):
            # the Gluon forward's own tile
            block_m, block_n = tiles.gluon_tile.block_m, triton_configs.gluon_block_n(problem, tiles.gluon_tile)
        visited, masked, full = count_visited_tiles(problem, block_m, block_n, aligned=True)
        return (f"{tiles.describe(problem)}; forward visits {visited} of {full} tiles per (batch, head) "
                f"({masked} with an element mask)")

    def forward(self, q, k, v, alibi_slopes, attn_mask, problem, tiles, cu_seqlens_q=None, cu_seqlens_k=None,
                learnable_sink=None, rng_state=None):
        with on_device(q.device):
            return _triton_launch().forward(q, k, v, alibi_slopes, attn_mask, problem, tiles, cu_seqlens_q,
                                            cu_seqlens_k, learnable_sink, rng_state)

    def describe_decode(self, call, tiles) -> str:
        return _triton_launch().decode_geometry(call.problem, call.page_size, call.num_splits).describe()

    def append(self, call) -> None:
        """The KV-cache call's new tokens into its cache by one launch of kvcache_append_kernel, which with rotary
        tables first rotates q (call.q becomes the rotated copy) and the new keys."""
        with on_device(call.q.device):
            _triton_launch().append_to_cache(call)

    def decode(self, call, tiles, num_splits):
        with on_device(call.q.device):
            return _triton_launch().decode(call, num_splits)

    def paged_varlen_forward(self, call, tiles):
        with on_device(call.q.device):
            return _triton_launch().paged_varlen_forward(call, tiles)

    def backward(self, grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask, problem, tiles,
                 cu_seqlens_q=None, cu_seqlens_k=None, learnable_sink=None, rng_state=None):
        """dq, dk, dv and the sink's gradient (None without a sink)."""
        with on_device(q.device):
            return _triton_launch().backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask,
                                             problem, tiles, cu_seqlens_q, cu_seqlens_k, learnable_sink, rng_state)


@functools.lru_cache(maxsize=256)
def _triton_tiles(values: tuple[int, ...]) -> triton_configs.TritonTiles:
    # every eager call turns its resolved tile tuple into the tiles object: built once per distinct tuple
    return triton_configs.TritonTiles(*values)


BACKENDS = {"torch": TorchBackend(), "triton": TritonBackend()}


def _check_name(name: object, source: str) -> str:
    if not isinstance(name, str) or name not in ("auto",) + BACKEND_NAMES:
        raise ValueError(f"{source} is {name!r}; expected one of 'auto', " + ", ".join(repr(n) for n in BACKEND_NAMES))
    return name


def current_request() -> _Request:
    request = _context_request.get()
    if request is not None:
        return request
    env = os.environ.get(ENV_VAR, "")
    schedule = os.environ.get(_schedules.SCHEDULE_ENV_VAR, "")
    if env.strip() or schedule.strip():
        return _environment_request(env, schedule)
    return _DEFAULT_REQUEST


@contextlib.contextmanager
def use_backend(name: str, *, schedule: str | None = None, **tile_overrides: int) -> Iterator[None]:
    """Run the calls inside the `with` block on backend `name` ("auto", "torch" or "triton").

    schedule: for the triton backend, the schedule every call runs ("fa1", "fa2", "fa3", "fa4" or "decode"; see
    `flashtile.schedules()`), instead of the tile table's choice; a call it cannot serve raises
    BackendUnavailableError naming the schedule and why. None: the table's choice.
    Keyword arguments force the tile shape of that backend (for the torch backend: block_q and
    block_k, positive ints), which `explain()` then reports. Contexts nest; the innermost wins, and a
    context replaces FLASHTILE_BACKEND / FLASHTILE_SCHEDULE whole.
    Raises ValueError for an unknown backend or schedule, a schedule with a backend other than "triton",
    an unknown tile key or a non-positive tile size.
    """
    name = _check_name(name, "use_backend name")
    if schedule is not None:
        _schedules.check_schedule(schedule, "use_backend schedule")
        if name != "triton":
            raise ValueError(f"use_backend schedule={schedule!r} is a schedule of the 'triton' backend, but the "
                             f"backend is {name!r}; use use_backend('triton', schedule={schedule!r})")
    if tile_overrides:
        if name == "auto":
            raise ValueError("tile overrides need a named backend, not 'auto'")
        allowed = BACKENDS[name].tile_keys
        for key, value in tile_overrides.items():
            if key not in allowed:
                raise ValueError(f"backend {name!r} has no tile setting {key!r}; it accepts {allowed}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"tile setting {key} must be an int, got {value!r}")
            BACKENDS[name].check_tile_setting(key, value)
    source = f"use_backend({name!r}" + (f", schedule={schedule!r})" if schedule is not None else ")")
    token = _context_request.set(_Request(name, source, dict(tile_overrides), schedule))
    try:
        yield
    finally:
        _context_request.reset(token)


@dataclass(frozen=True)
class Plan:
    """The backend, tiles and reasons for one call."""

    backend: Any
    tiles: Any
    reason: str


def plan(problem: AttentionProblem) -> Plan:
    """Choose the backend and tiles for `problem`, or raise BackendUnavailableError."""
    request = current_request()
    if request.name == "auto":
        triton_reason = BACKENDS["triton"].unavailable_reason(problem)
        if problem.device.type == "cuda" and triton_reason is None:
            backend, reason = BACKENDS["triton"], f"{request.source}: fused Triton kernels for CUDA tensors"
        else:
            backend = BACKENDS["torch"]
            if problem.device.type == "cpu" and triton_reason is None:
                triton_reason = "on CPU tensors the Triton interpreter is a test vehicle, not a fast path"
            reason = f"{request.source} on {problem.device.type} tensors ('triton' not chosen: {triton_reason})"
    else:
        backend = BACKENDS[request.name]
        why_not = backend.unavailable_reason(problem)
        if why_not is not None:
            raise BackendUnavailableError(f"backend {request.name!r} (requested by {request.source}) cannot serve "
                                          f"this call: {why_not}")
        reason = f"requested by {request.source}"
    if request.schedule is None:
        tiles = backend.choose_tiles(problem, request.tile_overrides)
    else:
        tiles = backend.choose_tiles(problem, request.tile_overrides, request.schedule)
        why_not = _schedules.unserved_reason(request.schedule, problem, tiles)
        if why_not:
            raise BackendUnavailableError(f"schedule {request.schedule!r} of backend 'triton' (requested by "
                                          f"{request.source}) cannot serve this call: {why_not}")
    if request.tile_overrides:
        reason += f"; tiles forced to {request.tile_overrides}"
    return Plan(backend=backend, tiles=tiles, reason=reason)


_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionProblem))
_problem_fields = operator.attrgetter(*_PROBLEM_FIELDS)  # one C call: a decode step resolves every time


MAX_MEMO_REQUESTS = 64


def resolve(problem: AttentionProblem, memo: dict | None = None) -> tuple[str, tuple[int, ...]]:
    """plan() reduced to constants (backend name, tiles): what the custom op needs.

    torch.compile evaluates the choice once while tracing and bakes it into the graph: the backend
    context and FLASHTILE_BACKEND are read when a function is compiled, not at each call.
    memo: a dict the caller keeps for this problem alone (a validated KV-cache layout), holding the choice
    per backend request, so that a repeated call neither reads nor hashes the problem's fields.
    """
    if torch.compiler.is_compiling():  # dynamo cannot trace attrgetter
        return _resolve_constant(tuple(getattr(problem, name) for name in _PROBLEM_FIELDS))
    if memo is None:
        return _resolve_constant(_problem_fields(problem))
    key = (current_request().key, triton_configs.interpreting())
    resolved = memo.get(key)
    if resolved is None:
        if len(memo) >= MAX_MEMO_REQUESTS:
            memo.clear()
        resolved = memo[key] = _cached_resolution(_problem_fields(problem), key)
    return resolved


@torch.compiler.assume_constant_result
def _resolve_constant(problem_fields: tuple) -> tuple[str, tuple[int, ...]]:
    # plain values in, plain values out: dynamo can treat the call as a constant
    request = current_request()
    key = (request.key, triton_configs.interpreting())
    return _cached_resolution(problem_fields, key)


@functools.lru_cache(maxsize=1024)
def _cached_resolution(problem_fields: tuple, request_key: tuple) -> tuple[str, tuple[int, ...]]:
    # a call's backend and tiles depend only on its problem and the request: planning (device queries,
    # tile table) runs once per distinct call instead of on every call
    chosen = plan(AttentionProblem(*problem_fields))
    return chosen.backend.name, tuple(chosen.backend.tiles_to_list(chosen.tiles))
