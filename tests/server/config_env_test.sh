#!/usr/bin/env bash
# attnserve's configuration: every flag reads ATTNSERVE_<FLAG> from the environment, the command
# line wins, --help documents each flag (exit 0, paths from the repository root), --version
# prints the version, the commit and the libraries, and the start-up line shows the effective
# values.
#
# usage: config_env_test.sh ATTNSERVE SOURCE_DIR
set -euo pipefail
attnserve=$1
source_dir=$2
workdir=$(mktemp -d)
trap 'pkill -KILL -f "${workdir}/marker" 2>/dev/null || true; rm -rf "${workdir}"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

# Starts attnserve with the given environment and arguments; prints its start-up line.
startup_line() {
  local log="${workdir}/log.$RANDOM"
  : >"${log}"
  env "$@" --address=127.0.0.1 --port=0 --metrics_port=0 --drain_grace_seconds=0 \
    --weights_dir= >"${log}" 2>&1 &
  local pid=$!
  local line=""
  for _ in $(seq 1 100); do
    line=$(grep -m1 "listening on" "${log}" || true)
    [[ -n ${line} ]] && break
    kill -0 "${pid}" 2>/dev/null || { cat "${log}" >&2; return 1; }
    sleep 0.1
  done
  kill -TERM "${pid}"
  local status=0
  wait "${pid}" || status=$?
  [[ ${status} -eq 0 ]] || fail "attnserve exited ${status} after SIGTERM: $(cat "${log}")"
  echo "${line}"
}

line=$(startup_line ATTNSERVE_MAX_QUEUE=7 ATTNSERVE_EXECUTORS=2 ATTNSERVE_IO_THREADS=3 \
  ATTNSERVE_IO_SPIN_US=50 "${attnserve}")
[[ ${line} == *"io_threads=3 io_spin=50us executors=2 max_queue=7 "* ]] ||
  fail "environment not read: ${line}"

line=$(startup_line ATTNSERVE_MAX_QUEUE=7 "${attnserve}" --max_queue=9)
[[ ${line} == *"max_queue=9 "* ]] || fail "the command line must win: ${line}"

# A variable whose flag the command line or its flag file sets is not read: Kubernetes' service
# links put ATTNSERVE_PORT=tcp://IP:PORT in every pod of a namespace with a Service named
# attnserve, and that value must not stop a server whose --port is given.
line=$(startup_line ATTNSERVE_PORT=tcp://10.0.0.1:50051 ATTNSERVE_MAX_QUEUE=junk "${attnserve}" \
  --max_queue=9)
[[ ${line} == *"max_queue=9 "* ]] || fail "a replaced variable stopped the start: ${line}"
printf -- '--max_queue=11\n' >"${workdir}/set.flags"
line=$(startup_line ATTNSERVE_MAX_QUEUE=junk "${attnserve}" --flagfile="${workdir}/set.flags")
[[ ${line} == *"max_queue=11 "* ]] || fail "a variable the flag file replaces was read: ${line}"
printf -- '--max_queue=13\n' >"${workdir}/inner.flags"
printf -- '--flagfile=%s\n' "${workdir}/inner.flags" >"${workdir}/outer.flags"
line=$(startup_line ATTNSERVE_MAX_QUEUE=junk "${attnserve}" --flagfile="${workdir}/outer.flags")
[[ ${line} == *"max_queue=13 "* ]] || fail "a variable a nested flag file replaces was read: ${line}"
set +e
ATTNSERVE_PORT=tcp://10.0.0.1:50051 "${attnserve}" --metrics_port=0 >"${workdir}/bad.log" 2>&1
status=$?
set -e
[[ ${status} -eq 2 ]] || fail "a bad ATTNSERVE_PORT exited ${status}"
grep -q 'from the environment.s ATTNSERVE_PORT; a command-line --port replaces it' \
  "${workdir}/bad.log" || fail "the error does not name the variable: $(cat "${workdir}/bad.log")"

set +e
ATTNSERVE_MAX_BATCH=0 "${attnserve}" --port=0 --metrics_port=0 >"${workdir}/bad.log" 2>&1
status=$?
set -e
[[ ${status} -eq 2 ]] || fail "max_batch=0 from the environment exited ${status}, expected 2"
# A value the library refuses names its variable too (until 2026-12-07 only a value of the wrong
# type did).
grep -q "max_batch is 0, expected > 0 (from the environment's ATTNSERVE_MAX_BATCH; a \
command-line --max_batch replaces it)" "${workdir}/bad.log" || fail "$(cat "${workdir}/bad.log")"

