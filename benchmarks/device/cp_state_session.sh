export T0=$(date +%s) DEADLINE=${DEADLINE:-575} LOGS=$OUT SAVE_CACHE=0
source benchmarks/device/lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step cpstate-0.19.2 60 $(PP 0.19.2) $PT tests/gpu/test_cp_state_gpu.py
B="python3 -m benchmarks.bench_cp_state --heads 32 --dk 128 --dv 128"
step bench-32k 60 $(PP 0.19.2) $B --lengths 32768 --cps 2,4,8 --json $LOGS/cp-state-32k.json
step bench-128k 60 $(PP 0.19.2) $B --lengths 131072 --cps 4,8 --json $LOGS/cp-state-128k.json
step bench-512k 60 $(PP 0.19.2) $B --lengths 524288 --cps 4,8 --no-numerics --json $LOGS/cp-state-512k.json
finish "cp-state-gpu\|passed\|failed\|Error\|length"
