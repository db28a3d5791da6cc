#!/usr/bin/env bash
# attnctl attend, mha and weights with .npy files, end to end on loopback: float32, float16,
# float64 and bfloat16-as-uint16 inputs, every output dtype, options (causal alignments, key
# lengths, bool and float masks, scale, weights, lse), inline and registered weight sets, and
# the exit statuses of bad input. Outputs are checked against a NumPy float64 reference
# (attnctl_reference.py) within the bounds of docs/api.md.
#
# usage: attnctl_npy_test.sh ATTNSERVE ATTNCTL
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/attnctl_test_lib.sh"
ref() { timeout 60 /usr/bin/python3 "${here}/attnctl_reference.py" "$@" || fail "reference: $*"; }

start_server "$1" "$2"
ref inputs "${workdir}"
cd "${workdir}"

# float32 in and out, per-head weights and lse.
ctl attend --query=q32.npy --key=k32.npy --value=v32.npy --output=o32.npy \
  --return_weights=per_head --weights_out=w32.npy --lse_out=l32.npy >attend.out
grep -qx "output shape \[2, 4, 5, 6\] FLOAT32" attend.out || fail "$(cat attend.out)"
grep -qx "wrote w32.npy \[2, 4, 5, 7\] FLOAT32" attend.out || fail "$(cat attend.out)"
ref attend --query q32.npy --key k32.npy --value v32.npy --output o32.npy \
  --weights w32.npy --lse l32.npy

# float16 ('<f2') in, FLOAT16 out by default; causal bottom-right with key lengths, head mean.
ctl attend --query=q16.npy --key=k16.npy --value=v16.npy --output=o16.npy --causal \
  --causal_alignment=bottom_right --key_lengths=5,7 --return_weights=head_mean \
  --weights_out=w16.npy >/dev/null
ref attend --query q16.npy --key k16.npy --value v16.npy --output o16.npy \
  --output_dtype float16 --causal --alignment bottom_right --key_lengths 5,7 \
  --weights w16.npy --weights_kind head_mean

# bfloat16 bit patterns ('<u2') in, BFLOAT16 out as '<u2'; a bool mask and a scale.
ctl attend --bf16_as_uint16 --query=qbf.npy --key=kbf.npy --value=vbf.npy --output=obf.npy \
  --attn_mask=mask_bool.npy --scale=0.5 --causal >/dev/null
ref attend --bf16 --query qbf.npy --key kbf.npy --value vbf.npy --output obf.npy \
  --output_dtype bfloat16 --mask mask_bool.npy --scale 0.5 --causal

# float64 in (rounded to float32), FLOAT16 out on request; a float mask with -inf; lse.
ctl attend --query=q64.npy --key=k64.npy --value=v64.npy --output=o64.npy \
  --attn_mask=mask_float.npy --output_dtype=float16 --lse_out=l64.npy >/dev/null
ref attend --query q64.npy --key k64.npy --value v64.npy --output o64.npy \
  --output_dtype float16 --mask mask_float.npy --lse l64.npy

# Mixed file dtypes, BFLOAT16 out of float32 inputs.
ctl attend --query=q32.npy --key=k16.npy --value=v32.npy --output=omix.npy \
  --output_dtype=bfloat16 --key_lengths=3,0 --return_weights=per_head \
  --weights_out=wmix.npy >/dev/null
ref attend --query q32.npy --key k16.npy --value v32.npy --output omix.npy \
  --output_dtype bfloat16 --key_lengths 3,0 --weights wmix.npy

# Bad input: exit 2 with a message naming the fix; a request the server rejects: exit 1.
expect_exit 2 "pass --bf16_as_uint16" ctl attend --query=qbf.npy --key=kbf.npy --value=vbf.npy
expect_exit 2 "needs --return_weights" ctl attend --query=q32.npy --key=k32.npy \
  --value=v32.npy --weights_out=w.npy
expect_exit 2 "needed together" ctl attend --query=q32.npy --key=k32.npy
expect_exit 2 "missing.npy" ctl attend --query=missing.npy --key=k32.npy --value=v32.npy
expect_exit 2 "only a mask may be bool" ctl attend --query=mask_bool.npy --key=k32.npy \
  --value=v32.npy
expect_exit 2 "exclude each other" ctl attend --demo --query=q32.npy
expect_exit 2 "expected one of top_left, bottom_right" ctl attend --demo --causal_alignment=up
expect_exit 2 "expected one of f32, bf16" ctl attend --demo --precision=f64
expect_exit 1 "INVALID_ARGUMENT: value" ctl attend --query=q32.npy --key=k32.npy --value=q32.npy

