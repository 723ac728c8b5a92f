#!/usr/bin/env bash
# For this project's offline device machine (wheels carried in .whl/); users with a GPU follow the README.
# #21's single-H200 plan: the CUDA-graph tests on every release, the GPU suite on the releases whose packed
# path changed (chunk indices handed to fla), and benchmarks/bench_graphs.py. Resumable like h200_session.sh.
#   DEADLINE=560 bash benchmarks/device/graphs_session.sh [STEP ...]   (default: every step)
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-560}; WANT=" ${*:-all} "
source benchmarks/device/lib.sh  # environment, carried Triton cache, step/finish
lane1() {
  step graph-0.17.1 150 $(PP 0.17.1) $PT tests/gpu/test_cuda_graph_gpu.py
  step gpu-0.17.1 150 $(PP 0.17.1) GDN_XVER_DIR=/tmp/xver $PT tests/gpu --deselect tests/gpu/test_cuda_graph_gpu.py
  step graph-0.16.1 100 $(PP 0.16.1) $PT tests/gpu/test_cuda_graph_gpu.py
}
lane2() {
  step graph-0.19.2 150 $(PP 0.19.2) $PT tests/gpu/test_cuda_graph_gpu.py
  step graph-0.18.2 100 $(PP 0.18.2) $PT tests/gpu/test_cuda_graph_gpu.py
}
lane1 & lane2 & wait
for v in 0.17.1 0.19.2; do  # benchmarks: the GPU to themselves
  step bench-$v 90 $(PP $v) python3 -m benchmarks.bench_graphs --json $LOGS/graphs-$v.json
done
step bench-gs-0.19.2 90 $(PP 0.19.2) python3 -m benchmarks.bench_graphs --graph-safe --json $LOGS/graphs-gs-0.19.2.json
step gpu-0.19.2 120 $(PP 0.19.2) GDN_XVER_DIR=/tmp/xver $PT tests/gpu --deselect tests/gpu/test_cuda_graph_gpu.py
for v in 0.17.1 0.19.2; do  # the README's recipe end to end, and the native routes after a refactor
  step ex-$v 60 $(PP $v) python3 -m examples.graph_packed_model --steps 8 --layers 2 --check 2
done
for v in 0.19.2 0.18.2; do
  step routes-$v 60 $(PP $v) $PT tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_deterministic_gpu.py tests/gpu/test_doctor_gpu.py
done
finish "passed\|failed\|Error\|^\[\|^  \|bitwise\|^megatron-core\|^what\|^rl\|^16k"
true
