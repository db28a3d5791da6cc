#!/usr/bin/env bash
# attnctl session and bench --rpc=step end to end on loopback: create, a prefill from .npy files,
# a decode step whose output and lse are checked against a NumPy float64 reference over every
# token sent, --demo steps, fork (the child attends over the shared prefix), truncate, get,
# list, delete and NOT_FOUND after it, a stale session's usage errors; then the decode bench,
# with --compare_stateless, its JSON parsed.
#
# usage: attnctl_session_test.sh ATTNSERVE ATTNCTL
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/attnctl_test_lib.sh"

py() { timeout 30 /usr/bin/python3 - "$@"; }

start_server "$1" "$2"
cd "${workdir}"

# H=4 query heads on Hkv=2, Dk=8, Dv=6; 7 tokens of prefill, then 2 tokens with 2 query rows.
py <<'PY'
import numpy as np
rng = np.random.default_rng(3)
u = lambda *shape: rng.uniform(-1, 1, shape).astype(np.float32)
for name, shape in (("k0", (2, 7, 8)), ("v0", (2, 7, 6)), ("k1", (2, 2, 8)), ("v1", (2, 2, 6)),
                    ("q1", (4, 2, 8)), ("k2", (2, 1, 8)), ("v2", (2, 1, 6)), ("q2", (4, 1, 8))):
    np.save(f"{name}.npy", u(*shape))
PY

line=$(ctl session create --layers=2 --heads=4 --kv_heads=2 --key_dim=8 --value_dim=6 --ttl=60s)
echo "${line}"
id=${line%% *}
[[ ${id} =~ ^[0-9a-f]{32}$ ]] || fail "session id '${id}' is not 32 hex digits"
grep -q " layers=2 H=4 Hkv=2 Dk=8 Dv=6 dtype=FLOAT32 lengths=0,0 " <<<"${line}" ||
  fail "create printed '${line}'"
[[ ${line} =~ \ replica=[A-Za-z0-9._-]+/[0-9a-f]{16}$ ]] ||
  fail "create did not name the replica: '${line}'"

out=$(ctl session step "${id}" --layer=0 --key=k0.npy --value=v0.npy)
grep -q "^layer 0 length 0 -> 7," <<<"${out}" || fail "prefill printed '${out}'"
grep -q "output shape" <<<"${out}" && fail "an append-only step printed an output"
out=$(ctl session step "${id}" --layer=0 --key=k1.npy --value=v1.npy --query=q1.npy \
  --output=o1.npy --lse_out=l1.npy)
echo "${out}"
grep -q "^layer 0 length 7 -> 9," <<<"${out}" || fail "decode printed '${out}'"
grep -qx "output shape \[4, 2, 6\] FLOAT32" <<<"${out}" || fail "decode output shape"

