#!/usr/bin/env bash
# For this project's offline device machine (wheels carried in .whl/); users with a GPU follow the README.
# The single-H200 plan for #12/#13/#15/#16, resumable: a finished step leaves /tmp/done/<step>, so a
# second call on the same warm machine picks up where the deadline cut the first. A fresh machine can
# start from a carried Triton cache (.tcache/tcache.tar.xz.*, written to $OUT by the previous call).
#   DEADLINE=540 bash benchmarks/device/h200_session.sh [STEP ...]   (default: every step)
# Phase A runs three lanes side by side (correctness only: tests and determinism); phase B runs the
# benchmarks alone.
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-540}; WANT=" ${*:-all} "
source benchmarks/device/lib.sh  # environment, carried Triton cache, step/finish
# acc-*: the tests that compare releases (GDN_XVER_DIR), in order, for a call where gpu-0.17.1 ran before
lane1() {
  step acc-0.17.1 120 $(PP 0.17.1) GDN_XVER_DIR=/tmp/xver $PT tests/gpu/test_acceptance_gpu.py tests/gpu/test_gdn_thd_gpu.py
  for v in 0.17.1 0.19.2; do step gpu-$v 120 $(PP $v) GDN_XVER_DIR=/tmp/xver $PT tests/gpu; done
}
lane2() {
  for v in 0.16.1 0.18.2; do step gpu-$v 120 $(PP $v) $PT tests/gpu; done
  for v in 0.18.2 0.19.2 0.17.1; do step det-gpu-$v 45 $(PP $v) $PT tests/gpu/test_deterministic_gpu.py; done
  step mtp-0.16.1 60 $(PP 0.16.1) $PT tests/gpu/test_acceptance_gpu.py -k mtp
}
lane3() {  # a carried .tcache/det-call1.json is an earlier machine's run: same autotune cache, other process
  step det-0.17.1 90 $(PP 0.17.1) python3 -m benchmarks.determinism --json $LOGS/det-0.17.1.json \
    $([ -e .tcache/det-call1.json ] && echo --compare $root/.tcache/det-call1.json)
  step det-0.19.2 90 $(PP 0.19.2) python3 -m benchmarks.determinism --json $LOGS/det-0.19.2.json --compare $LOGS/det-0.17.1.json
}
lane1 & lane2 & lane3 & wait
for v in 0.17.1 0.19.2; do  # benchmarks: the GPU to themselves
  step bench-$v 60 $(PP $v) python3 -m benchmarks.bench_gdn_thd --json-dir $LOGS
done
for v in 0.17.1 0.19.2 0.18.2; do
  step stack-$v 90 $(PP $v) python3 -m benchmarks.bench_stack --json $LOGS/stack-$v.json
done
# diagnosis: the rl-pack layer's CPU time per op, after the stack (0.17.1) and in fresh processes
step prof-0.17.1 60 $(PP 0.17.1) TORCH_LOGS=recompiles python3 -m benchmarks.bench_stack --profile --reps 5
for v in 0.17.1 0.19.2; do
  step proflayer-$v 45 $(PP $v) TORCH_LOGS=recompiles python3 -m benchmarks.bench_stack --only layer --profile --reps 5
done
finish "passed\|failed\|error\|Error\|^\[\|bitwise\|differ\|^THD\|^padded\|^per-seq\|^megatron-core\|^mode\|^one GDN\|^stack\|^what\|^step\|^whole\|^fla\|^gating\|^q/k\|^in_proj\|^out_proj"
true
