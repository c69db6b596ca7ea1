"""Command line: `python -m flashtile demo` and `python -m flashtile bench` (also the `flashtile` console script)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from . import _dispatch
from ._measure import executed_kernels, median_time_ms, peak_memory_growth_bytes
from ._validate import prepare_flash_attn
from .interface import flash_attn_func
from .reference import flash_attn_reference

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def _naive_attention(q, k, v, causal):
    """Textbook attention in the input dtype, materialising the (seqlen_q x seqlen_k) scores."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = scores.shape[-2:]
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(n_k - n_q + 1)
        scores = scores.masked_fill(future, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(1, 2)


def _sdpa(q, k, v, causal):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def _oracle(q, k, v, causal):
    """float64 reference computed one (batch, head) at a time to bound its memory."""
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            sl = (slice(b, b + 1), slice(None), slice(h, h + 1))
            out[sl] = flash_attn_reference(q[sl], k[sl], v[sl], causal=causal)[0]
    return out


def demo(args: argparse.Namespace) -> int:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(args.seed)
    shape_q = (args.batch, args.seqlen, args.heads, args.headdim)
    q, k, v = (torch.randn(shape_q, device=device, dtype=dtype) for _ in range(3))
    call = prepare_flash_attn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=args.causal, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              return_lse=False)
    plan = _dispatch.plan(call.problem)
    print(f"flashtile demo: batch {args.batch}, heads {args.heads}, seqlen {args.seqlen}, headdim {args.headdim}, "
          f"{str(dtype).replace('torch.', '')}, causal={args.causal}, device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, torch {torch.__version__}")
    print(f"flashtile backend: {plan.backend.name!r} ({plan.reason}); tiles: {plan.backend.describe_tiles(call.problem, plan.tiles)}")
    print("computing the float64 oracle ...", flush=True)
    ref = _oracle(q, k, v, args.causal)

    candidates = [
        (f"flashtile[{plan.backend.name}]", lambda: flash_attn_func(q, k, v, causal=args.causal)),
        ("torch SDPA", lambda: _sdpa(q, k, v, args.causal)),
        ("naive (materialised)", lambda: _naive_attention(q, k, v, args.causal)),
    ]
    header = f"{'implementation':<22} {'max |err|':>10} {'rel err':>9} {'time ms':>9} {'peak MiB':>9}  ran"
    print(header)
    print("-" * len(header))
    with torch.no_grad():
        for name, fn in candidates:
            out = fn().double()
            max_err = (out - ref).abs().max().item()
            rel_err = ((out - ref).norm() / ref.norm()).item()
            ms = median_time_ms(fn, device, repeats=args.repeats)
            peak = peak_memory_growth_bytes(fn, device)
            ran = ", ".join(executed_kernels(fn, device, limit=2))
            peak_text = f"{peak / 2**20:9.1f}" if peak is not None else f"{'n/a':>9}"
            print(f"{name:<22} {max_err:10.2e} {rel_err:9.2e} {ms:9.1f} {peak_text}  {ran}", flush=True)
    print("errors are against float64 attention on the same inputs; time is the median of "
          f"{args.repeats} runs after a warm-up; peak is memory growth during one call")
    return 0


def _output_path_error(path: str | None, flag: str) -> str | None:
    if path is not None and not Path(path).resolve().parent.is_dir():
        return f"{flag}: the directory of {path!r} does not exist"
    return None


