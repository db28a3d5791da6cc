#!/usr/bin/env bash
# The request that killed attnserve on Intel CPUs with AMX (oneDNN 2.6.3's AMX bf16 matmul
# executed an illegal instruction on its K = 63 matmul), sent through the shipped binaries, with
# shapes of the same class on the fused, decode and MHA paths: each is answered, and the server
# is still alive and serving afterwards. On any CPU; on one with AMX it is the regression test
# of docs/reliability.md's "oneDNN's AMX bf16 matmul".
#
# usage: attnctl_bf16_shapes_test.sh ATTNSERVE ATTNCTL
set -euo pipefail

here=$(dirname "$(realpath "$0")")
source "${here}/attnctl_test_lib.sh"
start_server "$1" "$2"

# The report's repro, word for word: the unfused path (weights asked for).
repro=$(ctl attend --demo --batch=1 --heads=1 --kv_heads=1 --query_len=65 --key_len=63 \
            --key_dim=8 --value_dim=4 --precision=bf16 --return_weights=per_head)
echo "${repro}"
grep -qx "output shape \[1, 1, 65, 4\] FLOAT32" <<<"${repro}" || fail "repro output shape"

# The same class on the fused tiles (M = 33, 65), a decode step of 16 heads over 2 kv heads
# (tiles of 8 rows, a tail of 63 keys after two blocks), and MHA projections with E = 63.
for shape in "--query_len=33 --key_len=63" "--query_len=65 --key_len=63 --key_dim=63" \
             "--heads=16 --kv_heads=2 --query_len=1 --key_len=575 --key_dim=64"; do
  # shellcheck disable=SC2086  # The shape is several flags.
  ctl attend --demo --batch=1 ${shape} --precision=bf16 >/dev/null ||
    fail "attend ${shape} --precision=bf16 failed"
done
ctl mha --demo --batch=3 --query_len=21 --precision=bf16 >/dev/null || fail "mha bf16 failed"

kill -0 "${server_pid}" 2>/dev/null || fail "attnserve died"
[[ $(ctl health) == SERVING ]] || fail "server not serving after the bf16 requests"
ctl attend --demo --precision=bf16 --return_weights=per_head >/dev/null ||
  fail "a later request failed"

stop_server  # SIGTERM; fails unless attnserve exits 0.
echo "PASS"
