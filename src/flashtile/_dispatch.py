"""Backend selection: which implementation serves a call, with which tiles, and why.

The choice comes from, in order: the innermost `use_backend(...)` context, the environment
variable FLASHTILE_BACKEND (auto | torch | triton, read at every call), and "auto". `auto` picks
the best backend available for the tensors' device. A backend named explicitly that cannot serve
the call raises `BackendUnavailableError` saying why; nothing falls back silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from . import torch_impl
from ._geometry import count_visited_tiles
from ._validate import AttentionProblem

BACKEND_NAMES = ("torch", "triton")
ENV_VAR = "FLASHTILE_BACKEND"


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot serve this call (the message says why)."""


@dataclass(frozen=True)
class _Request:
    name: str  # "auto" or one of BACKEND_NAMES
    source: str  # where the request came from, for explain()
    tile_overrides: dict[str, Any] = field(default_factory=dict)


_context_request: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("flashtile_backend", default=None)


class TorchBackend:
    """The pure-PyTorch tiled path: runs on any device torch supports."""

    name = "torch"
    kernel = "flashtile.torch_impl (tiled online softmax, FA2 loop order, recompute backward)"
    tile_keys = ("block_q", "block_k")

    def unavailable_reason(self, problem: AttentionProblem) -> str | None:
        return None

    def choose_tiles(self, problem: AttentionProblem, overrides: dict[str, Any]) -> torch_impl.TorchTiles:
        tiles = torch_impl.default_tiles(problem)
        return torch_impl.TorchTiles(block_q=overrides.get("block_q", tiles.block_q),
                                     block_k=overrides.get("block_k", tiles.block_k))

    def describe_tiles(self, problem: AttentionProblem, tiles: torch_impl.TorchTiles) -> str:
        visited, masked, full = count_visited_tiles(problem, tiles.block_q, tiles.block_k)
        return (f"{tiles.describe(problem)}; {visited} of {full} tiles visited per (batch, K/V head) "
                f"({masked} with an element mask)")

    def forward(self, q, k, v, alibi_slopes, attn_mask, problem, tiles):
        return torch_impl.attention_forward(q, k, v, alibi_slopes, attn_mask, problem, tiles)

    def backward(self, grad_out, grad_lse, q, k, v, out, lse, alibi_slopes, attn_mask, problem, tiles):
        return torch_impl.attention_backward(grad_out, grad_lse, q, k, v, out, lse, alibi_slopes,
                                             attn_mask, problem, tiles)


class TritonBackend:
    """Placeholder for the fused GPU kernels; it names why it cannot serve a call."""

    name = "triton"
    kernel = "flashtile.triton (fused Triton kernels)"
    tile_keys = ()

    def unavailable_reason(self, problem: AttentionProblem) -> str | None:
        return ("flashtile's Triton kernels are not implemented in this release; the 'torch' backend "
                "serves CPU and CUDA tensors")


BACKENDS = {"torch": TorchBackend(), "triton": TritonBackend()}


def _check_name(name: object, source: str) -> str:
    if not isinstance(name, str) or name not in ("auto",) + BACKEND_NAMES:
        raise ValueError(f"{source} is {name!r}; expected one of 'auto', " + ", ".join(repr(n) for n in BACKEND_NAMES))
    return name


def current_request() -> _Request:
    request = _context_request.get()
    if request is not None:
        return request
    env = os.environ.get(ENV_VAR)
    if env is not None and env.strip():
        return _Request(_check_name(env.strip().lower(), f"environment variable {ENV_VAR}"), f"{ENV_VAR}={env.strip()}")
    return _Request("auto", "default (auto)")


@contextlib.contextmanager
def use_backend(name: str, **tile_overrides: int) -> Iterator[None]:
    """Run the calls inside the `with` block on backend `name` ("auto", "torch" or "triton").

    Keyword arguments force the tile shape of that backend (for the torch backend: block_q and
    block_k, positive ints), which `explain()` then reports. Contexts nest; the innermost wins.
    Raises ValueError for an unknown backend, an unknown tile key or a non-positive tile size.
    """
    name = _check_name(name, "use_backend name")
    if tile_overrides:
        if name == "auto":
            raise ValueError("tile overrides need a named backend, not 'auto'")
        allowed = BACKENDS[name].tile_keys
        for key, value in tile_overrides.items():
            if key not in allowed:
                raise ValueError(f"backend {name!r} has no tile setting {key!r}; it accepts {allowed}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tile setting {key} must be a positive int, got {value!r}")
    token = _context_request.set(_Request(name, f"use_backend({name!r})", dict(tile_overrides)))
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
        # the Triton kernels will be preferred for CUDA tensors once they exist; until then only torch serves
        triton_reason = BACKENDS["triton"].unavailable_reason(problem)
        backend = BACKENDS["torch"]
        reason = f"{request.source} on {problem.device.type} tensors ('triton' not chosen: {triton_reason})"
    else:
        backend = BACKENDS[request.name]
        why_not = backend.unavailable_reason(problem)
        if why_not is not None:
            raise BackendUnavailableError(f"backend {request.name!r} (requested by {request.source}) cannot serve this call: {why_not}")
        reason = f"requested by {request.source}"
    tiles = backend.choose_tiles(problem, request.tile_overrides)
    if request.tile_overrides:
        reason += f"; tiles forced to {request.tile_overrides}"
    return Plan(backend=backend, tiles=tiles, reason=reason)