def bench(args: argparse.Namespace) -> int:
    """Run the benchmark grid; print the table to stdout and progress to stderr; write --json/--plot.
    Bad option values print an error naming the option and return 2 before anything runs."""
    # imported here so that `demo` does not pay for the benchmark's imports
    from .bench import report, runner

    if args.fp8:
        return _bench_fp8(args)
    if args.from_json:
        return _redraw(args, report)
    if args.mode is not None and args.mode.strip() == "decode":
        if args.schedules:
            print("flashtile bench: error: --schedules runs dense calls; the decode schedule has its own grid "
                  "(--mode decode without --schedules)", file=sys.stderr)
            return 2
        return _bench_decode(args)
    try:
        config = runner.make_config(device=args.device, dtype=args.dtype, headdim=args.headdim, seqlens=args.seqlens,
                                    causal=args.causal, mode=args.mode, providers=args.providers, quick=args.quick,
                                    max_call_seconds=args.max_call_seconds, schedules=args.schedules)
    except ValueError as error:
        print(f"flashtile bench: error: {error}", file=sys.stderr)
        return 2
    # refuse unusable outputs now rather than after the whole grid has run
    problems = [_output_path_error(args.json, "--json"), _output_path_error(args.plot, "--plot"),
                report.plotting_unavailable_reason() if args.plot else None]
    problems = [p for p in problems if p is not None]
    if problems:
        print("flashtile bench: error: " + "; ".join(problems), file=sys.stderr)
        return 2

    result = _run_and_report(args, lambda progress, on_row: runner.run_benchmark(config, progress, on_row),
                             report.format_schedule_table if args.schedules else report.format_table)
    if args.plot:
        (report.write_schedule_plot if args.schedules else report.write_plot)(args.plot, result)
        print(f"wrote {args.plot}")
    return 0


def _run_and_report(args: argparse.Namespace, run, format_table):
    """Run a grid with progress on stderr and --json rewritten after every row (so a run cut short keeps
    what it measured); print the table; return the result."""
    from .bench import report

    interactive = sys.stderr.isatty()

    def progress(message: str) -> None:
        # a terminal sees one line rewritten in place; a log file gets every step
        print(f"\r\033[K{message}" if interactive else message, end="" if interactive else "\n",
              file=sys.stderr, flush=True)

    def save(partial) -> None:
        if args.json:
            report.write_json(args.json, partial)

    result = run(progress, save)
    if interactive:
        print(file=sys.stderr)
    print(format_table(result), flush=True)
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


def _bench_decode(args: argparse.Namespace) -> int:
    """`bench --mode decode`: the KV-cache bandwidth grid (table to stdout, progress to stderr, --json)."""
    from .bench import decode

    try:
        config = decode.make_decode_config(device=args.device, dtype=args.dtype, batches=args.batches,
                                           cache_lens=args.cache_lens, pages=args.pages, providers=args.providers,
                                           quick=args.quick, max_call_seconds=args.max_call_seconds)
    except ValueError as error:
        print(f"flashtile bench: error: {error}", file=sys.stderr)
        return 2
    problem = _output_path_error(args.json, "--json") or ("--plot: the decode mode draws no plot" if args.plot
                                                          else None)
    if problem:
        print(f"flashtile bench: error: {problem}", file=sys.stderr)
        return 2
    _run_and_report(args, lambda progress, on_row: decode.run_decode_benchmark(config, progress, on_row),
                    decode.format_decode_table)
    return 0


