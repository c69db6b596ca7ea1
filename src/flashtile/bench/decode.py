"""`flashtile bench --mode decode`: KV-cache decoding bandwidth beside torch SDPA.

Decoding reads the whole cache for one new query token per sequence, so its figure of merit is
bandwidth: bytes of K and V read (batch x cache_len x nheads_k x (headdim + headdim_v) x itemsize)
divided by the median time. Each row is one provider at one (batch, cache length, page size): page
0 is a contiguous cache, others a paged cache whose pages lie in shuffled order. The peer is torch
SDPA's default dispatch on the same keys as a contiguous tensor (it cannot read a paged cache; its
row at page 0 is the reference for every page size of that cell).

Providers: "flashtile[<backend>]" for every flashtile backend that can serve the call (through
flashtile.flash_attn_with_kvcache, so the per-call checks are in the time), and "sdpa".
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import flashtile
from flashtile import _dispatch
from flashtile._measure import timed_kernels
from flashtile.bench.runner import (DTYPES, Timing, _time_ms, call_limit_reason, int_list, measure_copy_gbps,
                                    seconds_limit)
from flashtile.reference import flash_attn_reference

PROVIDERS = tuple(f"flashtile[{name}]" for name in _dispatch.BACKEND_NAMES) + ("sdpa",)


@dataclass(frozen=True)
class DecodeConfig:
    device: torch.device
    dtype_name: str
    batches: tuple[int, ...]
    cache_lens: tuple[int, ...]
    pages: tuple[int, ...]  # 0 = contiguous
    nheads: int
    nheads_k: int
    headdim: int
    providers: tuple[str, ...]
    timing: Timing
    max_call_seconds: float | None
    quick: bool

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def row_count(self) -> int:
        return len(self.batches) * len(self.cache_lens) * len(self.pages) * len(self.providers)


@dataclass
class DecodeRow:
    provider: str
    batch: int
    cache_len: int
    page_size: int
    nheads: int
    nheads_k: int
    headdim: int
    dtype: str
    status: str = "ok"
    reason: str | None = None
    ms: float | None = None
    gbps: float | None = None
    copy_fraction: float | None = None
    # time of what one call ran (profiler): GPU kernels on CUDA (ms - kernel_ms is then host time), aten ops
    # on the CPU
    kernel_ms: float | None = None
    rel_error: float | None = None
    kernels: list[str] = field(default_factory=list)


@dataclass
class DecodeResult:
    header: dict
    rows: list[DecodeRow]


def make_decode_config(*, device: str | None = None, dtype: str | None = None, batches: str | None = None,
                       cache_lens: str | None = None, pages: str | None = None, providers: str | None = None,
                       quick: bool = False, max_call_seconds: str | float | None = None) -> DecodeConfig:
    """Validate the decode grid. Defaults: the issue's grid on CUDA (batch 1, 8, 64; cache 4k, 32k, 128k;
    contiguous and pages of 16 and 256; 32 query heads on 8 K/V heads, d 128, bf16); --quick a CI-sized one.
    max_call_seconds as for the grid (runner.seconds_limit). Raises ValueError naming the option for a bad
    value (page sizes must be multiples of 16)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device: {device!r} is not one of cuda, cpu")
    if dtype is None:
        dtype = "bf16" if device == "cuda" else "fp32"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    small = quick or device == "cpu"
    grid = dict(batches=(1, 2), cache_lens=(256, 1024), pages=(0, 16), heads=(4, 2, 32)) if small else \
        dict(batches=(1, 8, 64), cache_lens=(4096, 32768, 131072), pages=(0, 16, 256), heads=(32, 8, 128))
    page_sizes = grid["pages"] if pages is None else int_list(pages, "--pages", 0, None)
    bad = [p for p in page_sizes if p % 16]
    if bad:
        raise ValueError(f"--pages: {bad[0]} is not 0 (contiguous) or a multiple of 16")
    names = PROVIDERS if providers is None else tuple(p.strip() for p in providers.split(","))
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"--providers: unknown decode provider {unknown[0]!r}; known: {', '.join(PROVIDERS)}")
    nheads, nheads_k, headdim = grid["heads"]
    timing = Timing(warmup_ms=5, rep_ms=20, cpu_repeats=3) if small else Timing(warmup_ms=25, rep_ms=100,
                                                                                 cpu_repeats=5)
    return DecodeConfig(device=torch.device(device), dtype_name=dtype,
                        batches=grid["batches"] if batches is None else int_list(batches, "--batches", 1, None),
                        cache_lens=grid["cache_lens"] if cache_lens is None else int_list(cache_lens, "--cache-lens",
                                                                                          1, None),
                        pages=page_sizes,
                        nheads=nheads, nheads_k=nheads_k, headdim=headdim, providers=names, timing=timing,
                        max_call_seconds=seconds_limit(max_call_seconds), quick=quick)


