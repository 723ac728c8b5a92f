# Sourced by the device plans in this folder (offline device machine, wheels carried in .whl/).
# Needs: T0, DEADLINE. Sets the environment (root, LOGS default here) and unpacks a carried .tcache.
# Optional: WANT (" step step ... " or " all ").
# A finished step leaves /tmp/done/<step>; a step cut by the deadline does not, so a later call on the
# same warm machine runs it again.
root=${root:-$(pwd)}; LOGS=${LOGS:-/tmp/logs}; mkdir -p /tmp/xver
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
export TILELANG_CACHE_DIR=/tmp/tilelang-cache  # FlashQLA's TileLang kernels compile here on first use
export CUBLAS_WORKSPACE_CONFIG=:4096:8
if [ ! -d /tmp/triton-cache ] && ls .tcache/tcache.tar.xz.* >/dev/null 2>&1; then  # a carried Triton cache
  cat .tcache/tcache.tar.xz.* | tar -C /tmp -xJf - && echo "[plan] Triton/inductor cache restored: $(du -sh /tmp/triton-cache | cut -f1)"
fi
if [ ! -d /tmp/tilelang-cache ] && ls .tcache/qcache.tar.xz.* >/dev/null 2>&1; then  # a carried TileLang cache
  cat .tcache/qcache.tar.xz.* | tar -C /tmp -xJf - && echo "[plan] TileLang cache restored: $(du -sh /tmp/tilelang-cache | cut -f1)"
fi
mkdir -p /tmp/done "$LOGS"
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
for v in 0.16.1 0.17.1 0.18.2 0.19.2; do  # the carried wheels only
  ls .whl/megatron_core-$v-*.whl >/dev/null 2>&1 || continue
  [ -d /tmp/mc-$v ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mc-$v .whl/megatron_core-$v-*.whl
done
[ -d /tmp/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/fla_core-*.whl
QSITE=""  # the optional FlashQLA stack (../shared/gpu/fetch-flashqla.sh): on PYTHONPATH after fla
if [ -f .whl/flashqla-site.tar.xz ]; then [ -d /tmp/qsite ] || tar xJf .whl/flashqla-site.tar.xz -C /tmp; QSITE=":/tmp/qsite"; fi
step() {  # step NAME MIN_SECONDS ENV... COMMAND...
  local name=$1 min=$2; shift 2
  [ -e /tmp/done/$name ] && return 0
  [ "${WANT:- all }" = " all " ] || [[ "$WANT" == *" $name "* ]] || return 0
  local l; l=$(left); if [ "$l" -lt "$min" ]; then echo "[plan] skip $name: ${l}s left"; return 0; fi
  echo "[plan] start $name at +$(( $(date +%s) - T0 ))s"
  local s=$(date +%s)
  timeout -k 10 "$l" env "$@" > $LOGS/$name.log 2>&1; local rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "[plan] $name cut at deadline after $(( $(date +%s) - s ))s"; return 0; fi
  echo "$rc" > /tmp/done/$name
  echo "[plan] done $name rc=$rc in $(( $(date +%s) - s ))s"
}
PP() { echo "PYTHONPATH=$root:/tmp/mc-$1:${2:-/tmp/fla}$QSITE"; }  # PP VERSION [FLA_DIR]
PT="python3 -m pytest -q -s -rs -p no:cacheprovider -W ignore"
finish() {  # finish GREP_PATTERN: the matching log lines, the steps' exit codes, logs/JSON/Triton cache to $OUT
  echo; (cd $LOGS && grep -H "$1" *.log | grep -v "warnings.warn\|^\S*:\s*$" | cut -c1-400 | head -150)
  echo "[plan] finished at +$(( $(date +%s) - T0 ))s:"; for f in /tmp/done/*; do echo "  $(basename $f) rc=$(cat $f)"; done
  [ -n "${OUT:-}" ] || return 0
  for f in $LOGS/*.log; do echo "===== $(basename $f)"; cat $f; done > $OUT/all-logs.txt
  tar -C $LOGS -cf $OUT/json.tar $(cd $LOGS && ls *.json 2>/dev/null) 2>/dev/null
  if [ "${SAVE_CACHE:-1}" = 1 ]; then  # for the next fresh machine: Triton (cubin + json) and inductor, then TileLang
    (cd /tmp && find triton-cache -name '*.cubin' -o -name '*.json' | tar -cf - -T - inductor-cache 2>/dev/null) \
      | xz -T0 -2 | split -b 15M -a 1 - $OUT/tcache.tar.xz.
    [ -d /tmp/tilelang-cache ] && tar -C /tmp -cf - tilelang-cache | xz -T0 -2 | split -b 15M -a 1 - $OUT/qcache.tar.xz.
    for kind in tcache qcache; do
      n=$(ls $OUT/$kind.tar.xz.* 2>/dev/null | wc -l)
      [ "$n" -le 3 ] || { echo "[plan] $kind too big ($n parts): not kept"; rm -f $OUT/$kind.tar.xz.*; }
    done
  fi
}