def _bench_fp8(args: argparse.Namespace) -> int:
    """`bench --fp8`: the FP8 quantisation accuracy report (table to stdout, --json). It times nothing and runs on
    the CPU, so the grid's options do not apply; --headdim and --seqlens may each give one value."""
    from .bench import fp8, report

    grid_options = {"--device": args.device, "--dtype": args.dtype, "--causal": None if args.causal == "both" else 1,
                    "--mode": args.mode, "--batches": args.batches, "--cache-lens": args.cache_lens,
                    "--pages": args.pages, "--providers": args.providers, "--quick": args.quick or None,
                    "--max-call-seconds": args.max_call_seconds, "--schedules": args.schedules or None,
                    "--plot": args.plot, "--from-json": args.from_json}
    given = [flag for flag, value in grid_options.items() if value is not None]
    if given:
        print(f"flashtile bench: error: --fp8 measures quantisation error on the CPU and takes only --headdim, "
              f"--seqlens and --json; drop {', '.join(given)}", file=sys.stderr)
        return 2
    sizes = {}
    for flag, key, text in (("--headdim", "headdim", args.headdim), ("--seqlens", "seqlen", args.seqlens)):
        if text is None:
            continue
        try:
            sizes[key] = int(text)
        except ValueError:
            print(f"flashtile bench: error: {flag} with --fp8 takes one integer, got {text!r}", file=sys.stderr)
            return 2
    problem = _output_path_error(args.json, "--json")
    if problem:
        print(f"flashtile bench: error: {problem}", file=sys.stderr)
        return 2
    try:
        result = fp8.accuracy_report(**sizes)
    except ValueError as error:
        print(f"flashtile bench: error: {error}", file=sys.stderr)
        return 2
    print(fp8.format_accuracy_table(result), flush=True)
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def _redraw(args: argparse.Namespace, report) -> int:
    """`bench --from-json PATH`: print (and with --plot, draw) a saved run without measuring anything."""
    if not os.path.isfile(args.from_json):
        print(f"flashtile bench: error: --from-json: no file {args.from_json!r}", file=sys.stderr)
        return 2
    problems = [_output_path_error(args.plot, "--plot"), report.plotting_unavailable_reason() if args.plot else None]
    problems = [p for p in problems if p is not None]
    if problems:
        print("flashtile bench: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    result = report.read_json(args.from_json)
    schedules = report.is_schedule_run(result)
    print((report.format_schedule_table if schedules else report.format_table)(result), flush=True)
    if args.plot:
        (report.write_schedule_plot if schedules else report.write_plot)(args.plot, result)
        print(f"wrote {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtile", description="Exact FlashAttention in Python.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="compute attention at a realistic shape, check it against float64, "
                                     "and compare time and memory with torch SDPA and naive attention")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=tuple(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=demo)

    b = sub.add_parser("bench", help="time flashtile against torch SDPA, FlexAttention, naive attention and "
                                      "flash-attn, in the FlashAttention benchmark convention",
                       description="Shapes: 16384 tokens per batch (batch = 16384 // seqlen) and model width 2048 "
                                   "(heads = 2048 // headdim), seqlen_q = seqlen_k. On the CPU pass --quick or small "
                                   "--seqlens: the default grid takes hours there.")
    b.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    b.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on cuda, fp32 on cpu)")
    b.add_argument("--headdim", default=None, help="comma-separated head dims, each 1..256 (default 64,128)")
    b.add_argument("--seqlens", default=None, help="comma-separated sequence lengths (default 1024,4096,16384)")
    b.add_argument("--causal", default="both", help="both, yes or no (default both)")
    b.add_argument("--mode", default=None,
                   help="comma-separated subset of fwd,bwd,fwd+bwd (default all three); or decode: KV-cache "
                        "decoding bandwidth (--batches, --cache-lens, --pages)")
    b.add_argument("--batches", default=None, help="decode: comma-separated batch sizes (default 1,8,64)")
    b.add_argument("--cache-lens", default=None,
                   help="decode: comma-separated cache lengths (default 4096,32768,131072)")
    b.add_argument("--pages", default=None,
                   help="decode: comma-separated page sizes, 0 = contiguous, else multiples of 16 (default 0,16,256)")
    b.add_argument("--providers", default=None,
                   help="comma-separated provider names or families (flashtile, sdpa); default: all")
    b.add_argument("--quick", action="store_true",
                   help="a small grid for CI (cpu: d=64, N=256,512, 1024 tokens, width 256, fwd and fwd+bwd; "
                        "cuda: d=128, N=1k,4k, fwd and fwd+bwd); explicit options still win")
    b.add_argument("--max-call-seconds", default=None, metavar="S",
                   help="skip (with the reason in its row) a provider whose single call takes longer than S seconds "
                        "(default 2; 0 = no limit)")
    b.add_argument("--schedules", action="store_true",
                   help="run every schedule of flashtile's registry that runs on the device (fa1, fa2, fa3, fa4, "
                        "decode) on the same inputs instead of the peers: TFLOP/s, fraction of the measured matmul ceiling, the "
                        "IO model's HBM bytes, kernels, max abs error vs float64; on the CPU only under "
                        "TRITON_INTERPRET=1, at tiny shapes")
    b.add_argument("--fp8", action="store_true",
                   help="time nothing: report the error FP8 quantisation of q, k, v adds to attention (per-tensor, "
                        "block, block with the Hadamard rotation; bf16 beside them) against float64, on Gaussian "
                        "inputs and inputs with outliers; CPU only, a few seconds; --headdim and --seqlens take one "
                        "value each")
    b.add_argument("--json", default=None, metavar="PATH", help="write the header and every row to PATH")
    b.add_argument("--plot", default=None, metavar="PATH", help="draw TFLOP/s to a PNG at PATH (needs matplotlib)")
    b.add_argument("--from-json", default=None, metavar="PATH",
                   help="measure nothing: print the table of a saved --json run (and draw it with --plot)")
    b.set_defaults(run=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
