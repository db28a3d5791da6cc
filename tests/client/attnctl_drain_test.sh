#!/usr/bin/env bash
# SIGTERM under load, through the shipped binaries: attnctl bench keeps 8 calls in flight while
# attnserve gets SIGTERM. attnserve must turn NOT_SERVING, keep serving for its drain grace,
# refuse new calls with UNAVAILABLE, and exit 0; the load generator must see only full answers
# and UNAVAILABLE refusals, none cancelled as the server finally stops.
#
# usage: attnctl_drain_test.sh ATTNSERVE ATTNCTL
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"
attnctl=$(realpath "$2")

# A grace of 2 s: the health call below, a process of its own, must reach the server within it
# on a loaded machine too.
start_attnserve "$(realpath "$1")" --drain_grace_seconds=2
target="127.0.0.1:${port}"

timeout 60 "${attnctl}" --target="${target}" --timeout=10s bench --concurrency=8 \
  --duration=6s --batch=1 --heads=4 --kv_heads=4 --query_len=64 --key_len=256 --key_dim=32 \
  --value_dim=32 --json >"${workdir}/bench.json" 2>"${workdir}/bench.err" &
bench_pid=$!
cleanup_pids+=("${bench_pid}")
sleep 1.5
kill -TERM "${server_pid}"
sleep 0.2
health=$(timeout 10 "${attnctl}" --target="${target}" --timeout=2s health 2>&1 || true)
[[ ${health} == NOT_SERVING* ]] || fail "health during the drain grace: ${health}"

wait_attnserve_exit
wait "${bench_pid}" || true

/usr/bin/python3 - "${workdir}/bench.json" <<'PY' || fail "the load generator's report: $(tail -5 "${workdir}/bench.err")"
import json, sys
report = json.load(open(sys.argv[1]))
errors = report["errors"]
print("ok", report["ok"], "errors", errors)
assert report["ok"] > 0, "no call was answered before the drain"
assert errors.get("UNAVAILABLE", 0) > 0, "no call was refused after the drain grace"
unexpected = {code: n for code, n in errors.items() if code != "UNAVAILABLE"}
# gRPC cancels a call that reaches it while it stops taking streams, before the client has
# seen its GOAWAY. The server holds its last refusals until gRPC has stopped (server/call_gate.h),
# so no worker has a call on its way then: every call ends answered or UNAVAILABLE.
assert not unexpected, f"calls neither answered nor refused with UNAVAILABLE: {unexpected}"
PY
grep -q "attnserve: drained, exiting" "${workdir}/server.log" || fail "no drain message"
echo PASS
