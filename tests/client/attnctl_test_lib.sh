# Shared by the attnctl_*_test.sh scripts (sourced, not run): a scratch folder, an attnserve on
# a free loopback port, attnctl aimed at it, checks, and a clean stop.
#
#   source "${here}/attnctl_test_lib.sh"
#   start_server ATTNSERVE ATTNCTL   # sets workdir and target; fails unless the port shows
#   ctl attend --demo                # attnctl --target=... --timeout=30s, at most 60 s
#   expect_exit 2 "needs --png" ctl grid --demo
#   stop_server                      # SIGTERM; fails unless attnserve exits 0 within 30 s

lib_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${lib_dir}/../attnserve_process_lib.sh"
target=""
attnctl=""

trap 'exit 1' INT TERM HUP PIPE  # So that cleanup runs, and attnserve never outlives the test.
trap 'fail "line ${LINENO}: ${BASH_COMMAND} failed"' ERR

start_server() {
  attnctl=$(realpath "$2")
  start_attnserve "$(realpath "$1")" --threads=2 --drain_grace_seconds=0
  target="127.0.0.1:${port}"
}

ctl() { timeout 60 "${attnctl}" --target="${target}" --timeout=30s "$@"; }

# expect_exit STATUS PATTERN COMMAND...: runs COMMAND; fails unless it exits STATUS with PATTERN
# (a grep pattern) in its output.
expect_exit() {
  local expected=$1 pattern=$2 output status
  shift 2
  set +e
  output=$("$@" 2>&1)
  status=$?
  set -e
  [[ ${status} -eq ${expected} ]] ||
    fail "'$*' exited ${status}, expected ${expected}: ${output}"
  grep -q -- "${pattern}" <<<"${output}" || fail "'$*' printed '${output}', expected '${pattern}'"
}

stop_server() { stop_attnserve; }
