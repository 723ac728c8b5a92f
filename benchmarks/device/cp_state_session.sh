# gdn_cp_state on one GPU (#56): the GPU test, then the cost per rank against head-split CP and no CP (each rank's share
# run in turn; fla-core 0.4.2's chunk steps (state_steps.py) beside the one-pass path; --two-pass also times the first
# version; --profile prints each variant's kernels). A step cut by the deadline runs again in the next call on the
# same warm machine (lib.sh).
export T0=$(date +%s) DEADLINE=${DEADLINE:-575} LOGS=$OUT SAVE_CACHE=${SAVE_CACHE:-1}
source benchmarks/device/lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step cpstate-0.19.2 60 $(PP 0.19.2) $PT tests/gpu/test_cp_state_gpu.py
B="python3 -m benchmarks.bench_cp_state --heads 32 --dk 128 --dv 128"
step bench-128k 60 $(PP 0.19.2) $B --lengths 131072 --cps 4 --no-numerics --profile --json $LOGS/cp-state-128k.json
step bench-32k 60 $(PP 0.19.2) $B --lengths 32768 --cps 2,4 --json $LOGS/cp-state-32k.json
step bench-512k 60 $(PP 0.19.2) $B --lengths 524288 --cps 8 --no-numerics --json $LOGS/cp-state-512k.json
finish "cp-state-gpu\|passed\|failed\|Error\|length\|\[plan\]\|Self CUDA\|chunk_\|solve_tril\|recompute\|Name  "
