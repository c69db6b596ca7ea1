#!/bin/bash
# The GPU checks and measurements behind README.md and BENCHMARKS.md, on an H200 (any Hopper GPU runs them), as
# stages that each fit one 10-minute call. Run from the repository root; every stage writes its logs (and the
# bench's JSON) to $OUT, or ./out when OUT is unset.
#   bash benchmarks/h200_runbook.sh tests     # the whole test suite on the GPU (FLASHTILE_TEST_DEVICE=cuda), then
#                                             # compute-sanitizer memcheck over the table's tiles at ragged edges and
#                                             # narrow value tiles, decode, packed batches and the TMA backward
#   bash benchmarks/h200_runbook.sh grid128   # forward and forward+backward TFLOP/s at d = 128, N = 1k / 4k / 16k,
#                                             # causal and not, beside cuDNN, FA2 (SDPA flash) and FlexAttention in
#                                             # the same run (flashtile bench)
#   bash benchmarks/h200_runbook.sh grid64    # the same at d = 64
#   bash benchmarks/h200_runbook.sh decode    # KV-cache decode bandwidth beside SDPA (batch 1 / 8 / 64, caches of
#                                             # 4k / 32k / 128k keys, contiguous and in pages of 16 / 256), then a
#                                             # packed variable-length batch against the dense kernel's rate and
#                                             # against padding (varlen_vs_dense.py, d = 128 and d = 64)
#   bash benchmarks/h200_runbook.sh host      # host time per call against kernel time: launch floors, 1k fwd+bwd
#                                             # steps and forwards, decode steps (host_overhead.py), then where a 1k
#                                             # causal fwd+bwd step's host time goes (host_timeline.py)
#   bash benchmarks/h200_runbook.sh wsstress  # the warp-specialized forward and the table's TMA forward + backward
#                                             # rerun beside the GPU suite, counting runs that differ bitwise from the
#                                             # first (ws_determinism.py --stress)
#   bash benchmarks/h200_runbook.sh gluonstress  # the Gluon forward's first-call compile time; its GPU tests beside
#                                             # reruns (four dense processes: d = 128 and d = 64, without and with a
#                                             # causal band; one packed batch) and compute-sanitizer; racecheck
#                                             # controls (1-3 workers, a barrier, an mbarrier, a TMA copy)
#   bash benchmarks/h200_runbook.sh gluonbwd  # the Gluon dK/dV kernel (backward schedule 4): its GPU tests, its
#                                             # gradients against the oracle, backward times on the 12-cell grid
#                                             # beside the table's backward, cuDNN and FA2, reruns
# Robustness checks of their own (one-query / one-key shapes, memcheck of padded head dims): benchmarks/gpu_checks.sh.
set -u
stage=${1:?stage: tests, grid128, grid64, decode, host, wsstress, gluonstress or gluonbwd}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
date=$(date +%Y-%m-%d)
case $stage in
  tests)
    # the full log comes back (a run stopped by its timeout still leaves what it printed)
    FLASHTILE_TEST_DEVICE=cuda timeout 300 python -m pytest -q -n 14 -p no:cacheprovider -rfE tests \
      --ignore=tests/test_triton_compile.py > "$out/tests.txt" 2>&1
    tail -4 "$out/tests.txt"
    # the table's own tiles at ragged edges and with value tiles narrower than the key tile; decode at the table's
    # split count and forced ones
    FLASHTILE_TEST_DEVICE=cuda timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
      python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu.py \
      -k "short or narrower or kvcache_decode_realistic" > "$out/memcheck-tiles.txt" 2>&1
    echo "memcheck (tiles, decode) exit $?"; tail -3 "$out/memcheck-tiles.txt"
    # packed batches, the KV cache's layouts and the TMA backward, fp16
    FLASHTILE_TEST_DEVICE=cuda timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
      python -m pytest -q -p no:cacheprovider -rfE tests/test_varlen.py tests/test_kvcache.py \
      tests/test_triton_schedules.py -k "(triton and (mixed or contiguous or page16) and fp16) or tma_backward" \
      > "$out/memcheck-varlen-kvcache.txt" 2>&1
    echo "memcheck (varlen, KV cache, TMA backward) exit $?"; tail -3 "$out/memcheck-varlen-kvcache.txt" ;;
  grid128|grid64)
    d=${stage#grid}
    timeout 555 python -m flashtile bench --device cuda --headdim "$d" --mode fwd,fwd+bwd \
      --providers "flashtile[triton],sdpa-cudnn,sdpa-flash,flex" \
      --json "$out/$date-h200-grid-d$d.json" > "$out/grid-d$d.txt" 2> "$out/grid-d$d.progress"
    tail -3 "$out/grid-d$d.progress"; grep "^flashtile" "$out/grid-d$d.txt" | cut -c1-120 ;;
  decode)
    # the torch backend's decode (float32 math, a Python loop over sequences) is left out: seconds per row
    timeout 240 python -m flashtile bench --mode decode --device cuda --providers "flashtile[triton],sdpa" \
      --json "$out/$date-h200-decode.json" > "$out/decode.txt" 2> "$out/decode.progress"
    tail -40 "$out/decode.txt"
    timeout 150 python benchmarks/varlen_vs_dense.py > "$out/varlen-d128.txt" 2>&1
    timeout 150 python benchmarks/varlen_vs_dense.py --headdim 64 --heads 32 --skip-padded \
      > "$out/varlen-d64.txt" 2>&1
    grep -h "varlen / dense" "$out/varlen-d128.txt" "$out/varlen-d64.txt" ;;
  host)
    timeout 150 python benchmarks/host_overhead.py > "$out/host-overhead.txt" 2>&1
    grep -E "^(floor|d |decode)" "$out/host-overhead.txt"
    timeout 90 python benchmarks/host_overhead.py --quick --decode > "$out/host-overhead-decode.txt" 2>&1
    grep "^decode" "$out/host-overhead-decode.txt"
    timeout 240 python benchmarks/host_timeline.py > "$out/host-timeline.txt" 2>&1
    grep -E "^(==|flashtile|fa2)" "$out/host-timeline.txt" ;;
  wsstress)
    # contention is where differing runs appear: the suite on 11 workers beside the reruns
    FLASHTILE_TEST_DEVICE=cuda timeout 330 python -m pytest -q -n 11 -p no:cacheprovider tests \
      --ignore=tests/test_triton_compile.py > "$out/tests.txt" 2>&1 &
    # two processes rerun the table's TMA forward + backward at 4k keys, two the warp-specialized forward
    for i in 1 2; do timeout 330 python benchmarks/ws_determinism.py --stress 300 --target table-tma \
      > "$out/stress-tma$i.txt" 2>&1 & done
    for i in 1 2; do timeout 330 python benchmarks/ws_determinism.py --stress 300 > "$out/stress$i.txt" 2>&1 & done
    wait
    tail -2 "$out/tests.txt"; grep -h "stress:\|differs" "$out"/stress*.txt ;;
  gluonstress)
    # the first call's compile time (an empty Triton cache); then, all at once: the GPU tests of the Gluon forward and
    # of packed batches, four rerun processes (the Gluon forward at d = 128 without and with a causal band and at
    # d = 64 at the table's three-consumer and dealt settings) and one of a packed batch, and compute-sanitizer over
    # small cases of each Gluon setting; then racecheck over the control kernels (1, 2, 3 worker warpgroups)
    TRITON_CACHE_DIR=$(mktemp -d) timeout 60 python benchmarks/gluon_forward.py compile-time \
      > "$out/compile-time.txt" 2>&1
    cat "$out/compile-time.txt"
    FLASHTILE_TEST_DEVICE=cuda timeout 300 python -m pytest -q -n 6 -p no:cacheprovider -rfE tests/test_gpu.py \
      tests/test_varlen.py tests/test_gluon_forward.py > "$out/tests.txt" 2>&1 &
    for target in gluon gluon-causal gluon-d64 gluon-d64-causal; do
      timeout 250 python benchmarks/ws_determinism.py --stress 225 --target $target > "$out/stress-$target.txt" 2>&1 &
    done
    timeout 250 python benchmarks/gluon_forward.py reruns-packed 30000 > "$out/stress-packed.txt" 2>&1 &
    ( for tool in memcheck racecheck; do
        timeout 150 compute-sanitizer --tool $tool --error-exitcode 1 python benchmarks/gluon_forward.py small \
          > "$out/gluon-$tool.txt" 2>&1
      done ) &
    wait
    for control in 1 2 3 barrier mbarrier tma; do
      timeout 60 compute-sanitizer --tool racecheck python benchmarks/gluon_racecheck_control.py $control \
        > "$out/racecheck-control-$control.txt" 2>&1
    done
    tail -2 "$out/tests.txt"; grep -h "^FAILED\|^ERROR" "$out/tests.txt" | head; grep -h "stress\|differs\|reruns" \
      "$out"/stress*.txt; grep -h "SUMMARY\|FAILED" "$out"/gluon-*check.txt "$out"/racecheck-control-*.txt ;;
  gluonbwd)
    FLASHTILE_TEST_DEVICE=cuda timeout 240 python -m pytest -q -n 8 -p no:cacheprovider -rfE tests/test_gpu.py \
      -k gluon_backward > "$out/gluon-backward-tests.txt" 2>&1
    tail -2 "$out/gluon-backward-tests.txt"; grep -h "^FAILED\|^ERROR" "$out/gluon-backward-tests.txt" | head
    timeout 240 python benchmarks/gluon_backward.py check > "$out/gluon-backward-check.txt" 2>&1
    grep -c ": ok" "$out/gluon-backward-check.txt"; grep -h "FAILED\|serve" "$out/gluon-backward-check.txt" | head
    timeout 300 python benchmarks/gluon_backward.py time > "$out/$date-h200-gluon-backward-grid.jsonl" 2>&1
    cut -c1-200 "$out/$date-h200-gluon-backward-grid.jsonl"
    timeout 90 python benchmarks/gluon_backward.py reruns 300 > "$out/gluon-backward-reruns.txt" 2>&1
    cat "$out/gluon-backward-reruns.txt" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
