#!/usr/bin/env bash
# Traffic gRPC's own clients cannot make, through a raw HTTP/2 client (Debian's python3-h2,
# raw_http2.py), against attnserve on a free loopback port, while a well-behaved client
# (prober.py) calls a small Attend on its own connection and must be answered throughout:
# - grpc_log_lines_test.py: gRPC core's lines quoting malformed headers are escaped (no forged
#   log line) and at most one every 10 s from each place (no flood);
# - far_deadline_test.py: a grpc-timeout past year 2262 means no deadline;
# - unauthenticated_partial_test.py (with a token configured): partial messages from a caller
#   without the token are refused on their headers, never buffered;
# - stalled_message_test.py (with the token): calls whose message stops arriving are ended after
#   --message_timeout_seconds, AttendStreams stalled or idle after --stream_idle_timeout_seconds;
# - long_strings_test.py: 60 MiB names (Health.Check, DeleteWeights) and a 5,000,000-dimension
#   shape answered at once with short messages;
# - transport_limits_test.py: MAX_CONCURRENT_STREAMS advertised (the default, then a flag's),
#   compressed requests refused unread, 40 million integers refused before their parse;
# - idle_connection_test.py: a connection with no call open ends after
#   --max_connection_idle_seconds, one with a stream open stays, one that never sends the
#   preface ends after --handshake_timeout_seconds;
# - compressed_requests_test.py (with --accept_compressed_requests): inflated with a bound;
#   with --response_compression=gzip alone: refused UNIMPLEMENTED, unread, bombs included;
# - memory_budget_test.py: --max_inflight_bytes against many large calls, answers never read
#   (held until --message_timeout_seconds passes) and idle streams, with RSS bounded and a
#   well-behaved client served meanwhile; and --max_connections against one address's
#   connection flood;
# - rapid_reset_test.py: HEADERS + RST_STREAM on one connection: shut down past
#   --max_client_resets_per_second (and 50,000 taken with the cap off), also with the server
#   starved of CPU, RSS bounded and another client's Attends answered meanwhile.
#
# usage: hostile_http2_test.sh ATTNSERVE STUBS_DIR
set -euo pipefail

attnserve=$1
stubs_dir=$2
python=/usr/bin/python3  # Debian's, with python3-h2 and python3-protobuf.
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

"${python}" -c "import h2, google.protobuf" ||
  fail "${python} lacks h2 or protobuf: run scripts/install-deps"

# The RSS bounds allow 64 MiB beyond the budgets; an AddressSanitizer build keeps up to 256 MiB
# of freed memory in its quarantine, and its shadow memory besides.
# (ldd's output is taken whole first: with pipefail, `ldd | grep -q` fails when grep stops
# reading early and ldd gets SIGPIPE.)
sanitized=0
if [[ $(ldd "${attnserve}") == *libasan* ]]; then
  sanitized=1
  export ATTNSERVE_RSS_OVERHEAD_BYTES=$((448 << 20))
  export ATTNSERVE_SANITIZED=1
fi

# A well-behaved client on its own connection, calling a small Attend throughout each server's
# life (prober.py); stop_server checks it was answered every time within its bound.
prober_pid=""
start_server() {  # [--auth_token_file=FILE] FLAG...
  start_attnserve "${attnserve}" --threads=2 --drain_grace_seconds=0 "$@"
  local token=()
  for flag in "$@"; do
    [[ ${flag} == --auth_token_file=* ]] && token=("${flag#--auth_token_file=}")
  done
  "${python}" "${here}/prober.py" "${port}" "${stubs_dir}" "${token[@]+"${token[@]}"}" \
    >"${workdir}/prober.log" 2>&1 &
  prober_pid=$!
  cleanup_pids+=("${prober_pid}")
  # Until its first call has been answered (or failed), for up to 60 s.
  for _ in $(seq 1 600); do
    grep -q "^prober: calling" "${workdir}/prober.log" 2>/dev/null && break
    kill -0 "${prober_pid}" 2>/dev/null || break
    sleep 0.1
  done
}
stop_server() {
  local status
  kill -TERM "${prober_pid}"
  set +e
  wait "${prober_pid}"
  status=$?
  set -e
  cat "${workdir}/prober.log"
  [[ ${status} -eq 0 ]] || fail "the well-behaved client was not served: $(cat "${workdir}/prober.log")"
  stop_attnserve
}

run() {
  local status
  set +e
  timeout 120 "${python}" "$@"
  status=$?
  set -e
  [[ ${status} -eq 0 ]] || fail "$(basename "$1") exited ${status}"
  kill -0 "${server_pid}" 2>/dev/null || fail "attnserve died"
}