# MHA, cross-attention, weights sent inline from a folder (float64, float16, two biases).
ctl mha --query_input=x.npy --kv_input=y.npy --weights_dir=wset --output=mha_inline.npy \
  >mha.out
grep -qx "weights inline" mha.out || fail "$(cat mha.out)"
ref mha --query_input x.npy --kv_input y.npy --weights_dir wset --output mha_inline.npy

# The same set registered, listed, used by name, deleted.
put=$(ctl weights put cross wset)
[[ ${put} =~ ^cross\ version=([0-9]+)\ bytes=[0-9]+$ ]] || fail "weights put: ${put}"
version=${BASH_REMATCH[1]}
ctl weights list | grep -qx "cross version=${version} E=12 Ekv=10 H=4 Hkv=2 Dk=3 Dv=5 bias=1 bytes=[0-9]*" ||
  fail "weights list: $(ctl weights list)"
[[ $(ctl weights) == "$(ctl weights list)" ]] || fail "weights and weights list differ"
ctl mha --query_input=x.npy --kv_input=y.npy --weights_name=cross --output=mha_named.npy \
  >mha.out
grep -qx "weights cross version ${version}" mha.out || fail "$(cat mha.out)"
ref mha --query_input x.npy --kv_input y.npy --weights_dir wset --output mha_named.npy
# --demo with Ekv != E draws a random kv_input too.
ctl mha --demo --weights_name=cross --batch=2 --query_len=3 --key_len=4 | grep -qx \
  "output shape \[2, 3, 12\] FLOAT32" || fail "mha --demo with a cross-attention set"
deleted=$(ctl weights delete cross)
[[ ${deleted} == "deleted cross version=${version} E=12 "* ]] || fail "weights delete: ${deleted}"
ctl weights list | grep -q "^cross " && fail "cross still listed after delete"
expect_exit 1 "NOT_FOUND" ctl weights delete cross
expect_exit 1 "NOT_FOUND" ctl mha --query_input=x.npy --kv_input=y.npy --weights_name=cross
expect_exit 2 "put NAME FOLDER" ctl weights put lonely
expect_exit 2 "config.txt is missing" ctl weights put nothing "${workdir}/no_such_folder"
expect_exit 2 "exclude each other" ctl mha --query_input=x.npy --weights_name=demo \
  --weights_dir=wset
# A bias that is a link looping on itself is refused naming it (it ended attnctl, 2026-12-06),
# an --output FIFO no one reads fails rather than waits (one read, and /dev/stdout into a pipe,
# are written), and --timeout must be finite.
mkdir looped && cp wset/* looped/ && rm -f looped/b_q.npy && ln -s b_q.npy looped/b_q.npy
expect_exit 2 "b_q.npy" ctl weights put looped looped
mkfifo out.fifo
expect_exit 1 "cannot open out.fifo (a FIFO no one reads)" \
  timeout 20 "${attnctl}" --target="${target}" attend --demo --output=out.fifo
timeout 30 cat out.fifo >fifo.npy &
reader=$!
wrote=""
for _ in $(seq 1 50); do  # Until the reader has opened its end.
  if ctl attend --demo --output=out.fifo >/dev/null 2>&1; then wrote=1; break; fi
  sleep 0.1
done
[[ -n ${wrote} ]] || fail "a FIFO with a reader was not written"
wait "${reader}"
/usr/bin/python3 -c "import numpy; numpy.load('fifo.npy')" || fail "the FIFO's reader got no .npy"
ctl attend --demo --output=/dev/stdout | cat >piped.bin || fail "--output=/dev/stdout into a pipe failed"
grep -q NUMPY piped.bin || fail "--output=/dev/stdout into a pipe wrote no .npy"
expect_exit 2 "--timeout is -inf, expected a positive, finite duration" ctl --timeout=-inf health
echo not a certificate >garbage.pem
expect_exit 2 "--tls_ca file garbage.pem holds no PEM certificate" ctl --tls_ca=garbage.pem health
# A folder whose set cannot be described is unusable input, with or without --demo.
mkdir flat && cp wset/* flat/
/usr/bin/python3 -c "import numpy; numpy.save('flat/w_q.npy', numpy.zeros((1, 12, 12), numpy.float32))"
expect_exit 2 "weights_dir=flat: w_q has 3 dimensions, expected 2" ctl mha --demo --weights_dir=flat
expect_exit 2 "weights_dir=flat: w_q has 3 dimensions, expected 2" ctl mha \
  --query_input=x.npy --kv_input=y.npy --weights_dir=flat

stop_server
echo "PASS"