set +e
"${attnserve}" --port=0 --metrics_port=0 --io_spin_us=-1 >"${workdir}/bad.log" 2>&1
status=$?
set -e
[[ ${status} -ne 0 ]] || fail "io_spin_us=-1 was accepted"
grep -q "io_spin_us is -1, expected 0 to 1000000" "${workdir}/bad.log" || fail "$(cat "${workdir}/bad.log")"

# --threads=0 with several executors divides OpenMP's threads (a container's
# CPU limit, through the entrypoint's OMP_NUM_THREADS), not the machine's cores.
line=$(startup_line OMP_NUM_THREADS=6 "${attnserve}" --executors=3)
[[ ${line} == *", 2 threads,"* ]] || fail "6 OpenMP threads over 3 executors: ${line}"

set +e
"${attnserve}" --port=0 --metrics_port=0 --drain_grace_seconds=inf >"${workdir}/bad.log" 2>&1
status=$?
set -e
[[ ${status} -eq 2 ]] || fail "drain_grace_seconds=inf exited ${status}, expected 2"
grep -q "drain_grace_seconds is inf, expected 0 to 1h" "${workdir}/bad.log" ||
  fail "$(cat "${workdir}/bad.log")"

# Values a flag's type cannot take, and unknown flags: exit 2 (a configuration that cannot work),
# naming the flag and what it expects, not Abseil's exit 1.
# Waits up to 10 s for PATTERN (grep's) in LOG, while process PID lives; fails if it never shows.
wait_for_line() {  # PATTERN LOG PID
  for _ in $(seq 1 100); do
    grep -q "$1" "$2" && return 0
    kill -0 "$3" 2>/dev/null || break
    sleep 0.1
  done
  grep -q "$1" "$2"
}

bad_flag() {  # EXPECTED_MESSAGE ARGUMENT...
  local expected=$1 status
  shift
  set +e
  env "$@" --port=0 --metrics_port=0 >"${workdir}/bad.log" 2>&1
  status=$?
  set -e
  [[ ${status} -eq 2 ]] || fail "$* exited ${status}, expected 2: $(cat "${workdir}/bad.log")"
  grep -qF -- "${expected}" "${workdir}/bad.log" ||
    fail "$*: $(cat "${workdir}/bad.log"), expected '${expected}'"
}
bad_flag '--max_batch is "abc", expected a 32-bit integer (-2147483648 to 2147483647)' \
  "${attnserve}" --max_batch=abc
bad_flag '--max_batch is "99999999999", expected a 32-bit integer' "${attnserve}" --max_batch=99999999999
bad_flag '--max_elements is "1e3", expected a 64-bit integer' "${attnserve}" --max_elements 1e3
bad_flag '--drain_grace_seconds is "soon", expected a number' "${attnserve}" --drain_grace_seconds=soon
bad_flag '--demo_weights is "maybe", expected true or false' "${attnserve}" --demo_weights=maybe
bad_flag '--nodemo_weights takes no value' "${attnserve}" --nodemo_weights=1
bad_flag 'unknown flag "--max_batches"; --help lists the flags' "${attnserve}" --max_batches=3
bad_flag '--max_batch is "many", expected a 32-bit integer' ATTNSERVE_MAX_BATCH=many "${attnserve}"
bad_flag '--kv_cache_bytes_per_identity is -1, expected >= 0 (0: no cap)' \
  "${attnserve}" --kv_cache_bytes_per_identity=-1
bad_flag '--max_sessions_per_identity is -5, expected >= 0 (0: no cap)' \
  ATTNSERVE_MAX_SESSIONS_PER_IDENTITY=-5 "${attnserve}"
bad_flag '--kv_eviction is "bogus", expected lru or none (from the environment'"'"'s ATTNSERVE_KV_EVICTION' \
  ATTNSERVE_KV_EVICTION=bogus "${attnserve}"
# NaN is refused as such (absl::Seconds took it for infinity), and the weights folder is not
# looked at more than ten times a second (1e-6 s kept half a core busy).
bad_flag '--message_timeout_seconds is nan, expected a number of seconds' \
  "${attnserve}" --message_timeout_seconds=nan
bad_flag '--drain_grace_seconds is nan, expected 0 to 1h' \
  "${attnserve}" --drain_grace_seconds=nan
# A number past what a duration holds is named as typed (it was "inf", its type's infinity).
bad_flag '--drain_grace_seconds is 1e+30, expected 0 to 1h' \
  "${attnserve}" --drain_grace_seconds=1e30