# The reference: bottom-right causal over the 9 tokens, query head h on kv head h // 2.
check_reference() {  # KEYS VALUES QUERY OUTPUT LSE
  py "$@" <<'PY' || fail "session step output differs from the reference"
import sys
import numpy as np
keys, values, query, output, lse = sys.argv[1:]
k = np.concatenate([np.load(f) for f in keys.split(",")], axis=1).astype(np.float64)
v = np.concatenate([np.load(f) for f in values.split(",")], axis=1).astype(np.float64)
q = np.load(query).astype(np.float64)
H, Tq, Dk = q.shape
L = k.shape[1]
k, v = np.repeat(k, H // k.shape[0], axis=0), np.repeat(v, H // v.shape[0], axis=0)
s = q @ k.transpose(0, 2, 1) / np.sqrt(Dk)
i, j = np.arange(Tq)[:, None], np.arange(L)[None, :]
s = np.where(j <= i + L - Tq, s, -np.inf)
m = s.max(axis=-1, keepdims=True)
p = np.exp(s - m)
expected_lse = (np.log(p.sum(axis=-1)) + m[..., 0])
expected = (p / p.sum(axis=-1, keepdims=True)) @ v
got, got_lse = np.load(output), np.load(lse)
assert got.shape == expected.shape, (got.shape, expected.shape)
assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()
assert np.abs(got_lse - expected_lse).max() < 1e-4, np.abs(got_lse - expected_lse).max()
PY
}
check_reference k0.npy,k1.npy v0.npy,v1.npy q1.npy o1.npy l1.npy

# Random steps on layer 1, then the lengths as the server has them.
ctl session step "${id}" --layer=1 --demo --tokens=5 --query_tokens=0 >/dev/null
out=$(ctl session step "${id}" --layer=1 --demo --tokens=1 --query_tokens=3 --precision=bf16)
grep -q "^layer 1 length 5 -> 6," <<<"${out}" || fail "demo step printed '${out}'"
grep -qx "output shape \[4, 3, 6\] FLOAT32" <<<"${out}" || fail "demo step output shape"
[[ $(ctl session get "${id}") == "${id} layers=2 H=4 Hkv=2 Dk=8 Dv=6 dtype=FLOAT32 lengths=9,6 "* ]] ||
  fail "get printed '$(ctl session get "${id}")'"

# A fork of the first 7 tokens attends over the parent's prefill and its own token.
child_line=$(ctl session fork "${id}" 7)
echo "${child_line}"
child=${child_line%% *}
grep -q " lengths=7,6 .* forked_from=${id} replica=" <<<"${child_line}" || fail "fork printed '${child_line}'"
ctl session step "${child}" --key=k2.npy --value=v2.npy --query=q2.npy --output=o2.npy \
  --lse_out=l2.npy >/dev/null
check_reference k0.npy,k2.npy v0.npy,v2.npy q2.npy o2.npy l2.npy

[[ $(ctl session truncate "${id}" 3) == *" lengths=3,3 "* ]] || fail "truncate"
list=$(ctl session list)
echo "${list}"
grep -q "^${id} " <<<"${list}" && grep -q "^${child} " <<<"${list}" || fail "list lacks them"
grep -q "^sessions=[0-9]* total_bytes=[0-9]* budget_bytes=[0-9]* identity_held_bytes=[1-9][0-9]* identity_budget_bytes=0 identity_max_sessions=0$" <<<"${list}" || fail "list total"

# Usage errors, before any step is sent.
expect_exit 2 "key and --value are needed together" ctl session step "${id}" --key=k2.npy
expect_exit 2 "layer is 5" ctl session step "${id}" --layer=5 --demo
# An output it could not write is refused before the step appends anything.
expect_exit 2 "--output is /nonexistent/o.npy, in /nonexistent, not a writable folder" \
  ctl session step "${id}" --demo --tokens=1 --query_tokens=1 --output=/nonexistent/o.npy
# A FIFO (whose open would wait for a reader after the append) and a link to nothing too.
mkfifo out.fifo
expect_exit 2 "--output is out.fifo, a FIFO" \
  timeout 20 "${attnctl}" --target="${target}" session step "${id}" --demo --tokens=1 \
  --query_tokens=1 --output=out.fifo
ln -s nowhere/o.npy dangling.npy
expect_exit 2 "--lse_out is dangling.npy, a symbolic link to nothing" \
  ctl session step "${id}" --demo --tokens=1 --query_tokens=1 --lse_out=dangling.npy
[[ $(ctl session get "${id}") == *" lengths=3,3 "* ]] || fail "a refused step appended"
expect_exit 2 "truncate's LENGTH" ctl session truncate "${id}" four
expect_exit 2 "session takes" ctl session frobnicate
expect_exit 2 "^attnctl: --layers is 0, expected 1 to" ctl session create --layers=0
# The server's own refusal: a query of the wrong width.
expect_exit 1 "INVALID_ARGUMENT" ctl session step "${id}" --query=k2.npy

[[ $(ctl session delete "${id}") == "deleted ${id} "* ]] || fail "delete"
expect_exit 1 "NOT_FOUND" ctl session get "${id}"
expect_exit 1 "NOT_FOUND" ctl session step "${id}" --demo
ctl session delete "${child}" >/dev/null

# The decode bench, with its stateless twin.
ctl bench --rpc=step --sessions=3 --context=64 --steps=8 --layers=2 --heads=4 --kv_heads=2 \
  --key_dim=16 --value_dim=16 --compare_stateless --json >step.json
py step.json <<'PY' || fail "bench --rpc=step JSON: $(cat step.json)"
import json, sys
r = json.loads(open(sys.argv[1]).read())
assert r["rpc"] == "step" and r["sessions"] == 3, r
assert r["shape"] == "sessions=3 context=64 layers=2 H=4 Hkv=2 Dk=16 Dv=16", r["shape"]
# q + k + v + o per session and layer, float32.
assert r["payload_bytes_per_step"] == 2 * 3 * (4 * 16 + 2 * 32 + 4 * 16) * 4, r
step, attend = r["phases"]["step"], r["phases"]["attend"]
for phase in (step, attend):
    assert phase["steps"] == 8 and phase["ok"] == 8 and phase["error_count"] == 0, phase
    assert 0 < phase["latency_ms"]["p50"] <= phase["latency_ms"]["p99"], phase
    assert phase["tokens_per_s"] > 0, phase
# A step ships one token's keys; Attend ships all 65.
assert step["request_bytes_per_step"] * 10 < attend["request_bytes_per_step"], r
PY
text=$(ctl bench --rpc=step --sessions=2 --context=16 --steps=4 --heads=2 --kv_heads=2 \
  --key_dim=8 --value_dim=8)
echo "${text}"
grep -q "^step: 4 steps ok 4 errors 0 in " <<<"${text}" || fail "bench step text"
# Attends whose q + k + v pass --max_message_bytes fail at once; the Step phase goes on.
text=$(ctl --max_message_bytes=1000000 bench --rpc=step --sessions=4 --context=300 --steps=20 \
  --heads=2 --kv_heads=2 --key_dim=64 --value_dim=64 --compare_stateless)
grep -q "^step: 20 steps ok 20 errors 0 in " <<<"${text}" || fail "a failed attend phase: ${text}"
grep -q "^attend: 1 steps ok 0 errors 1 in " <<<"${text}" || fail "the attend phase: ${text}"
[[ $(ctl session list | head -1) == sessions=0* ]] || fail "bench left sessions behind"
expect_exit 2 "needs --sessions" ctl bench --rpc=step --sessions=0

stop_server
echo "PASS"
