#!/usr/bin/env bash
# For this project's offline device machine (wheels carried in .whl/); users with a GPU follow the README.
# The whole GPU plan on a 2-GPU H200 machine, resumable: each finished step leaves /tmp/done/<step>,
# so calling it again on the same (warm) machine picks up where the last call's deadline cut it
# (kernels stay compiled in /tmp/triton-cache). Run from the project root with .whl/ (from
# ../shared/gpu/fetch-wheels.sh) and .whl6/ (`pip download --no-deps fla-core==0.6.0 -d .whl6`):
#   DEADLINE=560 bash benchmarks/device/gpu_session.sh      (seconds this call may use; OUT gets all logs)
# Two lanes run side by side (GPU 0: tests/gpu per release; both GPUs: the fla-core 0.6.0 doctor and
# crash check, then the 2-GPU context-parallel test per release), then the benchmarks alone.
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-565}
root=$(pwd); LOGS=/tmp/logs
[ -n "$(ls /tmp/done 2>/dev/null)" ] || rm -rf /tmp/xver  # a fresh plan never compares against an older run
mkdir -p /tmp/xver
export GDN_XVER_DIR=/tmp/xver PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
source benchmarks/device/lib.sh
[ -d /tmp/fla6 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla6 .whl6/*.whl
lane1() {
  for v in 0.17.1 0.19.2 0.16.1 0.18.2; do
    step gpu-$v 90 $(PP $v) CUDA_VISIBLE_DEVICES=0 $PT tests/gpu
  done
}
lane2() {
  step fla6-doctor 60 $(PP 0.17.1 /tmp/fla6) CUDA_VISIBLE_DEVICES=1 python3 -m gdn_compat --key-head-dim 128
  step fla6-backward 90 $(PP 0.17.1 /tmp/fla6) CUDA_VISIBLE_DEVICES=1 $PT tests/gpu/test_doctor_gpu.py
  for v in 0.17.1 0.18.2 0.16.1 0.19.2; do
    step cp-$v 90 $(PP $v) $PT tests/gpu/test_gdn_cp_gpu.py
  done
}
lane1 & lane2 & wait
# benchmarks need the GPUs to themselves
for v in 0.17.1 0.19.2; do
  step bench-$v 100 $(PP $v) CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_gdn_thd --json-dir /tmp/logs
done
for v in 0.17.1 0.18.2; do
  step benchcp-$v 100 $(PP $v) python3 -m benchmarks.bench_gdn_cp
done
echo; (cd $LOGS && grep -H "passed\|failed\|skipped\|error\|Error\|\[gdn-thd\|\[xver\|\[mtp\|\[doctor\|\[cp\|verdict\|fla-640\|THD fwd\|^THD\|^padded\|^per-seq\|^megatron-core\|^mode" *.log | grep -v "^\s*warnings.warn" | cut -c1-400 | head -120)
echo "[lanes] finished at +$(( $(date +%s) - T0 ))s:"; for f in /tmp/done/*; do echo "  $(basename $f) rc=$(cat $f)"; done
if [ -n "${OUT:-}" ]; then
  for f in $LOGS/*.log; do echo "===== $(basename $f)"; cat $f; done > $OUT/all-logs.txt
  cp $LOGS/*.json $OUT/ 2>/dev/null
fi
true
