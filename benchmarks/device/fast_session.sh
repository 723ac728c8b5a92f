#!/usr/bin/env bash
# For this project's offline device machine (wheels, optionally the FlashQLA stack, carried in .whl/); users with
# a GPU follow the README. #30's single-H200 plan, one step at a time (no parallel lanes), every log written
# straight to $OUT so a call cut short still returns what ran:
#   LOGS=$OUT DEADLINE=500 SAVE_CACHE=0 bash benchmarks/device/fast_session.sh [STEP ...]
# steps: region (bench_region: the fused kernels alone), fused (GPU tests of gdn_fused), bench (bench_fast:
#        default,fused), upstream-VERSION (upstream's THD contract, #27), qla (GPU tests with FlashQLA),
#        bench-all (bench_fast: all four configurations + the stack), bench-qla (bench_fast, FlashQLA configurations),
#        sweep + pick-conv (the conv's launch shapes; the fastest set for the later steps), stack (bench_fast: the
#        8-layer stack alone, every configuration)
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-500}; WANT=" ${*:-all} "
source benchmarks/device/lib.sh  # environment, carried caches, step/finish
step region 20 $(PP 0.19.2) python3 -m benchmarks.bench_region
# pick-conv: time the conv's launch shapes (backward: rows x warps x programs per SM; forward: rows x warps), then set the fastest (q + v sections) in this machine's copy of
# gdn_compat/fused/conv.py for the steps after it (the same edit is then committed from the printed choice)
step sweep 20 $(PP 0.19.2) python3 -m benchmarks.bench_region --programs-per-sm "${PER_SM:-8}" \
  --sweep ${SWEEP:-8x2x16,8x2x8,8x4x12} --fwd-sweep ${FWD_SWEEP:-32x4}
if [[ "$WANT" == *" pick-conv "* ]] && ls $LOGS/sweep*.log >/dev/null 2>&1; then
  best=$(cat $LOGS/sweep*.log | python3 -c '
import re, sys, collections
b, f = collections.defaultdict(float), collections.defaultdict(float)
for line in sys.stdin:
    m = re.search(r"conv bwd [qv] \((\d+) rows x (\d+) warps, (\d+)/SM\)\s+([\d.]+) ms", line)
    if m:
        b[m.groups()[:3]] += float(m.group(4))
    m = re.search(r"conv fwd [qv] \(.*?(\d+) rows x (\d+) warps\)\s+([\d.]+) ms", line)
    if m:
        f[m.groups()[:2]] += float(m.group(3))
if b and f:
    print(", ".join(min(b, key=b.get)) + " " + ", ".join(min(f, key=f.get)))
')
  if [ -n "$best" ]; then
    set -- $best
    sed -i "s/^BWD_ROWS, BWD_WARPS, PROGRAMS_PER_SM = .*/BWD_ROWS, BWD_WARPS, PROGRAMS_PER_SM = $1 $2 $3/" gdn_compat/fused/conv.py
    sed -i "s/^FWD_ROWS, FWD_WARPS = [0-9]*, [0-9]*/FWD_ROWS, FWD_WARPS = $4 $5/" gdn_compat/fused/conv.py
    set --
  fi
  echo "[plan] conv launch shapes for the next steps: $(grep -E '^(BWD_ROWS|FWD_ROWS)' gdn_compat/fused/conv.py | tr '\n' ';')"
fi
step fused 200 $(PP 0.19.2) $PT tests/gpu/test_fast_gpu.py -k "fused and not flashqla"
step bench 120 $(PP 0.19.2) python3 -m benchmarks.bench_fast --configs default,fused --json $LOGS/fast-0.19.2.json
for v in 0.17.1 0.16.1; do step upstream-$v 30 $(PP $v) $PT tests/gpu/test_upstream_thd_gpu.py; done
step qla 100 $(PP 0.19.2) $PT tests/gpu/test_fast_gpu.py -k "flashqla"
step bench-all 120 $(PP 0.19.2) python3 -m benchmarks.bench_fast --rounds 2 --json $LOGS/fast-all-0.19.2.json
step bench-qla 40 $(PP 0.19.2) python3 -m benchmarks.bench_fast --configs ${CONFIGS:-default,flashqla,fused+flashqla} --rounds 2 \
  --no-stack --json $LOGS/fast-qla-0.19.2.json
step stack 60 $(PP 0.19.2) python3 -m benchmarks.bench_fast --no-layer --no-peak --configs ${CONFIGS:-default,fused+flashqla,fused,flashqla} --json $LOGS/fast-stack-0.19.2.json
finish "passed\|failed\|Error\|error\|^\[\|^  \|ratio\|bitwise\|^megatron-core\|^config\|^default\|^fused\|^flashqla\|outside"
true