bad_flag '--message_timeout_seconds is 1e+30, expected a number of seconds (--help gives its range)' \
  "${attnserve}" --message_timeout_seconds=1e30
bad_flag '--weights_reload_seconds is 1e-06, expected 0 (only at start-up), or 0.1 to 1e9' \
  "${attnserve}" --weights_reload_seconds=1e-6
bad_flag '--max_connection_idle_seconds is -1s, expected 0 (never) to 24d' \
  "${attnserve}" --max_connection_idle_seconds=-1
bad_flag '--handshake_timeout_seconds is 0, expected > 0 and at most 1h' \
  "${attnserve}" --handshake_timeout_seconds=0
bad_flag '--handshake_timeout_seconds is 2h, expected > 0 and at most 1h' \
  "${attnserve}" --handshake_timeout_seconds=7200
# An empty --address listened on every interface.
bad_flag '--address is empty, expected a host name or an IP address' "${attnserve}" --address=
# A value is echoed as text: a newline or a terminal's escape sequence in it shows escaped.
bad_flag '--kv_eviction is "x\nattnserve listening\x1b[31m", expected lru or none' \
  "${attnserve}" --kv_eviction=$'x\nattnserve listening\e[31m'
bad_flag '--attention_kernel is "fast", expected fused or unfused' \
  "${attnserve}" --attention_kernel=fast
# Flag files are checked as the command line is, and only regular files of at most 1 MiB are read
# (Abseil's parse took a folder for an empty file, read /dev/zero without end, and waited on a
# FIFO), nested at most 8 deep.
printf -- '--max_queue=4\n' >"${workdir}/good.flags"
printf -- '# a comment\n\n  --max_batch=abc\n' >"${workdir}/bad_value.flags"
printf -- '--flagfile=%s\n' "${workdir}/bad_value.flags" >"${workdir}/outer_bad.flags"
printf -- 'max_queue=3\n' >"${workdir}/no_flag.flags"
printf -- '--flagfile=%s\n' "${workdir}/self.flags" >"${workdir}/self.flags"
head -c $((1 << 20 | 1)) /dev/zero | tr '\0' '#' >"${workdir}/big.flags"
# A line ending in white space: Abseil keeps it in the value, and --access_log=stdout from a file
# saved with CRLF line ends logged to a file named "stdout\r" (until 2026-12-07).
printf -- '--max_queue=4\n--access_log=stdout\r\n' >"${workdir}/crlf.flags"
bad_flag "line 2 of --flagfile \"${workdir}/crlf.flags\" is \"--access_log=stdout\\r\", which ends in white space (a carriage return: CRLF line ends)" \
  "${attnserve}" --flagfile="${workdir}/crlf.flags"
mkfifo "${workdir}/fifo.flags"
bad_flag '--max_batch is "abc", expected a 32-bit integer (-2147483648 to 2147483647); --help gives its range (in --flagfile "'"${workdir}"'/bad_value.flags")' \
  "${attnserve}" --flagfile="${workdir}/good.flags,${workdir}/outer_bad.flags"
bad_flag 'line 1 of --flagfile "'"${workdir}"'/no_flag.flags" is "max_queue=3", expected a flag' \
  "${attnserve}" --flagfile="${workdir}/no_flag.flags"
bad_flag 'nests flag files more than 8 deep' "${attnserve}" --flagfile="${workdir}/self.flags"
bad_flag "--flagfile: ${workdir}/big.flags is 1048577 bytes, over the limit of 1048576 bytes" \
  "${attnserve}" --flagfile="${workdir}/big.flags"
bad_flag "--flagfile: ${workdir} is a folder, expected a regular file" \
  "${attnserve}" --flagfile="${workdir}"
bad_flag "--flagfile: ${workdir}/fifo.flags is a FIFO, expected a regular file" \
  "${attnserve}" --flagfile="${workdir}/fifo.flags"
bad_flag "--flagfile: /dev/zero is a device, expected a regular file" \
  "${attnserve}" --flagfile=/dev/zero
bad_flag "--flagfile: open ${workdir}/missing.flags: No such file or directory" \
  "${attnserve}" --flagfile="${workdir}/missing.flags"
line=$(startup_line "${attnserve}" --flagfile="${workdir}/good.flags")
[[ ${line} == *"max_queue=4 "* ]] || fail "a good flag file not read: ${line}"

