#!/usr/bin/env bash
# For this project's offline device machine (wheels and the FlashQLA stack carried in .whl/); users with a GPU run
# benchmarks/bench_train.py as its docstring says. #38's training runs, every JSON and log straight to $LOGS:
#   DEADLINE=560 SAVE_CACHE=0 bash benchmarks/device/train_session.sh [STEP ...]
# (logs and JSON in /tmp/logs; $OUT gets all-logs.txt and json.tar: a call returns only a few files)
# steps: train-0.19.2 (native, native-seed1, fused, flashqla, both, det-both), train-0.17.1 (gdn_thd: default, both)
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-560}; WANT=" ${*:-all} "
source benchmarks/device/lib.sh  # environment, carried caches, step/finish
STEPS=${STEPS:-300}
step train-0.19.2 120 $(PP 0.19.2) python3 -m benchmarks.bench_train --steps $STEPS --json-dir $LOGS \
  --configs native,both,fused,flashqla,det-both,native-seed1
step train-0.17.1 60 $(PP 0.17.1) python3 -m benchmarks.bench_train --steps $STEPS --json-dir $LOGS --configs default,both
finish "final loss\|failed\|Error\|step  2[0-9][0-9]\|step    0"
true
