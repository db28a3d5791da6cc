# Shared by the attnctl_*_test.sh scripts (sourced, not run): a scratch folder, an attnserve on
# a free loopback port, attnctl aimed at it, checks, and a clean stop.
#
#   source "${here}/attnctl_test_lib.sh"
#   start_server ATTNSERVE ATTNCTL   # sets workdir and target; fails unless the port shows
#   ctl attend --demo                # attnctl --target=... --timeout=30s, at most 60 s
#   expect_exit 2 "needs --png" ctl grid --demo
#   stop_server                      # SIGTERM; fails unless attnserve exits 0 within 30 s

workdir=$(mktemp -d)
server_pid=""
target=""
attnctl=""

cleanup() {
  if [[ -n ${server_pid} ]] && kill -0 "${server_pid}" 2>/dev/null; then
    kill -KILL "${server_pid}" 2>/dev/null || true
  fi
  rm -rf "${workdir}"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP PIPE  # So that cleanup runs, and attnserve never outlives the test.
trap 'fail "line ${LINENO}: ${BASH_COMMAND} failed"' ERR

fail() {
  echo "FAIL: $*" >&2
  echo "--- server log" >&2
  tail -20 "${workdir}/server.log" >&2 || true
  exit 1
}

start_server() {
  attnctl=$(realpath "$2")
  local attnserve
  attnserve=$(realpath "$1")
  : >"${workdir}/server.log"
  "${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 --threads=2 --drain_grace_seconds=0 \
    >"${workdir}/server.log" 2>&1 &
  server_pid=$!
  local port=""
  for _ in $(seq 1 100); do
    port=$(sed -n 's/^attnserve [^ ]* listening on 127\.0\.0\.1:\([0-9]*\),.*/\1/p' \
      "${workdir}/server.log")
    [[ -n ${port} ]] && break
    kill -0 "${server_pid}" 2>/dev/null || fail "attnserve exited during start-up"
    sleep 0.1
  done
  [[ -n ${port} ]] || fail "attnserve did not report its port within 10 s"
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

stop_server() {
  kill -TERM "${server_pid}"
  for _ in $(seq 1 300); do
    kill -0 "${server_pid}" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "${server_pid}" 2>/dev/null && fail "attnserve still running 30 s after SIGTERM"
  local status
  set +e
  wait "${server_pid}"
  status=$?
  set -e
  server_pid=""
  [[ ${status} -eq 0 ]] || fail "attnserve exited ${status} after SIGTERM, expected 0"
}
