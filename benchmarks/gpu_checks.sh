#!/bin/bash
# Robustness checks on a CUDA GPU (the H200 of BENCHMARKS.md), each stage within one 10-minute device call.
#   bash benchmarks/gpu_checks.sh crashes OLD  # flash-attn's one-query / one-key shapes on the tree at OLD (a
#                                              # checkout's src, e.g. `git archive <commit> src | tar -x -C
#                                              # gpu-scratch/old`), one process, empty Triton cache; then this tree
#   bash benchmarks/gpu_checks.sh suite        # the GPU test suite (-n 14)
#   bash benchmarks/gpu_checks.sh memcheck     # compute-sanitizer memcheck over padded head dims, ALiBi, causal,
#                                              # packed q/k/v views and packed sequences, then the decode tests
#   bash benchmarks/gpu_checks.sh gluon        # compute-sanitizer memcheck and racecheck over small cases of the Gluon
#                                              # forward in each of its settings (gluon_forward.py small)
#   bash benchmarks/gpu_checks.sh timing OLD   # kernel times at a few cells, the tree at OLD against this one,
#                                              # interleaved twice
# Output goes to $OUT (the device tool's output folder), or ./out when OUT is unset.
set -u
stage=${1:?stage: crashes, suite, memcheck, gluon or timing}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
here=$PWD
case $stage in
  crashes)
    old=${2:?the old tree folder, holding src}
    for tree in "$old" "$here"; do
      name=$(basename "$tree")
      cache=$(mktemp -d)
      PYTHONPATH=$tree/src TRITON_CACHE_DIR=$cache timeout 240 python benchmarks/gpu_checks.py seqlen-one \
        > "$out/seqlen-one-$name.txt" 2> "$out/seqlen-one-$name.err"
      echo "seqlen-one on $name: exit $?"; grep -v ": ok$" "$out/seqlen-one-$name.txt" | head -20
    done ;;
  suite)
    FLASHTILE_TEST_DEVICE=cuda PYTHONPATH=$here/src TRITON_CACHE_DIR=$here/.triton-cache timeout "${2:-480}" \
      python -m pytest -q -n 14 -p no:cacheprovider -rfEs tests --ignore=tests/test_triton_compile.py \
      > "$out/suite.txt" 2>&1
    echo "suite exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.txt" | head -30; tail -2 "$out/suite.txt" ;;
  memcheck)
    export PYTHONPATH=$here/src TRITON_CACHE_DIR=$here/.triton-cache
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/gpu_checks.py memcheck \
      > "$out/memcheck.txt" 2>&1
    echo "memcheck exit $?"; grep -E ": |ERROR SUMMARY" "$out/memcheck.txt" | tail -16
    FLASHTILE_TEST_DEVICE=cuda timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 \
      python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -k "kvcache_decode_realistic or 65535" \
      > "$out/memcheck-tests.txt" 2>&1
    echo "memcheck tests exit $?"; tail -3 "$out/memcheck-tests.txt" ;;
  gluon)
    export PYTHONPATH=$here/src TRITON_CACHE_DIR=$here/.triton-cache
    for tool in memcheck racecheck; do
      timeout 280 compute-sanitizer --tool $tool --error-exitcode 1 python benchmarks/gluon_forward.py small \
        > "$out/gluon-$tool.txt" 2>&1
      echo "$tool exit $?"; grep -E ": |ERROR SUMMARY|RACECHECK SUMMARY" "$out/gluon-$tool.txt" | tail -12
    done ;;
  timing)
    old=${2:?the old tree folder, holding src}
    for round in 1 2; do
      for tree in "$old" "$here"; do
        PYTHONPATH=$tree/src TRITON_CACHE_DIR=$here/.triton-cache-$(basename "$tree") timeout 120 \
          python benchmarks/gpu_checks.py timing "$(basename "$tree")-$round" >> "$out/timing.txt" 2>&1
      done
    done
    grep -v "^NVIDIA" "$out/timing.txt" | sort -k2,4 -s ;;
esac