# The gRPC and metrics ports on addresses that share an interface clash (until 2026-12-07 only
# the same address string was caught, and the bind's failure blamed another process).
port_clash() {  # METRICS_ADDRESS [AS_NAMED: without an IPv6 literal's brackets]
  set +e
  "${attnserve}" --address=127.0.0.1 --port=1 --metrics_port=1 --metrics_address="$1" \
    >"${workdir}/bad.log" 2>&1
  status=$?
  set -e
  [[ ${status} -eq 2 ]] || fail "ports clashing on $1 exited ${status}: $(cat "${workdir}/bad.log")"
  grep -qF -- "--metrics_port is 1, the same as --port, on addresses that may share interfaces \
(127.0.0.1 and ${2:-$1}); expected another port" "${workdir}/bad.log" || fail "$(cat "${workdir}/bad.log")"
}
port_clash localhost
port_clash 0.0.0.0
port_clash 127.0.0.1
port_clash '[::ffff:127.0.0.1]' ::ffff:127.0.0.1
port_clash 0:0:0:0:0:0:0:0
# localhost is 127.0.0.1 and ::1 only: another loopback address may share the port number.
free_port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# The SIGTERM below goes to timeout, which passes it on twice (to attnserve, then to its process
# group): the drain must take the copy for the same request and exit 0.
timeout 20 "${attnserve}" --address=localhost --port="${free_port}" --metrics_address=127.0.0.2 \
  --metrics_port="${free_port}" --drain_grace_seconds=0 >"${workdir}/apart.log" 2>&1 &
apart=$!
wait_for_line "listening on" "${workdir}/apart.log" "${apart}" || true
grep -q "listening on localhost:${free_port}, metrics on 127.0.0.2:${free_port}" \
  "${workdir}/apart.log" || fail "localhost and 127.0.0.2 on one port: $(cat "${workdir}/apart.log")"
kill -TERM "${apart}"
status=0
wait "${apart}" || status=$?
[[ ${status} -eq 0 ]] || fail "attnserve exited ${status} after SIGTERM: $(cat "${workdir}/apart.log")"
# Caps per caller past the whole never bind: start-up says so, and serves.
timeout 20 "${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 --drain_grace_seconds=0 \
  --kv_cache_bytes=1048576 --kv_cache_bytes_per_identity=2097152 --max_sessions=8 \
  --max_sessions_per_identity=9 >"${workdir}/caps.log" 2>&1 &
caps=$!
wait_for_line "listening on" "${workdir}/caps.log" "${caps}" || true
kill -TERM "${caps}" 2>/dev/null || true
wait "${caps}" || true
grep -q "warning: kv_cache_bytes_per_identity 2097152 is more than the whole KV cache \
(kv_cache_bytes 1048576): it never binds" "${workdir}/caps.log" ||
  fail "no warning for a share past the KV cache: $(cat "${workdir}/caps.log")"
grep -q "warning: max_sessions_per_identity 9 is more than max_sessions 8" "${workdir}/caps.log" ||
  fail "no warning for a session cap past max_sessions: $(cat "${workdir}/caps.log")"
# The system's own words are not taken for flag names ("Cannot assign requested --address").
set +e
"${attnserve}" --address=192.0.2.1 --port=0 --metrics_port=0 >"${workdir}/bad.log" 2>&1
status=$?
set -e
[[ ${status} -eq 1 ]] || fail "an address not on this machine exited ${status}"
grep -q "could not listen on 192.0.2.1:0: Cannot assign requested address; expected --address \
to be one of this machine, and --port one no other process listens on" "${workdir}/bad.log" ||
  fail "$(cat "${workdir}/bad.log")"
# A refusal that names flags the environment gave names their variables, whichever they are.
set +e
ATTNSERVE_ADDRESS=192.0.2.1 "${attnserve}" --port=0 --metrics_port=0 >"${workdir}/bad.log" 2>&1
set -e
grep -q "one no other process listens on (from the environment: --address from \
ATTNSERVE_ADDRESS; a command-line flag replaces its variable)" "${workdir}/bad.log" ||
  fail "$(cat "${workdir}/bad.log")"
set +e
ATTNSERVE_BUFFER_POOL_BYTES=0 "${attnserve}" --port=0 --metrics_port=0 \
  --max_weights_bytes=$((1 << 60)) >"${workdir}/bad.log" 2>&1
set -e
grep -q "lower the budgets or raise that limit (from the environment: --buffer_pool_bytes \
from ATTNSERVE_BUFFER_POOL_BYTES; a command-line flag replaces its variable)" \
  "${workdir}/bad.log" || fail "$(cat "${workdir}/bad.log")"
