#!/usr/bin/env bash
# End to end through the shipped binaries: starts attnserve on a free loopback port, drives it
# with attnctl (health, services, attend --demo, a bad request), then stops it with SIGTERM and
# expects exit status 0.
#
# usage: attnctl_e2e_test.sh ATTNSERVE ATTNCTL
set -euo pipefail

here=$(dirname "$(realpath "$0")")
source "${here}/attnctl_test_lib.sh"
start_server "$1" "$2"

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

expect_exit 1 "INVALID_ARGUMENT: query.shape\[1\] (H) is 3" ctl attend --demo --heads=3 --kv_heads=2
[[ $(ctl health) == SERVING ]] || fail "server not serving after a bad request"

expect_exit 2 "COMMAND" "${attnctl}"  # No command: usage, exit 2.

stop_server  # SIGTERM; fails unless attnserve exits 0.
echo "PASS"
