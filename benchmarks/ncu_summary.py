"""Summarise Nsight Compute source pages (SASS, per instruction) of attention kernels side by side: warp
instructions executed by opcode, and where the warps of the compute roles stalled.

    ncu --clock-control none --kernel-name regex:K --launch-skip 2 --launch-count 1 --section SourceCounters \
        --section WarpStateStats -o prof python benchmarks/gluon_forward.py profile d64n1024c1 c2s2o1p2
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof-sass.csv
    python benchmarks/ncu_summary.py NAME=prof-sass.csv [NAME=other-sass.csv ...]

A warp-specialized kernel's load warps spend their time waiting on mbarriers, which says nothing about the compute
roles, so the stall breakdown leaves out the instructions from the kernel's first TMA load onwards, where Triton
and cuDNN place the load partition (the last partition in the binary): "compute roles" below means the code before
it. A kernel without warp roles (no register reallocation, USETMAXREG) is counted whole.
"""

from __future__ import annotations

import collections
import csv
import sys


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _rows(path: str) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        next(reader)  # the kernel's name
        header = next(reader)
        return header, [dict(zip(header, row)) for row in reader]


def _opcode(source: str) -> str:
    words = source.split()
    if not words:
        return ""
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def summarise(path: str) -> dict:
    """Instructions by opcode (warp instructions executed), the code's size in bytes, and the stall reasons'
    shares of the compute roles' samples."""
    header, rows = _rows(path)
    stalls = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    roles = any("USETMAXREG" in row["Source"] for row in rows)
    loads = [i for i, row in enumerate(rows) if "UTMALDG" in row["Source"]] if roles else []
    compute = rows[:loads[0]] if loads else rows
    # the load partition starts a little before its first copy (its loop's set-up): leave out the 64 instructions
    # before it too
    compute = compute[:max(0, len(compute) - 64)] if loads else compute
    opcodes = collections.Counter()
    for row in rows:
        opcodes[_opcode(row["Source"])] += _number(row["Instructions Executed"])
    reasons = collections.Counter()
    for row in compute:
        for column in stalls:
            reasons[column[len("stall_"):]] += _number(row[column])
    sampled = sum(reasons.values()) or 1.0
    size = (int(rows[-1]["Address"], 16) - int(rows[0]["Address"], 16) + 16) if rows else 0
    return {"opcodes": opcodes, "total": sum(opcodes.values()), "bytes": size,
            "stalls": {reason: count / sampled for reason, count in reasons.items()}}


def main(argv: list[str]) -> None:
    named = [argument.split("=", 1) for argument in argv]
    summaries = {name: summarise(path) for name, path in named}
    names = list(summaries)
    print("warp instructions executed (millions) by opcode")
    print(f"{'opcode':12}" + "".join(f"{name[:20]:>21}" for name in names))
    every = collections.Counter()
    for s in summaries.values():
        every.update(s["opcodes"])
    for opcode, _ in every.most_common(20):
        print(f"{opcode:12}" + "".join(f"{summaries[n]['opcodes'][opcode] / 1e6:21.2f}" for n in names))
    print(f"{'all':12}" + "".join(f"{summaries[n]['total'] / 1e6:21.2f}" for n in names))
    print(f"{'SASS bytes':12}" + "".join(f"{summaries[n]['bytes']:21d}" for n in names))
    print("\nstall reasons, % of the compute roles' samples")
    reasons = sorted({r for s in summaries.values() for r in s["stalls"]},
                     key=lambda r: -max(s["stalls"].get(r, 0.0) for s in summaries.values()))
    for reason in reasons[:12]:
        print(f"{reason:16}" + "".join(f"{100 * summaries[n]['stalls'].get(reason, 0.0):17.1f}" for n in names))


if __name__ == "__main__":
    main(sys.argv[1:])
