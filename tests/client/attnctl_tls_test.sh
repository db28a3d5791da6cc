#!/usr/bin/env bash
# The shipped binaries over mutual TLS with a bearer token: attnserve with --tls_cert, --tls_key,
# --tls_client_ca and --auth_token_file; attnctl with the matching flags gets SERVING and an
# Attend answer, and is refused without the token (UNAUTHENTICATED) or its certificate.
# Certificates are made with openssl for this run.
#
# usage: attnctl_tls_test.sh ATTNSERVE ATTNCTL
set -euo pipefail
attnserve=$(realpath "$1")
attnctl=$(realpath "$2")
workdir=$(mktemp -d)
server_pid=""
cleanup() {
  [[ -n ${server_pid} ]] && kill -KILL "${server_pid}" 2>/dev/null || true
  rm -rf "${workdir}"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; tail -20 "${workdir}/server.log" >&2 || true; exit 1; }

cd "${workdir}"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=test-ca -keyout ca.key \
  -out ca.crt 2>/dev/null
for who in server client; do
  openssl req -newkey rsa:2048 -nodes -subj "/CN=${who}" -keyout "${who}.key" \
    -out "${who}.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >"${who}.ext"
  openssl x509 -req -in "${who}.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
    -extfile "${who}.ext" -out "${who}.crt" 2>/dev/null
done
echo "s3cret-token" >token

: >server.log
"${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 --drain_grace_seconds=0 \
  --tls_cert=server.crt --tls_key=server.key --tls_client_ca=ca.crt \
  --auth_token_file=token >server.log 2>&1 &
server_pid=$!
port=""
for _ in $(seq 1 100); do
  port=$(sed -n 's/^attnserve [^ ]* listening on 127\.0\.0\.1:\([0-9]*\),.*/\1/p' server.log || true)
  [[ -n ${port} ]] && break
  kill -0 "${server_pid}" 2>/dev/null || fail "attnserve exited during start-up"
  sleep 0.1
done
[[ -n ${port} ]] || fail "attnserve did not report its port"
grep -q "tls=mutual tls_reload=1m auth_token=on" server.log || fail "start-up line: $(head -1 server.log)"

ctl() {
  timeout 30 "${attnctl}" --target="127.0.0.1:${port}" --timeout=10s "$@"
}
tls=(--tls_ca=ca.crt --tls_cert=client.crt --tls_key=client.key)

[[ $(ctl "${tls[@]}" health) == SERVING ]] || fail "health over mTLS"
ctl "${tls[@]}" --auth_token_file=token attend --demo --heads=2 --kv_heads=2 --query_len=8 --key_len=8 \
  | grep -q "^output shape \[1, 2, 8, 64\]" || fail "attend over mTLS with the token"
# attnctl reads a token file as the server does: comments and blank lines are not the token.
printf '# my token\n\n  s3cret-token  \n' >commented_token
ctl "${tls[@]}" --auth_token_file=commented_token attend --demo --heads=2 --kv_heads=2 \
  --query_len=8 --key_len=8 | grep -q "^output shape" || fail "attend with a commented token file"

set +e
no_token=$(ctl "${tls[@]}" attend --demo --heads=2 --kv_heads=2 --query_len=8 --key_len=8 2>&1)
[[ $? -eq 1 && ${no_token} == *UNAUTHENTICATED* ]] || fail "without the token: ${no_token}"
no_cert=$(ctl --tls_ca=ca.crt --auth_token_file=token health 2>&1)
[[ $? -ne 0 ]] || fail "a client without a certificate was served: ${no_cert}"
plain=$(ctl health 2>&1)
[[ $? -ne 0 ]] || fail "a plaintext client was served: ${plain}"
printf 's3cret-token\nanother-token\n' >two_tokens
two=$(ctl "${tls[@]}" --auth_token_file=two_tokens health 2>&1)
[[ $? -eq 2 && ${two} == *"two_tokens holds 2 tokens, expected one: the token to send"* ]] ||
  fail "a file of two tokens: ${two}"
printf '# only a comment\n' >no_token
none=$(ctl "${tls[@]}" --auth_token_file=no_token health 2>&1)
[[ $? -eq 2 && ${none} == *"no_token holds 0 tokens, expected one"* ]] ||
  fail "a file of no token: ${none}"
# A CA that is a folder or empty would leave gRPC's default roots in its place: refused.
mkdir ca_folder
: >empty_ca
folder=$(ctl --tls_ca=ca_folder --tls_cert=client.crt --tls_key=client.key health 2>&1)
[[ $? -eq 2 && ${folder} == *"--tls_ca file ca_folder cannot be read: ca_folder is a folder"* ]] ||
  fail "a CA that is a folder: ${folder}"
empty=$(ctl --tls_ca=empty_ca --tls_cert=client.crt --tls_key=client.key health 2>&1)
[[ $? -eq 2 && ${empty} == *"--tls_ca file empty_ca is empty"* ]] || fail "an empty CA: ${empty}"
# A key that is not the certificate's, or an encrypted one: gRPC would take either and fail
# every handshake as UNAVAILABLE "empty address list", naming neither (until 2026-12-07).
mismatched=$(ctl --tls_ca=ca.crt --tls_cert=client.crt --tls_key=server.key health 2>&1)
[[ $? -eq 2 && ${mismatched} == *"--tls_key file server.key does not match --tls_cert file client.crt"* ]] ||
  fail "a key of another certificate: ${mismatched}"
openssl pkey -in client.key -aes256 -passout pass:secret -out encrypted.key
encrypted=$(ctl --tls_ca=ca.crt --tls_cert=client.crt --tls_key=encrypted.key health 2>&1 </dev/null)
[[ $? -eq 2 && ${encrypted} == *"--tls_key file encrypted.key holds no unencrypted PEM private key"* ]] ||
  fail "an encrypted key: ${encrypted}"
set -e

kill -TERM "${server_pid}"
wait "${server_pid}" || fail "attnserve exited non-zero after SIGTERM"
server_pid=""
echo PASS
