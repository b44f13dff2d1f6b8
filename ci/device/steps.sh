# Sourced by the device scripts that run a list of bounded steps (one_gpu.sh,
# one_gpu_acceptance.sh). Not run on its own.
#
#   step NAME LIMIT COMMAND...   runs COMMAND under `timeout LIMIT`, its output in $OUT/NAME.log,
#                                and prints one line: its exit status, its seconds and the seconds
#                                since $t0. With MORI_STEPS set, only the steps it names run (the
#                                others leave an empty log). A failed step sets status=1. A
#                                script that defines step_done has it run after each step
#                                (one_gpu_acceptance.sh packs its logs there, so that a lease cut
#                                short still brings back what ran).
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${MORI_STEPS:-}" ] && [[ " $MORI_STEPS " != *" $name "* ]]; then
    : > "$OUT/$name.log"; echo "== $name: not in MORI_STEPS"; return 0
  fi
  local s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - s ))s (at $(( $(date +%s) - t0 ))s)"
  [ $rc = 0 ] || status=1
  if declare -F step_done > /dev/null; then step_done; fi
  return $rc
}
