#!/bin/bash
# The GPU measurements still owed by issues 3-5, as stages that each fit one 10-minute device call.
#   bash benchmarks/h200_runbook.sh tests     # GPU test suite (-n 14) + memcheck of the new kernels
#   bash benchmarks/h200_runbook.sh verify    # tests and decode in one call, with tighter limits
#   bash benchmarks/h200_runbook.sh grid128   # the default bench grid, d = 128, every provider
#   bash benchmarks/h200_runbook.sh grid64    # the same, d = 64
#   bash benchmarks/h200_runbook.sh decode    # bench --mode decode (issue 5 grid) + varlen vs dense
#   bash benchmarks/h200_runbook.sh schedules # forward schedules forced, beside cuDNN and FlexAttention,
#                                             # then where the warp-specialized schedule goes wrong
#   bash benchmarks/h200_runbook.sh backward  # backward schedules 0 (two launches) and 1 (one): GPU tests, then
#                                             # both timed beside the table's choice, cuDNN, FA2 and FlexAttention
#   bash benchmarks/h200_runbook.sh host      # host floors and host time per call (host_overhead.py), then
#                                             # paged-decode tiles and split counts where paged trails
#   bash benchmarks/h200_runbook.sh varlen    # where the packed batch's backward loses to the dense one:
#                                             # log-uniform vs equal lengths, backward tiles, kernel times
#   bash benchmarks/h200_runbook.sh forward   # forward tiles where flashtile trails FlexAttention (d 64 with
#                                             # FlexAttention's 128 x 128 / 4 warps; d 128 at 1k and 4k)
#   bash benchmarks/h200_runbook.sh fwdgrid   # the forward grid with every peer (d 128 and 64), then 128-key blocks
#                                             # for banded d = 128 problems (the table keeps 64: not yet measured)
#   bash benchmarks/h200_runbook.sh bwdhost   # the backward's TMA schedules with host-side descriptors (branch
#                                             # prepared/backward-host-descriptors): GPU tests, then schedules 0-3
#                                             # timed in one run (pointer vs TMA loads, two launches vs one)
#   bash benchmarks/h200_runbook.sh hostkernel # host time against kernel time at the 1k cells (host_overhead.py),
#                                             # then the causal forward's kernel time (causal_forward.py)
#   bash benchmarks/h200_runbook.sh d64bwd    # d = 64 backward tiles that ptxas compiles without spills (64 x 64 /
#                                             # 8 warps) beside the table's 32 x 128 / 4 warps, fwd+bwd (run in the
#                                             # ninth session: all slower, BENCHMARKS.md)
#   bash benchmarks/h200_runbook.sh dqtile    # d = 64 backward with the dQ kernel's own tile: its GPU tests, then two
#                                             # launches with dQ tiles 128 x 64 / 8 warps etc. beside one launch and
#                                             # FA2, fwd+bwd (run in the tenth session; 128 x 64 / 8 with TMA is now
#                                             # the table's)
#   bash benchmarks/h200_runbook.sh hostab    # host time per call, a previous tree (gpu-scratch/old/src, e.g.
#                                             # `git archive <commit> src | tar -x -C gpu-scratch/old`) against
#                                             # this one, interleaved (host_overhead.py --quick)
#   bash benchmarks/h200_runbook.sh decodehost # a decode step's host time, a previous tree (gpu-scratch/old/src) against
#                                             # this one, interleaved (host_overhead.py --quick --decode), then the
#                                             # decode grid (bench --mode decode, flashtile[triton] and SDPA)
#   bash benchmarks/h200_runbook.sh page16    # the page-16 decode cells that missed 0.9x SDPA (8 x 128k, 1 x 32k) and
#                                             # 64 x 32k, under 16-key tiles and split counts (kernels replayed
#                                             # from CUDA graphs), then the API call beside SDPA
#   bash benchmarks/h200_runbook.sh batch1    # the batch-1 decode kernel under explicit split counts and 2 / 3 stages
#                                             # (run in the sixteenth session: 3 stages at two waves now the table's)
#   bash benchmarks/h200_runbook.sh packedd64 # the packed d = 64 forward under a 128-register cap against the dense
#                                             # rate (run in the sixteenth session: the cap is now the table's)
#   bash benchmarks/h200_runbook.sh smallpages # the small paged decode cells still under 0.9x SDPA by kernel time
#                                             # (1 x 4k pages of 16, 1 x 32k pages of 16 / 256; sixteenth session)
#                                             # under more tiles and split counts, graph replay
#   bash benchmarks/h200_runbook.sh wsstress  # the warp-specialized forward (with the row fix) and the table's TMA
#                                             # forward + backward rerun beside the GPU suite, counting runs that
#                                             # differ bitwise
# Results go to $OUT (the device tool's output folder), or ./out when OUT is unset.
set -u
stage=${1:?stage: tests, verify, grid128, grid64, decode, schedules, backward, host, varlen, forward, fwdgrid, bwdhost, hostkernel, d64bwd, dqtile, hostab, decodehost, page16, batch1, packedd64, smallpages or wsstress}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
date=$(date +%Y-%m-%d)
case $stage in
  tests|verify)
    # the full log comes back (a run stopped by its timeout still leaves what it printed)
    suite=$([ "$stage" = verify ] && echo 270 || echo 330)
    FLASHTILE_TEST_DEVICE=cuda timeout "$suite" python -m pytest -q -n 14 -p no:cacheprovider -rfE tests \
      --ignore=tests/test_triton_compile.py > "$out/tests.txt" 2>&1
    tail -4 "$out/tests.txt"
    FLASHTILE_TEST_DEVICE=cuda timeout "$([ "$stage" = verify ] && echo 90 || echo 200)" \
      compute-sanitizer --tool memcheck --error-exitcode 1 \
      python -m pytest -q -x -p no:cacheprovider tests/test_varlen.py tests/test_kvcache.py tests/test_triton_schedules.py \
      -k "(triton and (mixed or contiguous or page16) and fp16) or tma_backward" > "$out/memcheck.txt" 2>&1
    echo "memcheck exit $?"; tail -4 "$out/memcheck.txt"
    [ "$stage" = verify ] && exec bash "$0" decode ;;
  grid128|grid64)
    d=${stage#grid}
    # 1 s per call keeps the float32 torch backend's 16k rows (1-5 s a call) from using up the call
    timeout 555 python -m flashtile bench --device cuda --headdim "$d" --max-call-seconds 1 \
      --json "$out/$date-h200-full-grid-d$d.json" > "$out/grid-d$d.txt" 2> "$out/grid-d$d.progress"
    tail -3 "$out/grid-d$d.progress" ;;
  decode)
    # the torch backend's decode (float32 math, a Python loop over sequences) is left out: seconds per row
    timeout 170 python -m flashtile bench --mode decode --device cuda --providers "flashtile[triton],sdpa" \
      --json "$out/$date-h200-decode.json" > "$out/decode.txt" 2> "$out/decode.progress"
    tail -30 "$out/decode.txt"
    timeout 75 python benchmarks/varlen_vs_dense.py > "$out/varlen.txt" 2>&1
    cat "$out/varlen.txt"
    timeout 80 python benchmarks/tune_decode.py --graphs > "$out/decode-graphs.txt" 2>&1
    timeout 60 python benchmarks/host_overhead.py > "$out/host-overhead.txt" 2>&1 ;;
  schedules)
    timeout 400 python -m flashtile bench --device cuda --mode fwd \
      --providers "flashtile[triton],flashtile[triton:tma],flashtile[triton:tma-ws],sdpa-cudnn,flex" \
      --json "$out/$date-h200-forward-schedules.json" > "$out/schedules.txt" 2> "$out/schedules.progress"
    tail -40 "$out/schedules.txt"
    timeout 150 python benchmarks/ws_determinism.py > "$out/ws_determinism.txt" 2>&1
    cat "$out/ws_determinism.txt" ;;
  backward)
    FLASHTILE_TEST_DEVICE=cuda timeout 150 python -m pytest -q -n 8 -p no:cacheprovider -rfE \
      tests/test_triton_schedules.py tests/test_gpu.py -k "one_launch or deterministic" > "$out/backward-tests.txt" 2>&1
    tail -3 "$out/backward-tests.txt"
    timeout 400 python -m flashtile bench --device cuda --mode bwd,fwd+bwd --max-call-seconds 1 \
      --providers "flashtile[triton],flashtile[triton:bwd0],flashtile[triton:bwd1],flashtile[triton:bwd3],sdpa-cudnn,sdpa-flash,flex" \
      --json "$out/$date-h200-backward-schedules.json" > "$out/backward.txt" 2> "$out/backward.progress"
    tail -40 "$out/backward.txt"
    # the table's d = 128 backward tile beside its neighbours, at the shapes it is furthest behind FlexAttention
    timeout 150 python benchmarks/tune_triton.py --headdim 128 --seqlens 4096,16384 --causal no --modes fwd+bwd \
      --bwd-configs 64x128w8s3t1,64x128w8s4t1,64x128w8s3t0,128x64w8s3t1 > "$out/backward-tiles.txt" 2>&1
    tail -14 "$out/backward-tiles.txt" ;;
  host)
    timeout 90 python benchmarks/host_overhead.py > "$out/host-overhead.txt" 2>&1
    grep -E "^(floor|d |decode)" "$out/host-overhead.txt"
    timeout 300 python benchmarks/tune_decode.py --variants --cells 8x131072x16,8x131072x256,1x131072x16,8x32768x16 \
      --tiles 128x4x2,128x4x2p,128x4x3,128x4x3p --split-factors 1,2,3,4,6 > "$out/decode-tune.txt" 2>&1
    tail -30 "$out/decode-tune.txt" ;;
  varlen)
    timeout 100 python benchmarks/varlen_vs_dense.py --skip-padded \
      --bwd-tiles 64x128w8s3t1,32x64w4s3t1 > "$out/varlen-loguniform.txt" 2>&1
    timeout 100 python benchmarks/varlen_vs_dense.py --skip-padded --equal-lengths \
      --bwd-tiles 64x128w8s3t1,32x64w4s3t1 > "$out/varlen-equal.txt" 2>&1
    grep -h "x dense\|varlen / dense" "$out/varlen-loguniform.txt" "$out/varlen-equal.txt" ;;
  forward)
    timeout 200 python benchmarks/tune_triton.py --headdim 64 --modes fwd --peers "" \
      --configs 128x64w4s3t0,128x64w8s3t1,128x128w4s3t0,128x128w4s3t1,128x128w8s3t1 > "$out/forward-d64.txt" 2>&1
    timeout 150 python benchmarks/tune_triton.py --headdim 128 --seqlens 1024,4096 --modes fwd --peers "" \
      --configs 128x64w8s3t0,128x64w8s3t1,128x64w8s4t1,64x64w4s3t0,128x32w4s3t0 > "$out/forward-d128.txt" 2>&1
    grep -h TFLOP "$out/forward-d64.txt" "$out/forward-d128.txt" | cut -c1-100 ;;
  fwdgrid)
    timeout 150 python -m flashtile bench --device cuda --mode fwd --headdim 128,64 \
      --providers "flashtile[triton],sdpa-cudnn,sdpa-flash,flex" --json "$out/$date-h200-grid-fwd.json" \
      > "$out/grid-fwd.txt" 2>/dev/null
    grep "^flashtile\|^flex" "$out/grid-fwd.txt" | cut -c1-100
    timeout 150 python benchmarks/tune_triton.py --headdim 128 --causal yes --modes fwd --peers "" \
      --configs 128x64w8s3t1,128x128w8s3t1 > "$out/tiles-causal.txt" 2>&1
    grep -h TFLOP "$out/tiles-causal.txt" | cut -c1-100 ;;
  bwdhost)
    FLASHTILE_TEST_DEVICE=cuda timeout 150 python -m pytest -q -n 12 -p no:cacheprovider -rfE \
      tests/test_triton_schedules.py tests/test_gpu.py > "$out/tests.txt" 2>&1
    tail -2 "$out/tests.txt"
    timeout 330 python -m flashtile bench --device cuda --mode bwd --headdim 128,64 --max-call-seconds 1 \
      --providers "flashtile[triton:bwd1],flashtile[triton:bwd3],flashtile[triton:bwd0],flashtile[triton:bwd2]" \
      --json "$out/$date-h200-backward-host-descriptors.json" > "$out/bwdhost.txt" 2>/dev/null
    grep "^flashtile" "$out/bwdhost.txt" | cut -c1-100 ;;
  hostkernel)
    timeout 120 python benchmarks/host_overhead.py > "$out/host-overhead.txt" 2>&1
    grep -E "^(floor|d |decode)" "$out/host-overhead.txt"
    timeout 120 python benchmarks/causal_forward.py now > "$out/causal-forward.txt" 2>&1
    grep kernel "$out/causal-forward.txt" ;;
  d64bwd)
    timeout 240 python benchmarks/tune_triton.py --headdim 64 --modes fwd+bwd --peers flash \
      --bwd-configs 64x64w8s3t1,64x64w8s4t1,64x64w8s3t0,32x128w8s4t1,64x128w8s2t1 > "$out/bwd-tiles-d64.txt" 2>&1
    grep -h TFLOP "$out/bwd-tiles-d64.txt" | cut -c1-120 ;;
  dqtile)
    FLASHTILE_TEST_DEVICE=cuda timeout 100 python -m pytest -q -n 12 -p no:cacheprovider -rfE \
      tests/test_triton_schedules.py -k "dq_" > "$out/dq-tests.txt" 2>&1
    tail -2 "$out/dq-tests.txt"
    timeout 330 python benchmarks/tune_triton.py --headdim 64 --modes fwd+bwd --peers flash \
      --bwd-configs 32x128w4s3t1,32x128w4s3t0,32x128w4s3t0q128x64w8,32x128w4s3t0q128x128w8,32x128w4s3t0q128x32w8,32x128w4s3t0q64x64w4,32x128w4s3t2q128x64w8 \
      > "$out/dq-tiles-d64.txt" 2>&1
    grep -h TFLOP "$out/dq-tiles-d64.txt" | cut -c1-130 ;;
  hostab)
    for round in 1 2; do
      PYTHONPATH=$PWD/gpu-scratch/old/src timeout 75 python benchmarks/host_overhead.py --quick old$round 2>&1 \
        | grep "^old" >> "$out/host-ab.txt"
      timeout 75 python benchmarks/host_overhead.py --quick new$round 2>&1 | grep "^new" >> "$out/host-ab.txt"
    done
    sort -k2 "$out/host-ab.txt" ;;
  decodehost)
    for round in 1 2; do
      PYTHONPATH=$PWD/gpu-scratch/old/src timeout 60 python benchmarks/host_overhead.py --quick old$round --decode \
        2>&1 | grep "^old" >> "$out/decode-host-ab.txt"
      timeout 60 python benchmarks/host_overhead.py --quick new$round --decode 2>&1 | grep "^new" \
        >> "$out/decode-host-ab.txt"
    done
    sort -k2 "$out/decode-host-ab.txt"
    timeout 170 python -m flashtile bench --mode decode --device cuda --providers "flashtile[triton],sdpa" \
      --json "$out/$date-h200-decode.json" > "$out/decode.txt" 2> "$out/decode.progress"
    tail -30 "$out/decode.txt" ;;
  page16)
    timeout 300 python benchmarks/tune_decode.py --variants --cells 8x131072x16,1x32768x16,64x32768x16 \
      --tiles 16x2x8,16x1x8,16x2x6,16x4x8 --split-factors 1,2,4 > "$out/page16.txt" 2>&1
    grep -v "^ *$" "$out/page16.txt" ;;
  batch1)
    # the batch-1 decode kernel, 2.7% behind SDPA's at 1 x 128k (fifteenth session): explicit split counts around
    # one wave of three programs per SM (3 x 132 / 8 = 49), 2 and 3 stages, contiguous and paged
    timeout 300 python benchmarks/tune_decode.py --variants --cells 1x131072x0,1x131072x256,1x131072x16,1x32768x0,1x4096x16 \
      --tiles 64x4x2,64x4x3,16x2x8 --splits 16,33,40,49,56,64,66 --top 8 > "$out/batch1.txt" 2>&1
    grep -v "^ *$" "$out/batch1.txt" ;;
  packedd64)
    # the packed d = 64 forward at the table's tile (capped at 128 registers since the sixteenth session) and
    # forced to it with the cap, against the dense rate
    timeout 200 python benchmarks/varlen_vs_dense.py --skip-padded --headdim 64 --heads 32 \
      --fwd-tiles 128x64w8s3 --fwd-max-registers 128 > "$out/packed-d64.txt" 2>&1
    grep "dense\|varlen" "$out/packed-d64.txt" | cut -c1-160 ;;
  smallpages)
    timeout 300 python benchmarks/tune_decode.py --variants --cells 1x4096x16,1x32768x16,1x32768x256,1x4096x0 \
      --tiles 16x2x8,16x4x8,16x2x4,32x2x6,32x4x4,64x4x2,64x4x3 --split-factors 1,2,4 --top 6 > "$out/smallpages.txt" 2>&1
    grep -v "^ *$" "$out/smallpages.txt" ;;
  wsstress)
    # contention is where the one differing run appeared (fifth session): the suite on 11 workers beside it
    FLASHTILE_TEST_DEVICE=cuda timeout 330 python -m pytest -q -n 11 -p no:cacheprovider tests \
      --ignore=tests/test_triton_compile.py > "$out/tests.txt" 2>&1 &
    # two processes on the table's TMA forward + backward (default at d = 128 from 4k keys), two on schedule 2
    for i in 1 2; do timeout 330 python benchmarks/ws_determinism.py --stress 300 --target table-tma \
      > "$out/stress-tma$i.txt" 2>&1 & done
    for i in 1 2; do timeout 330 python benchmarks/ws_determinism.py --stress 300 > "$out/stress$i.txt" 2>&1 & done
    wait
    tail -2 "$out/tests.txt"; grep -h "stress:\|differs" "$out"/stress*.txt ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
