"""Present a benchmark result: a terminal table, a JSON file, and a PNG bar chart.

A `flashtile bench --schedules` run (rows of the registry's schedules) has a table and a plot of its own
(format_schedule_table, write_schedule_plot): one bar per schedule, with its max abs error against float64.

The JSON holds everything (`{"header": {...}, "rows": [...]}`, full kernel names and reasons); the
table shortens kernel names and reasons to fit a terminal; the plot shows TFLOP/s of the "ok" rows
only, in the style of the FlashAttention papers: one panel per (head dim, causal, mode), one bar
group per sequence length, one bar per provider, each bar labelled with its value.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections import Counter
from pathlib import Path

from flashtile.bench.runner import HOST_BOUND_MARGIN, BenchResult, Row

KERNEL_NAME_WIDTH = 40
KERNELS_SHOWN = 2
REASON_WIDTH = 110


def _number(x: float) -> str:
    """Three significant digits, whole numbers from 100 on (0.000962, 0.0523, 8.00, 12.3, 581, 1234)."""
    # "#" keeps trailing zeros (8.00, not 8); a value that rounds up to 100 would keep a bare "100."
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:#.3g}".rstrip(".")


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())  # reasons can span lines (torch's warnings)
    return text if len(text) <= width else text[: width - 1] + "…"


def _kernels(names: list[str]) -> str:
    shown = ", ".join(_shorten(name, KERNEL_NAME_WIDTH) for name in names[:KERNELS_SHOWN])
    return shown + (f" +{len(names) - KERNELS_SHOWN}" if len(names) > KERNELS_SHOWN else "")


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _seqlen_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def format_header(header: dict) -> str:
    """Two or three lines: machine and versions; ceilings; timing method."""
    where = header["device_name"]
    if header["device"] == "cuda":
        where += f" (driver {header['driver']}, CUDA {header['cuda']})"
    else:
        where += f" (cpu, {header['cpu_threads']} threads)"
    c = header["ceilings"]
    lines = [
        f"flashtile {header['flashtile']} bench on {where}; torch {header['torch']}, triton {header['triton']}; "
        f"{header['date']}",
        f"ceilings measured at start: {c['matmul_size']}^3 {header['dtype']} matmul {_number(c['matmul_tflops'])} "
        f"TFLOP/s; device copy {_number(c['copy_gbps'])} GB/s (read + written)",
    ]
    if header["datasheet"] is not None:
        d = header["datasheet"]
        lines.append(f"datasheet: {_number(d['peak_tflops'])} TFLOP/s, {_number(d['bandwidth_gbps'])} GB/s ({d['source']})")
    lines.append(f"shapes: {header['tokens_per_batch']} tokens per batch, model width {header['model_width']}; "
                 f"time: {header['timing']}")
    return "\n".join(lines)


_COLUMNS = (("provider", 18, "<"), ("d", 4, ">"), ("N", 6, ">"), ("causal", 6, "<"), ("mode", 7, "<"),
            ("BxH", 7, ">"), ("ms", 9, ">"), ("TFLOP/s", 8, ">"), ("%matmul", 7, ">"), ("%roof", 6, ">"),
            ("peakMiB", 8, ">"), ("rel err", 8, ">"))


def _line(cells: list[str]) -> str:
    return " ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, _COLUMNS))


def _flags(row) -> str:
    """The notes after a measured row's kernels: host-bound, and a status other than ok with its reason."""
    text = ""
    if row.host_bound:
        text += f"  [host-bound: GPU work {_number(row.kernel_ms)} ms]"
    if row.status != "ok":
        text += f"  [{row.status}: {_shorten(row.reason or '', REASON_WIDTH)}]"
    return text


def _status_counts(rows) -> str:
    counts = Counter(row.status for row in rows)
    return f"{len(rows)} rows: " + ", ".join(f"{counts[s]} {s}" for s in ("ok", "skipped", "failed"))


