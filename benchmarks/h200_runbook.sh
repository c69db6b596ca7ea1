#!/bin/bash
# The GPU measurements still owed by issues 3-5, as stages that each fit one 10-minute device call.
#   bash benchmarks/h200_runbook.sh tests     # GPU test suite (-n 14) + memcheck of the new kernels
#   bash benchmarks/h200_runbook.sh grid128   # the default bench grid, d = 128, every provider
#   bash benchmarks/h200_runbook.sh grid64    # the same, d = 64
#   bash benchmarks/h200_runbook.sh decode    # bench --mode decode (issue 5 grid) + varlen vs dense
#   bash benchmarks/h200_runbook.sh schedules # forward schedules forced, beside cuDNN and FlexAttention,
#                                             # then where the warp-specialized schedule goes wrong
# Results go to $OUT (the device tool's output folder), or ./out when OUT is unset.
set -u
stage=${1:?stage: tests, grid128, grid64, decode or schedules}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
date=$(date +%Y-%m-%d)
case $stage in
  tests)
    FLASHTILE_TEST_DEVICE=cuda timeout 330 python -m pytest -q -n 14 -p no:cacheprovider tests \
      --ignore=tests/test_triton_compile.py 2>&1 | tail -60 > "$out/tests.txt"
    tail -3 "$out/tests.txt"
    FLASHTILE_TEST_DEVICE=cuda timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 \
      python -m pytest -q -x -p no:cacheprovider tests/test_varlen.py tests/test_kvcache.py \
      -k "triton and (mixed or contiguous or page16) and fp16" 2>&1 | tail -30 > "$out/memcheck.txt"
    tail -5 "$out/memcheck.txt" ;;
  grid128|grid64)
    d=${stage#grid}
    timeout 560 python -m flashtile bench --device cuda --headdim "$d" \
      --json "$out/$date-h200-full-grid-d$d.json" > "$out/grid-d$d.txt" 2> "$out/grid-d$d.progress"
    tail -3 "$out/grid-d$d.progress" ;;
  decode)
    timeout 400 python -m flashtile bench --mode decode --device cuda \
      --json "$out/$date-h200-decode.json" > "$out/decode.txt" 2> "$out/decode.progress"
    tail -30 "$out/decode.txt"
    timeout 150 python benchmarks/varlen_vs_dense.py > "$out/varlen.txt" 2>&1
    cat "$out/varlen.txt" ;;
  schedules)
    timeout 400 python -m flashtile bench --device cuda --mode fwd \
      --providers "flashtile[triton],flashtile[triton:tma],flashtile[triton:tma-ws],sdpa-cudnn,flex" \
      --json "$out/$date-h200-forward-schedules.json" > "$out/schedules.txt" 2> "$out/schedules.progress"
    tail -40 "$out/schedules.txt"
    timeout 150 python benchmarks/ws_determinism.py > "$out/ws_determinism.txt" 2>&1
    cat "$out/ws_determinism.txt" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