# --undefok in a flag file lets through what it names anywhere, as Abseil reads it after the
# whole parse.
printf -- '--max_batches=3\n--undefok=max_batches\n' >"${workdir}/undefok.flags"
"${attnserve}" --port=0 --metrics_port=0 --only_check_args --flagfile="${workdir}/undefok.flags" \
  --nomax_batches >"${workdir}/ok.log" 2>&1 ||
  fail "--undefok in a flag file was not taken: $(cat "${workdir}/ok.log")"

# What Abseil's parse takes stays taken: --undefok's names.
for arguments in "--undefok=max_batches --max_batches=3" "--undefok=max_batches --nomax_batches"; do
  # shellcheck disable=SC2086 # the words of each case are separate arguments
  "${attnserve}" --port=0 --metrics_port=0 --only_check_args ${arguments} >"${workdir}/ok.log" 2>&1 ||
    fail "attnserve ${arguments} was refused: $(cat "${workdir}/ok.log")"
done
# But an argument that is no flag is refused: attnserve takes none, and "--demo_weights false"
# (a space for the =) left the demo weights on, "false" ignored, until 2026-12-07. So are a
# lone "-" and what follows "--" or "--=x", which end Abseil's flags.
for arguments in "--demo_weights false" "serve" "-" "--=x --not_a_flag" "-- --port=1"; do
  set +e
  # shellcheck disable=SC2086 # the words of each case are separate arguments
  "${attnserve}" --port=0 --metrics_port=0 ${arguments} >"${workdir}/bad.log" 2>&1
  status=$?
  set -e
  [[ ${status} -eq 2 ]] && grep -q "unexpected argument .*: attnserve takes flags only" \
    "${workdir}/bad.log" ||
    fail "attnserve ${arguments} exited ${status}: $(cat "${workdir}/bad.log")"
done
# An address no resolver could take fails as a configuration (exit 2), not as a network not up
# yet (exit 1, which a supervisor retries): until 2026-12-07 both exited 1 at the bind.
bad_flag '--address is "127.0.0.1:5000", expected a host name or an IP address without a port (--port and --metrics_port give it)' \
  "${attnserve}" --address=127.0.0.1:5000
bad_flag '--metrics_address is "999.1.1.1", expected an IPv4 address' \
  "${attnserve}" --metrics_address=999.1.1.1
# --only_check_args checks what start-up checks before it opens anything: Abseil's own exited 0
# at once, --port=70000 and budgets that cannot fit included, until 2026-12-07.
for arguments in "--port=70000" "--max_batch=0" "--max_inflight_bytes=1000"; do
  set +e
  # shellcheck disable=SC2086 # the words of each case are separate arguments
  "${attnserve}" --metrics_port=0 --only_check_args ${arguments} >"${workdir}/bad.log" 2>&1
  status=$?
  set -e
  [[ ${status} -eq 2 ]] && grep -qE "^attnserve: (INVALID_ARGUMENT|FAILED_PRECONDITION): .*--" "${workdir}/bad.log" ||
    fail "--only_check_args ${arguments} exited ${status}: $(cat "${workdir}/bad.log")"
done
"${attnserve}" --port=0 --metrics_port=0 --only_check_args >"${workdir}/ok.log" 2>&1 ||
  fail "--only_check_args refused the defaults: $(cat "${workdir}/ok.log")"
# --version answers whatever the environment holds (Kubernetes' service link for a Service
# named attnserve sets ATTNSERVE_PORT=tcp://...).
ATTNSERVE_PORT=tcp://10.0.0.1:50051 "${attnserve}" --version >"${workdir}/ok.log" 2>&1 &&
  grep -q "^attnserve " "${workdir}/ok.log" ||
  fail "--version failed beside ATTNSERVE_PORT=tcp://...: $(cat "${workdir}/ok.log")"
# An IPv6 literal in brackets, as a URL writes it, is the address (until 2026-12-07: "could not
# listen on [[::1]]: Name or service not known").
if grep -q "^00000000000000000000000000000001 " /proc/net/if_inet6 2>/dev/null; then
  : >"${workdir}/v6.log"
  "${attnserve}" --address=[::1] --port=0 --metrics_port=0 --drain_grace_seconds=0 \
    >"${workdir}/v6.log" 2>&1 &
  v6_pid=$!
  wait_for_line "listening on \[::1\]:" "${workdir}/v6.log" "${v6_pid}" ||
    { kill "${v6_pid}" 2>/dev/null; fail "--address=[::1] did not start: $(cat "${workdir}/v6.log")"; }
  kill -TERM "${v6_pid}"
  wait "${v6_pid}" || fail "--address=[::1] did not exit 0 on SIGTERM"
