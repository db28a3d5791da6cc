#!/usr/bin/env bash
# End to end through the shipped binaries: starts attnserve on a free loopback port, drives it
# with attnctl (health, services, attend --demo, a bad request), then stops it with SIGTERM and
# expects exit status 0.
#
# usage: attnctl_e2e_test.sh ATTNSERVE ATTNCTL
set -euo pipefail

attnserve=$1
attnctl=$2
workdir=$(mktemp -d)
server_pid=""

cleanup() {
  if [[ -n ${server_pid} ]] && kill -0 "${server_pid}" 2>/dev/null; then
    kill -KILL "${server_pid}" 2>/dev/null || true
  fi
  rm -rf "${workdir}"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  echo "--- server log" >&2
  cat "${workdir}/server.log" >&2 || true
  exit 1
}

: >"${workdir}/server.log"  # Exists before the server writes it, for the port wait below.
"${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 --threads=2 \
  >"${workdir}/server.log" 2>&1 &
server_pid=$!

port=""
for _ in $(seq 1 100); do
  port=$(sed -n 's/^attnserve [^ ]* listening on 127\.0\.0\.1:\([0-9]*\),.*/\1/p' "${workdir}/server.log" || true)
  [[ -n ${port} ]] && break
  kill -0 "${server_pid}" 2>/dev/null || fail "attnserve exited during start-up"
  sleep 0.1
done
[[ -n ${port} ]] || fail "attnserve did not report its port within 10 s"
target="127.0.0.1:${port}"
ctl() { timeout 60 "${attnctl}" --target="${target}" --timeout=30s "$@"; }

[[ $(ctl health) == SERVING ]] || fail "health is not SERVING"
[[ $(ctl health attnserve.v1.AttentionService) == SERVING ]] || fail "service health"

services=$(ctl services)
for service in attnserve.v1.AttentionService grpc.health.v1.Health \
               grpc.reflection.v1alpha.ServerReflection; do
  grep -qx "${service}" <<<"${services}" || fail "reflection does not list ${service}"
done

demo=$(ctl attend --demo --batch=2 --heads=4 --kv_heads=2 --query_len=17 --key_len=33 \
           --key_dim=16 --value_dim=8)
echo "${demo}"
grep -qx "output shape \[2, 4, 17, 8\] FLOAT32" <<<"${demo}" || fail "demo output shape"
grep -q "^checksum sum=" <<<"${demo}" || fail "demo checksum"
grep -q "^server queue_us=[0-9]* compute_us=[0-9]*" <<<"${demo}" || fail "demo timings"
# The same seed gives the same inputs, so the same checksum.
[[ $(ctl attend --demo --batch=2 --heads=4 --kv_heads=2 --query_len=17 --key_len=33 \
         --key_dim=16 --value_dim=8 | grep checksum) == $(grep checksum <<<"${demo}") ]] ||
  fail "demo checksum is not reproducible"

[[ $(ctl weights) == "demo version=1 E=64 Ekv=64 H=8 Hkv=8 Dk=8 Dv=8 bias=1 "* ]] ||
  fail "the built-in demo weights are not listed: $(ctl weights)"
mha=$(ctl mha --demo --batch=2 --query_len=5)
echo "${mha}"
grep -qx "output shape \[2, 5, 64\] FLOAT32" <<<"${mha}" || fail "mha demo output shape"
grep -q "^weights demo version 1" <<<"${mha}" || fail "mha demo weights version"

set +e
bad=$(ctl attend --demo --heads=3 --kv_heads=2 2>&1)
status=$?
set -e
[[ ${status} -eq 1 ]] || fail "a bad request exited ${status}, expected 1"
grep -q "INVALID_ARGUMENT: query.shape\[1\] (H) is 3" <<<"${bad}" || fail "bad request: ${bad}"
[[ $(ctl health) == SERVING ]] || fail "server not serving after a bad request"

set +e
"${attnctl}" >/dev/null 2>&1
[[ $? -eq 2 ]] || fail "attnctl without a command must exit 2"
set -e

kill -TERM "${server_pid}"
for _ in $(seq 1 300); do
  kill -0 "${server_pid}" 2>/dev/null || break
  sleep 0.1
done
kill -0 "${server_pid}" 2>/dev/null && fail "attnserve still running 30 s after SIGTERM"
set +e
wait "${server_pid}"
exit_status=$?
set -e
server_pid=""
[[ ${exit_status} -eq 0 ]] || fail "attnserve exited ${exit_status} after SIGTERM, expected 0"
echo "PASS"
