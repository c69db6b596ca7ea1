#!/bin/bash
export PYTHONPATH=$PWD/src TRITON_CACHE_DIR=$PWD/.triton-cache FLASHTILE_TEST_DEVICE=cuda
timeout 150 python -m pytest -q -n 8 -p no:cacheprovider -rfE tests/test_dropout.py "tests/test_gpu.py::test_gluon_forward_follows_the_oracle_and_repeats_its_bits[d128-causal-long-k-many-tiles-one-consumer]" "tests/test_gpu.py::test_gluon_forward_follows_the_oracle_and_repeats_its_bits[d128-causal-long-k-many-tiles-three-stages]" > $OUT/retest.txt 2>&1
grep -E "^FAILED|passed|failed" $OUT/retest.txt | tail -5
unset FLASHTILE_TEST_DEVICE
timeout 150 python benchmarks/feature_overhead.py sink 2>&1 | python -c "
import sys, json
for l in sys.stdin:
    if l.startswith('{'):
        r = json.loads(l); print(json.dumps({k: v for k, v in r.items() if 'kernels' not in k}))
    else: print(l.rstrip()[:200])
" | tee $OUT/sink_overhead.jsonl
