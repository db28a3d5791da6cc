#!/usr/bin/env bash
# SIGTERM under load, through the shipped binaries: attnctl bench keeps 8 calls in flight while
# attnserve gets SIGTERM. attnserve must turn NOT_SERVING, keep serving for its drain grace,
# refuse new calls with UNAVAILABLE, and exit 0; the load generator must see only full answers,
# UNAVAILABLE refusals, and at most a few calls cancelled by gRPC as the server finally stops.
#
# usage: attnctl_drain_test.sh ATTNSERVE ATTNCTL
set -euo pipefail
attnserve=$(realpath "$1")
attnctl=$(realpath "$2")
workdir=$(mktemp -d)
server_pid=""
bench_pid=""
cleanup() {
  for pid in ${bench_pid} ${server_pid}; do kill -KILL "${pid}" 2>/dev/null || true; done
  rm -rf "${workdir}"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; tail -5 "${workdir}/server.log" >&2 || true; exit 1; }

: >"${workdir}/server.log"
"${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 --drain_grace_seconds=1 \
  >"${workdir}/server.log" 2>&1 &
server_pid=$!
port=""
for _ in $(seq 1 100); do
  port=$(sed -n 's/^attnserve [^ ]* listening on 127\.0\.0\.1:\([0-9]*\),.*/\1/p' \
    "${workdir}/server.log" || true)
  [[ -n ${port} ]] && break
  kill -0 "${server_pid}" 2>/dev/null || fail "attnserve exited during start-up"
  sleep 0.1
done
[[ -n ${port} ]] || fail "attnserve did not report its port"
target="127.0.0.1:${port}"

timeout 60 "${attnctl}" --target="${target}" --timeout=10s bench --concurrency=8 \
  --duration=5s --batch=1 --heads=4 --kv_heads=4 --query_len=64 --key_len=256 --key_dim=32 \
  --value_dim=32 --json >"${workdir}/bench.json" 2>"${workdir}/bench.err" &
bench_pid=$!
sleep 1.5
kill -TERM "${server_pid}"
sleep 0.3
health=$(timeout 10 "${attnctl}" --target="${target}" --timeout=2s health 2>&1 || true)
[[ ${health} == NOT_SERVING* ]] || fail "health during the drain grace: ${health}"

for _ in $(seq 1 300); do
  kill -0 "${server_pid}" 2>/dev/null || break
  sleep 0.1
done
kill -0 "${server_pid}" 2>/dev/null && fail "attnserve still running 30 s after SIGTERM"
set +e
wait "${server_pid}"
status=$?
set -e
server_pid=""
[[ ${status} -eq 0 ]] || fail "attnserve exited ${status} after SIGTERM"
wait "${bench_pid}" || true
bench_pid=""

/usr/bin/python3 - "${workdir}/bench.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
errors = report["errors"]
print("ok", report["ok"], "errors", errors)
assert report["ok"] > 0, "no call was answered before the drain"
assert errors.get("UNAVAILABLE", 0) > 0, "no call was refused after the drain grace"
unexpected = {code: n for code, n in errors.items() if code not in ("UNAVAILABLE", "CANCELLED")}
assert not unexpected, f"unexpected errors: {unexpected}"
assert errors.get("CANCELLED", 0) <= 8, "more calls cancelled than were in flight"
PY
grep -q "attnserve: drained, exiting" "${workdir}/server.log" || fail "no drain message"
echo PASS
