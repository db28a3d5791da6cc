# attnserve servers for the benchmark scripts (sourced, not run): a scratch folder, servers on
# free loopback ports that are stopped on exit, and their CPU time.
#
#   source "$(dirname "$0")/servers_lib.sh"
#   start_server ATTNSERVE [FLAG...]   # appends to pids and ports; the log is
#                                      # ${workdir}/server<i>.log; exits with it if no port shows
#   cpu_ticks PID                      # user + system clock ticks of every thread

workdir=$(mktemp -d)
pids=()
ports=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "${pid}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "${workdir}"
}
trap cleanup EXIT

start_server() {
  local binary=$1
  shift
  local log="${workdir}/server${#pids[@]}.log"
  : >"${log}"
  "${binary}" --address=127.0.0.1 --port=0 --drain_grace_seconds=0 "$@" >"${log}" 2>&1 &
  pids+=($!)
  local port=""
  for _ in $(seq 1 100); do
    port=$(sed -n 's/.*listening on 127.0.0.1:\([0-9]*\).*/\1/p' "${log}")
    [[ -n ${port} ]] && break
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  [[ -n ${port} ]] || { cat "${log}" >&2; exit 1; }
  ports+=("${port}")
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
