# An attnserve process for shell tests (sourced, not run): a scratch folder, the server on a
# free loopback port, failure reports with its log, and a clean stop. Every server and extra
# process it is told of is killed on exit, so attnserve never outlives a test.
#
#   source "${here}/../attnserve_process_lib.sh"
#   start_attnserve ATTNSERVE [FLAG...]   # --address=127.0.0.1 --port=0 --metrics_port=0, then
#                                         # FLAGs (later ones win); sets port; fails unless the
#                                         # start-up line shows within 10 s
#   attnserve_prefix=(taskset -c 0)       # commands that exec attnserve (its pid stays theirs)
#   ...
#   stop_attnserve                        # SIGTERM; fails unless it exits 0 within 30 s
#   cleanup_pids+=("${pid}")              # another background process to kill on exit

workdir=$(mktemp -d)
server_pid=""
port=""
cleanup_pids=()
attnserve_prefix=()

cleanup() {
  for pid in "${cleanup_pids[@]}" ${server_pid}; do
    kill -KILL "${pid}" 2>/dev/null || true
  done
  rm -rf "${workdir}"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  echo "--- server log" >&2
  tail -20 "${workdir}/server.log" >&2 || true
  exit 1
}

start_attnserve() {
  local attnserve=$1
  shift
  # Create the log first: the `>` of a background job happens in the child after the fork, so
  # the first poll below might otherwise find no file yet.
  : >"${workdir}/server.log"
  "${attnserve_prefix[@]+"${attnserve_prefix[@]}"}" "${attnserve}" --address=127.0.0.1 \
    --port=0 --metrics_port=0 "$@" >"${workdir}/server.log" 2>&1 &
  server_pid=$!
  port=""
  for _ in $(seq 1 100); do
    port=$(sed -n 's/^attnserve [^ ]* listening on 127\.0\.0\.1:\([0-9]*\),.*/\1/p' \
      "${workdir}/server.log" || true)
    [[ -n ${port} ]] && break
    kill -0 "${server_pid}" 2>/dev/null || fail "attnserve exited during start-up"
    sleep 0.1
  done
  [[ -n ${port} ]] || fail "attnserve did not report its port within 10 s"
}

# Waits for attnserve, already sent SIGTERM, to exit; fails unless it exits 0 within 30 s.
wait_attnserve_exit() {
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

stop_attnserve() {
  kill -TERM "${server_pid}"
  wait_attnserve_exit
}
