#!/usr/bin/env bash
# The attnserve binary's --access_log and --log_level. With a token file and an access log
# file: calls through attnctl (Attend, MultiHeadAttention with the demo weights, a session's
# create, step, fork and delete, a weight set's deletion denied to a caller without an admin
# token, a refused call without the token) each leave one JSON line
# (python3's json parses them) with their RPC, code, bytes, times, peer, the caller's identity
# (its token's hash), weights and session, and no line holds the token or any tensor data. --log_level=warning leaves out the info lines
# (the start-up line), debug adds gRPC's own (through the server's log), and an unknown level
# stops start-up (exit 2)
# naming the flag.
#
# usage: access_log_e2e_test.sh ATTNSERVE ATTNCTL
set -euo pipefail

attnserve=$1
attnctl=$2
python=/usr/bin/python3
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

token="access-log-test-token-$$-${RANDOM}${RANDOM}"
echo "${token}" >"${workdir}/tokens"
echo "${token}" >"${workdir}/token"
log="${workdir}/access.log"
echo "admin-${token}" >"${workdir}/admins"
start_attnserve "${attnserve}" --threads=2 --auth_token_file="${workdir}/tokens" \
  --weights_admin_token_file="${workdir}/admins" --access_log="${log}"
grep -q "access_log=${log}" "${workdir}/server.log" || fail "the start-up line does not show the access log"

ctl() {
  timeout 60 "${attnctl}" --target="127.0.0.1:${port}" --auth_token_file="${workdir}/token" "$@"
}
ctl attend --demo >/dev/null || fail "attnctl attend failed"
ctl mha --demo >/dev/null || fail "attnctl mha failed"
session=$(ctl session create --layers=1 --heads=4 --kv_heads=2 --key_dim=16 |
  awk 'NR == 1 { print $1 }')
[[ ${session} =~ ^[0-9a-f]+$ ]] || fail "attnctl session create printed no session id"
ctl session step "${session}" --demo --tokens=3 --query_tokens=1 >/dev/null ||
  fail "attnctl session step failed"
child=$(ctl session fork "${session}" | awk 'NR == 1 { print $1 }')
[[ ${child} =~ ^[0-9a-f]+$ ]] || fail "attnctl session fork printed no session id"
ctl session delete "${session}" >/dev/null || fail "attnctl session delete failed"
set +e
ctl weights delete demo >/dev/null 2>&1
status=$?
set -e
[[ ${status} -ne 0 ]] || fail "a caller without an admin token deleted a weight set"
set +e
timeout 60 "${attnctl}" --target="127.0.0.1:${port}" attend --demo >/dev/null 2>&1
status=$?
set -e
[[ ${status} -ne 0 ]] || fail "a call without the token was answered"
echo "not-${token}" >"${workdir}/wrong_token"
set +e
timeout 60 "${attnctl}" --target="127.0.0.1:${port}" --auth_token_file="${workdir}/wrong_token" \
  attend --demo >/dev/null 2>&1
status=$?
set -e
[[ ${status} -ne 0 ]] || fail "a call with a wrong token was answered"
# The log is complete once the server has drained and exited.
stop_attnserve

"${python}" - "${log}" "${token}" "${session}" "${child}" <<'PY' || fail "the access log: see above"
import hashlib, json, sys

path, token, session, child = sys.argv[1:5]
text = open(path, encoding="utf-8").read()
assert token not in text, "the token is in the access log"
lines = text.splitlines()
records = []
for number, line in enumerate(lines, 1):
    assert len(line) < 2048, f"line {number} is {len(line)} bytes: tensor data?"
    records.append(json.loads(line))
for record in records:
    for field in ("time", "rpc", "code", "peer", "request_bytes", "response_bytes", "server_us"):
        assert field in record, f"{record} lacks {field}"
    assert record["peer"].startswith("ipv4:127.0.0.1:"), record
    assert record["time"].endswith("Z"), record

def find(rpc, code="OK", **fields):
    for record in records:
        if record["rpc"] == rpc and record["code"] == code and all(
                record.get(k) == v for k, v in fields.items()):
            return record
    sys.exit(f"no {rpc} {code} {fields} line in:\n" + text)

attend = find("Attend")
assert attend["request_bytes"] > 100000 and attend["response_bytes"] > 10000, attend
assert 0 <= attend["compute_us"] <= attend["server_us"], attend
assert "queue_us" in attend, attend
mha = find("MultiHeadAttention", weights="demo", weights_version=1)
assert "compute_us" in mha, mha
find("CreateSession", session=session)
step = find("Step", session=session, steps=1)
assert "compute_us" in step, step
find("ForkSession", session=session, created_session=child)
find("DeleteSession", session=session)
# Refused on its headers, but by an admitted caller: it keeps its identity.
denied = find("DeleteWeights", code="PERMISSION_DENIED")
assert denied["request_bytes"] == 0, denied
refused = find("Attend", code="UNAUTHENTICATED")
assert refused["response_bytes"] == 0 and "message" in refused, refused
# The caller as sessions know it: the first 128 bits of its token's SHA-256; a caller refused
# at the gate has none.
identity = "token:" + hashlib.sha256(token.encode()).hexdigest()[:32]
for record in records:
    if record["code"] != "UNAUTHENTICATED":
        assert record.get("identity") == identity, (record, identity)
refused_lines = [r for r in records if r["code"] == "UNAUTHENTICATED"]
assert len(refused_lines) == 2, refused_lines
for record in refused_lines:
    assert "identity" not in record, record
print(f"PASS {len(records)} access-log lines")
PY

# --log_level=warning: no info lines (the start-up line is one); the server still serves.
: >"${workdir}/quiet.log"
"${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 --log_level=warning \
  >"${workdir}/quiet.log" 2>&1 &
quiet_pid=$!
cleanup_pids+=("${quiet_pid}")
sleep 2
kill -0 "${quiet_pid}" 2>/dev/null || fail "attnserve --log_level=warning exited: $(cat "${workdir}/quiet.log")"
kill -TERM "${quiet_pid}"
set +e
wait "${quiet_pid}"
status=$?
set -e
[[ ${status} -eq 0 ]] || fail "attnserve --log_level=warning exited ${status} after SIGTERM"
[[ ! -s ${workdir}/quiet.log ]] ||
  fail "--log_level=warning still wrote: $(head -3 "${workdir}/quiet.log")"

# --log_level=debug: gRPC's own debug lines, through the server's log ('attnserve: grpc D
# FILE:LINE "..."') on stdout.
set +e
timeout -s TERM 3 "${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 \
  --log_level=debug >"${workdir}/debug.out" 2>"${workdir}/debug.err"
set -e
grep -qE '^attnserve: grpc D [a-z_0-9]+\.cc:[0-9]+ "' "${workdir}/debug.out" ||
  fail "--log_level=debug shows no gRPC debug line: $(head -3 "${workdir}/debug.out")"
grep -q "listening on" "${workdir}/debug.out" || fail "--log_level=debug lost the start-up line"

set +e
"${attnserve}" --log_level=loud >"${workdir}/loud.log" 2>&1
status=$?
set -e
[[ ${status} -eq 2 ]] || fail "--log_level=loud exited ${status}, expected 2"
grep -q -- '--log_level is "loud", expected debug, info, warning or error' "${workdir}/loud.log" ||
  fail "--log_level=loud: $(cat "${workdir}/loud.log")"
echo "PASS"