else
  echo "no IPv6 loopback here: --address=[::1] not tried"
fi

line=$(startup_line "${attnserve}" --nodemo_weights)
[[ ${line} == *"demo_weights=off "* ]] || fail "--nodemo_weights not in effect: ${line}"

line=$(startup_line "${attnserve}" --demo_weights=false)
[[ ${line} == *"demo_weights=off "* ]] || fail "--demo_weights=false not in effect: ${line}"

version=$("${attnserve}" --version) || fail "--version exited non-zero"
mapfile -t version_lines <<<"${version}"
[[ ${#version_lines[@]} -eq 3 ]] || fail "--version printed ${#version_lines[@]} lines: ${version}"
[[ ${version_lines[0]} =~ ^attnserve\ [0-9]+\.[0-9]+\.[0-9]+$ ]] ||
  fail "--version's first line is '${version_lines[0]}', expected 'attnserve X.Y.Z'"
commit_pattern='^commit ([0-9a-f]{12}(-dirty)?|unknown), [A-Za-z]+ build, [A-Za-z]+ [0-9.]+$'
[[ ${version_lines[1]} =~ ${commit_pattern} ]] ||
  fail "--version's second line is '${version_lines[1]}', expected 'commit HASH, TYPE build, COMPILER'"
# Built from this checkout, unmodified (a clean clone, as CI's): the commit is its HEAD (ctest
# runs after the build). A build of a modified tree ("-dirty") may predate the last commit.
if [[ ${version_lines[1]} != *-dirty,* ]] &&
  head=$(git -C "${source_dir}" rev-parse --short=12 HEAD 2>/dev/null); then
  [[ ${version_lines[1]} == "commit ${head}"[,-]* ]] ||
    fail "--version names '${version_lines[1]}', but the checkout is at ${head}"
fi
# The oneDNN and ISA it names are the ones the server reports at start-up.
line=$(startup_line "${attnserve}")
onednn=$(sed -E 's/.*; (oneDNN [0-9.]+ \([A-Z]+\)), ([a-z0-9_]+),.*/\1, CPU ISA \2/' <<<"${line}")
[[ ${version_lines[2]} =~ ^gRPC\ 1\.[0-9]+\.[0-9]+,\ protobuf\ [0-9]+\.[0-9]+\.[0-9]+,\ Abseil\ [0-9]{8},\ (.*)$ ]] ||
  fail "--version's third line is '${version_lines[2]}', expected the library versions"
[[ ${BASH_REMATCH[1]} == "${onednn}" ]] ||
  fail "--version names '${BASH_REMATCH[1]}', the start-up line '${onednn}'"

for help_flag in --help --helpfull -help; do
  help=$("${attnserve}" "${help_flag}") || fail "${help_flag} exited non-zero"
  grep -q "Flags from server/process/flags.cc:" <<<"${help}" ||
    fail "${help_flag} does not list the flags under their source path: ${help}"
  ! grep -q "No flags matched\|/work/\|/src/" <<<"${help}" || fail "${help_flag} printed: ${help}"
done
help=$("${attnserve}" --help)
for flag in address port threads io_threads io_spin_us executors max_queue max_batch max_queue_delay_us \
            max_message_bytes max_elements max_request_memory_bytes max_workspace_bytes \
            metrics_port max_weights_bytes max_inflight_bytes stream_idle_timeout_seconds max_client_resets_per_second weights_dir drain_grace_seconds tls_cert tls_key \
            tls_client_ca auth_token_file weights_admin_token_file attention_kernel portable_kernels demo_weights \
            max_concurrent_streams message_timeout_seconds accept_compressed_requests \
            buffer_pool_bytes metrics_address kv_cache_bytes kv_eviction kv_page_tokens max_sessions \
            max_sessions_per_identity kv_cache_bytes_per_identity \
            max_session_tokens max_session_layers session_ttl_seconds max_steps_per_call; do
  grep -q -- "-${flag} " <<<"${help}" || fail "--help does not document --${flag}"
done
grep -q "ATTNSERVE_" <<<"${help}" || fail "--help does not mention ATTNSERVE_ variables"
# --only_check_args is taken before Abseil's parse, so no flag lists it: the usage line does.
grep -q -- "--only_check_args" <<<"${help}" || fail "--help does not mention --only_check_args"
echo PASS