@dataclass
class _Cell:
    """Inputs of one (batch, cache length): q, the logical cache k/v (batch, length, nheads_k, d)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    reference: torch.Tensor  # float64 out of batch entry 0


def paged_cache(k: torch.Tensor, v: torch.Tensor, page: int):
    """k, v (batch, length, heads, d) as a paged cache: (k_cache, v_cache) of shape (num_blocks, page, heads, d)
    with the pages in shuffled order, and the block table (batch, pages) int32 that finds them."""
    batch, length = k.shape[:2]
    pages = -(-length // page)
    padded = pages * page
    if padded != length:
        k = torch.cat([k, k.new_zeros(batch, padded - length, *k.shape[2:])], dim=1)
        v = torch.cat([v, v.new_zeros(batch, padded - length, *v.shape[2:])], dim=1)
    order = torch.randperm(batch * pages, device=k.device)
    k_cache, v_cache = torch.empty_like(k).view(-1, page, *k.shape[2:]), torch.empty_like(v).view(-1, page,
                                                                                                 *v.shape[2:])
    k_cache[order] = k.reshape(-1, page, *k.shape[2:])
    v_cache[order] = v.reshape(-1, page, *v.shape[2:])
    return k_cache, v_cache, order.view(batch, pages).to(torch.int32)


def _step(provider: str, cell: _Cell, cache: tuple) -> Callable[[], torch.Tensor]:
    """The timed call: returns out (batch, 1, nheads, d). cache: (k_cache, v_cache, block table or None)."""
    batch, length = cell.k.shape[:2]
    if provider == "sdpa":
        q, k, v = (t.transpose(1, 2) for t in (cell.q, cell.k, cell.v))
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)
    k_cache, v_cache, table = cache
    lengths = torch.full((batch,), length, dtype=torch.int32, device=cell.q.device)

    def call():
        return flashtile.flash_attn_with_kvcache(cell.q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
    return call


def _measure_step(row: DecodeRow, step: Callable[[], torch.Tensor], cell: _Cell, config: DecodeConfig) -> None:
    out = step()  # also compiles
    row.rel_error = ((out[0].double() - cell.reference).norm() / cell.reference.norm()).item()
    too_slow = call_limit_reason(step, config.device, config.max_call_seconds)
    if too_slow is not None:
        row.status, row.reason = "skipped", too_slow
        return
    row.ms = _time_ms(step, config.device, config.timing, warm=True)
    kernels = timed_kernels(step, config.device)
    row.kernels = list(dict.fromkeys(name for name, _ in kernels))[:3]
    row.kernel_ms = sum(us for _, us in kernels) / 1e3


def _measure(row: DecodeRow, provider: str, cell: _Cell, cache: tuple, config: DecodeConfig,
             copy_gbps: float) -> None:
    if provider == "sdpa" and row.page_size:
        row.status, row.reason = "skipped", "torch SDPA reads only a contiguous cache (see its page-0 row)"
        return
    backend = provider[len("flashtile["):-1] if provider.startswith("flashtile[") else "auto"
    try:
        with flashtile.use_backend(backend):  # entered once, outside the timed calls
            _measure_step(row, _step(provider, cell, cache), cell, config)
    except _dispatch.BackendUnavailableError as error:
        row.status, row.reason = "skipped", str(error)
        return
    except Exception as error:  # noqa: BLE001 - the grid goes on; the row says what went wrong
        row.status, row.reason = "failed", f"{type(error).__name__}: {error}"
        return
    if row.status != "ok":
        return
    kv_bytes = row.batch * row.cache_len * row.nheads_k * 2 * row.headdim * config.dtype.itemsize
    row.gbps = kv_bytes / (row.ms * 1e-3) / 1e9
    row.copy_fraction = row.gbps / copy_gbps


def _describe_timing(config: DecodeConfig) -> str:
    t = config.timing
    if config.device.type == "cuda":
        return f"median of triton.testing.do_bench (warmup {t.warmup_ms} ms, rep {t.rep_ms} ms, L2 flushed)"
    return f"median of {t.cpu_repeats} calls after 1 warm-up"


def run_decode_benchmark(config: DecodeConfig, progress: Callable[[str], None] = lambda message: None,
                         on_row: Callable[[DecodeResult], None] = lambda partial: None) -> DecodeResult:
    """Measure the device copy bandwidth, then every row; `on_row` gets the result so far after each row."""
    torch.manual_seed(0)
    progress(f"measuring the device copy on {config.device.type}")
    copy_gbps, _ = measure_copy_gbps(config.device, config.timing)
    header = {"kind": "decode", "device": config.device.type,
              "device_name": torch.cuda.get_device_name(config.device) if config.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "flashtile": flashtile.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "dtype": config.dtype_name, "quick": config.quick, "copy_gbps": copy_gbps,
              "timing": _describe_timing(config), "max_call_seconds": config.max_call_seconds,
              "bandwidth": "bytes of K and V read (batch x cache_len x nheads_k x 2 x headdim x itemsize) / time"}
    rows: list[DecodeRow] = []
    for batch, length in itertools.product(config.batches, config.cache_lens):
        shape = dict(device=config.device, dtype=config.dtype)
        q = torch.randn(batch, 1, config.nheads, config.headdim, **shape)
        k = torch.randn(batch, length, config.nheads_k, config.headdim, **shape)
        v = torch.randn(batch, length, config.nheads_k, config.headdim, **shape)
        reference = flash_attn_reference(q[:1], k[:1], v[:1])[0][0]
        cell = _Cell(q, k, v, reference)
        for page in config.pages:
            # one paged copy per page size, shared by the providers (SDPA reads only the contiguous cache)
            paged = page and any(provider != "sdpa" for provider in config.providers)
            cache = paged_cache(k, v, page) if paged else (k, v, None)
            for provider in config.providers:
                row = DecodeRow(provider=provider, batch=batch, cache_len=length, page_size=page,
                                nheads=config.nheads, nheads_k=config.nheads_k, headdim=config.headdim,
                                dtype=config.dtype_name)
                progress(f"[{len(rows) + 1}/{config.row_count}] {provider} batch {batch} cache {length} "
                         f"{'contiguous' if page == 0 else f'page {page}'}")
                _measure(row, provider, cell, cache, config, copy_gbps)
                rows.append(row)
                on_row(DecodeResult(header, rows))
            del cache
        del cell, q, k, v
    return DecodeResult(header, rows)


def _short(kernel: str) -> str:
    """A kernel name without its template arguments and parameter list (the JSON keeps it whole)."""
    return kernel.split("<", 1)[0].split("(", 1)[0]


def format_decode_table(result: DecodeResult) -> str:
    """The rows as a table, with each flashtile row's bandwidth as a multiple of SDPA's in its cell."""
    peers = {(r.batch, r.cache_len): r.gbps for r in result.rows if r.provider == "sdpa" and r.gbps}
    h = result.header
    lines = [f"flashtile {h['flashtile']} decode bench on {h['device_name']}; torch {h['torch']}; {h['date']}",
             f"device copy {h['copy_gbps']:.0f} GB/s (read + written); {h['dtype']}; {h['timing']}",
             "", f"{'provider':18s} {'batch':>5s} {'cache':>7s} {'page':>5s} {'ms':>9s} {'GB/s':>7s} "
             f"{'%copy':>6s} {'x sdpa':>6s} {'kern ms':>8s} {'rel err':>8s}  ran",
             "-" * 100]
    for r in result.rows:
        page = "contig" if r.page_size == 0 else str(r.page_size)
        if r.status != "ok":
            lines.append(f"{r.provider:18s} {r.batch:5d} {r.cache_len:7d} {page:>5s} {r.status}: {r.reason}")
            continue
        peer = peers.get((r.batch, r.cache_len))
        ratio = f"{r.gbps / peer:.2f}" if peer and r.provider != "sdpa" else "-"
        lines.append(f"{r.provider:18s} {r.batch:5d} {r.cache_len:7d} {page:>5s} {r.ms:9.4f} {r.gbps:7.1f} "
                     f"{100 * r.copy_fraction:5.1f}% {ratio:>6s} {r.kernel_ms:8.4f} {r.rel_error:8.1e}  "
                     f"{', '.join(_short(k) for k in r.kernels)}")
    return "\n".join(lines)