def format_table(result: BenchResult) -> str:
    """The header, one line per row (skipped and failed rows show their reason), and a count."""
    head = _line([name for name, _, _ in _COLUMNS]) + " ran"
    lines = [format_header(result.header), "", head, "-" * len(head)]
    previous_cell = None
    for row in result.rows:
        cell = (row.headdim, row.seqlen_q, row.causal, row.mode)
        if previous_cell is not None and cell != previous_cell:
            lines.append("")
        previous_cell = cell
        where = [row.provider, str(row.headdim), str(row.seqlen_q), "yes" if row.causal else "no", row.mode,
                 f"{row.batch}x{row.heads}"]
        if row.ms is None:
            lines.append(_line(where) + f" {row.status}: {_shorten(row.reason or '', REASON_WIDTH)}")
            continue
        measured = [_number(row.ms), _number(row.tflops), _percent(row.matmul_fraction),
                    _percent(row.roofline_fraction), "-" if row.peak_mib is None else f"{row.peak_mib:.1f}",
                    f"{row.rel_error:.1e}" if row.rel_error is not None else "-"]
        lines.append(_line(where + measured) + " " + _kernels(row.kernels) + _flags(row))
    lines += ["", _status_counts(result.rows),
              "%matmul = TFLOP/s / measured matmul ceiling; %roof = roofline bound (flashtile.iomodel: tiled model "
              "for flash-style providers, materialised for naive and sdpa-math) / measured time; rel err = "
              "||x - ref|| / ||ref|| vs float64 of out (fwd) or dq (bwd, fwd+bwd) on a sub-sample; host-bound = "
              f"the timed call took over {HOST_BOUND_MARGIN:.0%} longer than its GPU work (profiler): its TFLOP/s "
              "measure the host"]
    return "\n".join(lines)


def write_json(path: str | Path, result: BenchResult) -> None:
    """Write {"header": ..., "rows": [...]} with every field of every row (full kernel names); also serves
    the decode grid's result (bench.decode.DecodeResult: a header and dataclass rows too)."""
    document = {"header": result.header, "rows": [dataclasses.asdict(row) for row in result.rows]}
    Path(path).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")


def read_json(path: str | Path) -> BenchResult:
    """The inverse of write_json: a result to print or plot again without re-running it."""
    document = json.loads(Path(path).read_text())
    return BenchResult(header=document["header"], rows=[Row(**row) for row in document["rows"]])


