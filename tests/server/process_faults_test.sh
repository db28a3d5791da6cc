#!/usr/bin/env bash
# What the process's surroundings can do to attnserve, and what it must survive:
# - more connections than its open-file limit: each one past it is closed at once
#   (attnserve_connections_shed_total), and the port serves again once they go (gRPC 1.51's
#   own listener stopped accepting for good after one EMFILE);
# - a soft open-file limit under the hard one is raised to it (the start-up line says so);
# - the reader of its output going away (a log shipper restarting): log lines fail with EPIPE
#   instead of killing the server with SIGPIPE, at start-up and in the drain.
#
# usage: process_faults_test.sh ATTNSERVE ATTNCTL
set -euo pipefail
attnserve=$1
attnctl=$2
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
scrape() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
for line in text.splitlines():
    if line.startswith(sys.argv[2] + " "):
        print(line.split()[1])
PY
}

# 1. A flood of connections past `ulimit -n 64` (the server's alone), held, then closed. (No
# subshells: the library's EXIT trap, which kills a server left running, is the shell's own.)
attnserve_prefix=(bash -c 'ulimit -n "$0" && exec "$@"' 64)
mport=$(free_port)
start_attnserve "${attnserve}" --drain_grace_seconds=0 --metrics_port="${mport}"
grep -q "open files limit 64$" "${workdir}/server.log" || fail "no open files limit 64 in the start-up line"
out=$(/usr/bin/python3 - "${port}" <<'PY'
import socket, sys, time
port = int(sys.argv[1])
held, closed = [], 0
for _ in range(100):  # past the limit of 64
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    held.append(s)
time.sleep(1)
for s in held:
    s.setblocking(False)
    try:
        closed += s.recv(1) == b""
    except BlockingIOError:
        pass
    except ConnectionResetError:
        closed += 1
for s in held:
    s.close()
print(closed)
PY
) || fail "the connection flood failed: ${out}"
[[ ${out} -gt 0 ]] || fail "none of 100 connections past ulimit -n 64 was closed by the server"
[[ ${out} -lt 100 ]] || fail "all 100 connections were closed: the server kept none under ulimit -n 64"
health=$(timeout 20 "${attnctl}" --target="127.0.0.1:${port}" --timeout=10s health 2>&1) ||
  fail "after the flood, a new connection is not served: ${health}"
[[ ${health} == SERVING ]] || fail "after the flood, health says ${health}"
timeout 20 "${attnctl}" --target="127.0.0.1:${port}" --timeout=10s attend --demo >/dev/null ||
  fail "after the flood, an Attend failed"
shed=""
for _ in $(seq 1 30); do  # the counter is sampled once a second
  shed=$(scrape "${mport}" attnserve_connections_shed_total)
  [[ -n ${shed} && ${shed%.*} -eq ${out} ]] && break
  sleep 0.2
done
[[ ${shed%.*} -eq ${out} ]] ||
  fail "attnserve_connections_shed_total is ${shed}, the client saw ${out} connections closed"
stop_attnserve
echo "PASS: past ulimit -n 64, ${out} of 100 connections shed; the port serves again after"

attnserve_prefix=()

# 2. A soft limit under the hard one is raised to it.
hard=$(ulimit -Hn)
if [[ ${hard} == unlimited || ${hard} -le 256 ]]; then
  echo "SKIP: the hard open-file limit is ${hard}: no soft limit under it to raise"
else
  attnserve_prefix=(bash -c 'ulimit -Sn "$0" && exec "$@"' 256)
  start_attnserve "${attnserve}" --drain_grace_seconds=0
  grep -q "open files limit ${hard}$" "${workdir}/server.log" ||
    fail "soft limit 256 not raised to the hard ${hard}: $(grep 'listening on' "${workdir}/server.log")"
  stop_attnserve
  echo "PASS: the soft open-file limit 256 was raised to ${hard}"
fi

attnserve_prefix=()

# 3. The output's reader goes away after the first bytes: start-up's later lines, the drain's
# lines and its exit must not meet SIGPIPE (exit 141).
mkfifo "${workdir}/out"
"${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 --drain_grace_seconds=1 \
  >"${workdir}/out" 2>&1 &
server_pid=$!
head -c 16 "${workdir}/out" >/dev/null  # then the reader is gone
sleep 2  # start-up's later lines are written to the broken pipe
kill -0 "${server_pid}" 2>/dev/null || {
  set +e; wait "${server_pid}"; status=$?; set -e; server_pid=""
  fail "attnserve died (status ${status}) once its output's reader was gone"
}
kill -TERM "${server_pid}"
wait_attnserve_exit
echo "PASS: with its output's reader gone, attnserve ran, drained and exited 0"