start_server
run "${here}/grpc_log_lines_test.py" "${port}" "${workdir}/server.log"
run "${here}/far_deadline_test.py" "${port}" "${stubs_dir}"
run "${here}/transport_limits_test.py" "${port}" "${server_pid}" 256
run "${here}/long_strings_test.py" "${port}" "${server_pid}" "${stubs_dir}"
stop_server
start_server --max_concurrent_streams=7
run "${here}/transport_limits_test.py" "${port}" "${server_pid}" 7
stop_server
start_server --max_connection_idle_seconds=1
run "${here}/idle_connection_test.py" "${port}" idle 1
stop_server
start_server --handshake_timeout_seconds=2
run "${here}/idle_connection_test.py" "${port}" handshake 2
stop_server
start_server --accept_compressed_requests --max_message_bytes=$((4 << 20))
run "${here}/compressed_requests_test.py" "${port}" "${server_pid}" "${stubs_dir}"
stop_server
start_server --response_compression=gzip --max_message_bytes=$((4 << 20))
run "${here}/compressed_requests_test.py" "${port}" "${server_pid}" "${stubs_dir}" --refused
stop_server

printf 'the-token\n' >"${workdir}/token"
start_server --auth_token_file="${workdir}/token"
run "${here}/unauthenticated_partial_test.py" "${port}" "${server_pid}"
stop_server

start_server --auth_token_file="${workdir}/token" --message_timeout_seconds=1 \
  --stream_idle_timeout_seconds=1
run "${here}/stalled_message_test.py" "${port}" "${workdir}/token"
stop_server

# The cap counts the reset calls the service takes, under the peer each had on arrival (gRPC
# forgets a call's peer once an operation of it fails, as a reset call's do). gRPC 1.51 reads a
# connection on the io thread that polled its bytes and keeps reading while more come, so a
# server slower than the flood held its only io thread there until the flood ended: the call
# loop's standby thread polls beside it then (call_loop.h). The flood runs at the cap, with the
# cap off, and at the cap against a starved server: pinned to one CPU beside a busy loop, at
# nice 5 (about a quarter of that CPU), where before the standby and the peer fix all 50,000
# resets were taken. An AddressSanitizer build, several times slower, runs the first only
# (before those fixes it fell behind, never tripped the cap and grew by 1.2 GB; with the cap
# off it still grows past any useful bound), and asserts its memory and the other client's
# answers but not the cap's tripping, which it missed in 2 of 4 runs on 2026-12-07 (reset
# calls gRPC dropped before handing them over are never counted).
caps=(200 0)
[[ ${sanitized} -eq 0 ]] || caps=(200)
for cap in "${caps[@]}"; do
  start_server --max_client_resets_per_second="${cap}"
  run "${here}/rapid_reset_test.py" "${port}" "${server_pid}" "${stubs_dir}" "${cap}"
  stop_server
done
if [[ ${sanitized} -eq 0 ]]; then
  cpu=$("${python}" -c 'import os; print(min(os.sched_getaffinity(0)))')
  taskset -c "${cpu}" bash -c 'while :; do :; done' &
  busy_pid=$!
  cleanup_pids+=("${busy_pid}")
  attnserve_prefix=(taskset -c "${cpu}" nice -n 5)
  start_server --max_client_resets_per_second=200
  run "${here}/rapid_reset_test.py" "${port}" "${server_pid}" "${stubs_dir}" 200
  stop_server
  attnserve_prefix=()
  kill "${busy_pid}"
fi

budget=$((128 << 20))
for scenario in large unread; do
  start_server --max_inflight_bytes="${budget}"
  run "${here}/memory_budget_test.py" "${port}" "${server_pid}" "${stubs_dir}" "${budget}" \
    "${scenario}"
  stop_server
done
start_server --max_inflight_bytes="${budget}" --message_timeout_seconds=2
run "${here}/memory_budget_test.py" "${port}" "${server_pid}" "${stubs_dir}" "${budget}" \
  unread_timeout
stop_server
budget=$((16 << 20))
for scenario in streams addresses; do
  start_server --max_inflight_bytes="${budget}"
  run "${here}/memory_budget_test.py" "${port}" "${server_pid}" "${stubs_dir}" "${budget}" \
    "${scenario}"
  stop_server
done
budget=$((256 << 20))
start_server --max_inflight_bytes="${budget}" --max_queue=4 --executors=1
run "${here}/memory_budget_test.py" "${port}" "${server_pid}" "${stubs_dir}" "${budget}" queue
stop_server
printf 'the-token\nflood-token\nother-token\n' >"${workdir}/tokens"
start_server --max_inflight_bytes="${budget}" --max_queue=4 --executors=1 \
  --auth_token_file="${workdir}/tokens"
run "${here}/memory_budget_test.py" "${port}" "${server_pid}" "${stubs_dir}" "${budget}" \
  queue_identities "${workdir}/tokens"
stop_server
start_server --max_inflight_bytes="${budget}" --max_connections=64
run "${here}/memory_budget_test.py" "${port}" "${server_pid}" "${stubs_dir}" "${budget}" \
  connections
stop_server
echo "PASS"