def plotting_unavailable_reason() -> str | None:
    """Why write_plot cannot run here (matplotlib missing), or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "plotting needs matplotlib: pip install 'flashtile[bench]' (or matplotlib>=3.7)"
    return None


def write_plot(path: str | Path, result: BenchResult) -> None:
    """Draw TFLOP/s of the ok rows to a PNG (matplotlib's Agg backend, no display needed); in GFLOP/s
    when no row reaches 1 TFLOP/s (the CPU).

    Panels: one per (head dim, causal) in rows and mode in columns, in grid order. Providers keep
    one colour and one bar slot across panels; a provider without an ok row anywhere is left out.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = result.rows
    ok = [row for row in rows if row.status == "ok"]
    providers = list(dict.fromkeys(row.provider for row in ok))
    seqlens = list(dict.fromkeys(row.seqlen_q for row in rows))
    modes = list(dict.fromkeys(row.mode for row in rows))
    panel_rows = list(dict.fromkeys((row.headdim, row.causal) for row in rows))
    # CPU rates are far below 1 TFLOP/s; GFLOP/s keeps their labels readable
    scale, unit = (1.0, "TFLOP/s") if max((r.tflops for r in ok), default=0.0) >= 1 else (1e3, "GFLOP/s")
    value = {(r.provider, r.headdim, r.causal, r.mode, r.seqlen_q): r.tflops * scale for r in ok}

    panel_width = max(5.0, 1.5 + 0.3 * len(seqlens) * len(providers))  # inches: about 0.3 per bar
    figure = Figure(figsize=(panel_width * len(modes), 3.6 * len(panel_rows) + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panel_rows), len(modes), squeeze=False)
    colours = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    width = 0.8 / max(1, len(providers))
    rotate = len(providers) > 3  # vertical labels once bars get narrow
    for (headdim, causal), panel_axes in zip(panel_rows, axes):
        for mode, ax in zip(modes, panel_axes):
            top = 0.0
            for i, provider in enumerate(providers):
                xs, heights = [], []
                for x, n in enumerate(seqlens):
                    tflops = value.get((provider, headdim, causal, mode, n))
                    if tflops is not None:
                        xs.append(x + (i - (len(providers) - 1) / 2) * width)
                        heights.append(tflops)
                if heights:
                    bars = ax.bar(xs, heights, width, color=colours[provider], label=provider)
                    ax.bar_label(bars, labels=[_number(h) for h in heights], fontsize=7, padding=2,
                                 rotation=90 if rotate else 0)
                    top = max(top, *heights)
            ax.set_title(f"{mode}, head dim {headdim}, {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_xticks(range(len(seqlens)), [_seqlen_label(n) for n in seqlens])
            ax.set_xlabel("sequence length")
            ax.set_ylabel(unit)
            if top > 0:
                ax.set_ylim(0, top * (1.35 if rotate else 1.15))  # room for the labels
            else:
                ax.text(0.5, 0.5, "no successful runs", ha="center", va="center", transform=ax.transAxes)
            ax.grid(axis="y", alpha=0.3)
    header = result.header
    figure.suptitle(f"Attention {header['dtype']} on {header['device_name']}: {unit}, higher is better "
                    f"(measured matmul ceiling {_number(header['ceilings']['matmul_tflops'] * scale)} {unit})",
                    fontsize=11)
    if providers:
        figure.legend([Patch(color=colours[p]) for p in providers], providers, loc="outside lower center",
                      ncols=min(len(providers), 8), fontsize=9)
    figure.savefig(path, format="png", dpi=120)


_SCHEDULE_COLUMNS = (("schedule", 13, "<"), ("d", 4, ">"), ("N", 6, ">"), ("causal", 6, "<"), ("mode", 7, "<"),
                     ("BxH", 7, ">"), ("ms", 9, ">"), ("TFLOP/s", 8, ">"), ("%matmul", 7, ">"), ("model MB", 9, ">"),
                     ("GB/s", 8, ">"), ("%copy", 6, ">"), ("max err", 8, ">"))


def is_schedule_run(result: BenchResult) -> bool:
    """Whether `result` is a `flashtile bench --schedules` run (its rows are the registry's schedules)."""
    return bool(result.rows) and all(row.provider.startswith("schedule:") for row in result.rows)


def format_schedule_table(result: BenchResult) -> str:
    """The `--schedules` table: per cell (head dim, N, causal, mode) one line per schedule, with TFLOP/s, its
    fraction of the measured matmul ceiling, the HBM bytes the IO model counts for the schedule (fa1's forward
    also moves O, m and l per key block), the bandwidth those bytes imply at the measured time and its fraction of
    the measured copy bandwidth, the max abs error against float64 and the kernels."""
    columns = _SCHEDULE_COLUMNS
    copy_gbps = result.header["ceilings"]["copy_gbps"]

    def line(cells: list[str]) -> str:
        return " ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, columns))

    head = line([name for name, _, _ in columns]) + " ran"
    lines = [format_header(result.header), "", head, "-" * len(head)]
    previous_cell = None
    for row in result.rows:
        cell = (row.headdim, row.seqlen_q, row.causal, row.mode)
        if previous_cell is not None and cell != previous_cell:
            lines.append("")
        previous_cell = cell
        where = [row.provider.removeprefix("schedule:"), str(row.headdim), str(row.seqlen_q),
                 "yes" if row.causal else "no", row.mode, f"{row.batch}x{row.heads}"]
        if row.ms is None:
            lines.append(line(where) + f" {row.status}: {_shorten(row.reason or '', REASON_WIDTH)}")
            continue
        gbps = None if row.io_bytes is None else row.io_bytes / (row.ms * 1e-3) / 1e9
        measured = [_number(row.ms), _number(row.tflops), _percent(row.matmul_fraction),
                    "-" if row.io_bytes is None else _number(row.io_bytes / 1e6),
                    "-" if gbps is None else _number(gbps), "-" if gbps is None else _percent(gbps / copy_gbps),
                    "-" if row.max_abs_error is None else f"{row.max_abs_error:.2e}"]
        lines.append(line(where + measured) + " " + _kernels(row.kernels) + _flags(row))
    lines += ["", _status_counts(result.rows),
              "every schedule ran on the same inputs; %matmul = TFLOP/s / measured matmul ceiling; model MB = HBM "
              "bytes the IO model counts (flashtile.iomodel: tiled; fa1's forward adds O, m, l per 64-key block), "
              "not measured bytes; GB/s = those bytes / time, %copy = of the measured copy bandwidth; max err = "
              "max |x - ref| vs float64 of out (fwd) or dq (fwd+bwd, bwd) on a sub-sample; fa4 runs fa3's kernel "
              "(or fa2's where fa3 cannot serve) compiled with its constexprs, under the same name"]
    return "\n".join(lines)


def write_schedule_plot(path: str | Path, result: BenchResult) -> None:
    """Draw the `--schedules` run to a PNG: one panel per cell (head dim, N, causal, mode), one bar per schedule
    (TFLOP/s, GFLOP/s when no row reaches 1 TFLOP/s), each labelled with its rate and its max abs error against
    float64; schedules that did not run are named under the panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = result.rows
    ok = [row for row in rows if row.status == "ok"]
    cells = list(dict.fromkeys((row.headdim, row.seqlen_q, row.causal, row.mode) for row in rows))
    schedules = list(dict.fromkeys(row.provider.removeprefix("schedule:") for row in rows))
    scale, unit = (1.0, "TFLOP/s") if max((r.tflops for r in ok), default=0.0) >= 1 else (1e3, "GFLOP/s")
    columns = min(len(cells), 3) or 1
    panel_rows = -(-len(cells) // columns) or 1
    figure = Figure(figsize=(4.2 * columns, 3.6 * panel_rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(panel_rows, columns, squeeze=False).flatten()
    for ax in axes[len(cells):]:
        ax.set_visible(False)
    for (headdim, seqlen, causal, mode), ax in zip(cells, axes):
        here = {row.provider.removeprefix("schedule:"): row for row in rows
                if (row.headdim, row.seqlen_q, row.causal, row.mode) == (headdim, seqlen, causal, mode)}
        ran = [name for name in schedules if name in here and here[name].status == "ok"]
        heights = [here[name].tflops * scale for name in ran]
        bars = ax.bar(range(len(ran)), heights, color=[f"C{schedules.index(name) % 10}" for name in ran])
        labels = [f"{_number(h)}\nerr {here[name].max_abs_error:.1e}" for h, name in zip(heights, ran)]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
        ax.set_xticks(range(len(ran)), ran)
        ax.set_ylabel(unit)
        if heights:
            ax.set_ylim(0, max(heights) * 1.3)
        missing = [name for name in schedules if name not in ran]
        title = f"{mode}, d {headdim}, N {_seqlen_label(seqlen)}, {'causal' if causal else 'non-causal'}"
        ax.set_title(title, fontsize=9)
        if missing:
            ax.set_xlabel("did not run: " + ", ".join(missing), fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    header = result.header
    figure.suptitle(f"flashtile's schedules, {header['dtype']} on {header['device_name']}: {unit} (higher is better) "
                    f"and max abs error vs float64", fontsize=10)
    figure.savefig(path, format="png", dpi=120)
