#!/usr/bin/env bash
# Start-up against files an operator (or an attacker with a foothold in a mounted volume) got
# wrong: each must fail start-up within seconds with its own cause, never hang, never follow a
# link out of --weights_dir, never print a file's content. Then the Kubernetes layout
# (folders reached through ..data links inside the volume) must still load.
#
# usage: startup_files_test.sh ATTNSERVE
set -euo pipefail

attnserve=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

# expect_start_failure PATTERN FLAG...: attnserve with FLAGs must exit non-zero (or
# ${expected_status}, when set) within 20 s, printing PATTERN (a grep -E pattern) and never
# "root:" (the content of /etc/passwd).
expect_start_failure() {
  local pattern=$1 output status
  shift
  set +e
  output=$(timeout 20 "${attnserve_prefix[@]+"${attnserve_prefix[@]}"}" "${attnserve}" \
    --address=127.0.0.1 --port=0 --metrics_port=0 "$@" 2>&1)
  status=$?
  set -e
  [[ ${status} -ne 124 ]] || fail "attnserve $* hung in start-up: ${output}"
  [[ ${status} -ne 0 ]] || fail "attnserve $* started: ${output}"
  [[ -z ${expected_status:-} || ${status} -eq ${expected_status} ]] ||
    fail "attnserve $* exited ${status}, expected ${expected_status}"
  grep -qE -- "${pattern}" <<<"${output}" || fail "attnserve $* printed '${output}', expected '${pattern}'"
  ! grep -q "root:" <<<"${output}" || fail "attnserve $* printed a file's content: ${output}"
  echo "ok: $* -> ${output}"
}

# A weight set folder in the layout --weights_dir reads.
make_weights() {
  mkdir -p "$1"
  echo "num_heads=2" >"$1/config.txt"
  /usr/bin/python3 - "$1" <<'PYTHON'
import sys, numpy
for name in ("w_q", "w_k", "w_v", "w_o"):
    numpy.save(f"{sys.argv[1]}/{name}.npy", numpy.full((8, 8), 0.1, dtype=numpy.float32))
PYTHON
}

dir="${workdir}/fifo" && make_weights "${dir}/set" && rm "${dir}/set/w_q.npy" &&
  mkfifo "${dir}/set/w_q.npy"
expect_start_failure "w_q.npy is not a folder or a regular file" --weights_dir="${dir}"

dir="${workdir}/passwd_link" && make_weights "${dir}/set" && rm "${dir}/set/config.txt" &&
  ln -s /etc/passwd "${dir}/set/config.txt"
expect_start_failure "config.txt is a symbolic link that does not resolve inside --weights_dir" \
  --weights_dir="${dir}"

dir="${workdir}/folder_link" && mkdir -p "${dir}" && make_weights "${workdir}/outside" &&
  ln -s "${workdir}/outside" "${dir}/set"
expect_start_failure "set is a symbolic link that does not resolve inside" --weights_dir="${dir}"

# --weights_dir pointed at one weight set's folder (attnctl's layout) instead of the folder above.
dir="${workdir}/one_set" && make_weights "${dir}/set"
expected_status=2 expect_start_failure \
  "--weights_dir .*/set holds (config.txt|w_[a-z]+.npy): it is one weight set's folder; expected the folder holding one folder per weight set \(its parent, to register it as 'set'\)" \
  --weights_dir="${dir}/set"

# A version past 2^62 would let the registry's count of puts overflow.
dir="${workdir}/huge_version" && make_weights "${dir}/set" &&
  echo "version=9223372036854775807" >>"${dir}/set/config.txt"
expect_start_failure "line [0-9]+ sets version to 9223372036854775807, expected 1 to 4611686018427387904" \
  --weights_dir="${dir}"

dir="${workdir}/passwd_copy" && make_weights "${dir}/set" && head -3 /etc/passwd >"${dir}/set/config.txt"
expect_start_failure "config.txt: line 1 is not key=integer" --weights_dir="${dir}"

printf 'secret\nsec\x01ond\n' >"${workdir}/token_two_lines"
expect_start_failure "holds byte 0x01 at offset 3 of the token on line 2, expected one token per line of printable ASCII" \
  --auth_token_file="${workdir}/token_two_lines"
printf '\n \n' >"${workdir}/token_blank"
expect_start_failure "token_blank holds no token" --auth_token_file="${workdir}/token_blank"
expect_start_failure "weights_admin_token_file: .*token_blank holds no token" \
  --weights_admin_token_file="${workdir}/token_blank"
mkfifo "${workdir}/token_fifo"
expect_start_failure "token_fifo is a FIFO, expected a regular file" \
  --auth_token_file="${workdir}/token_fifo"

for name in a b; do
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=${name}" \
    -keyout "${workdir}/${name}.key" -out "${workdir}/${name}.crt" 2>/dev/null
done
expect_start_failure "tls_key: .*b.key does not match the certificate in --tls_cert .*a.crt" \
  --tls_cert="${workdir}/a.crt" --tls_key="${workdir}/b.key"
expect_start_failure "tls_cert: .*a.key holds no PEM certificate" \
  --tls_cert="${workdir}/a.key" --tls_key="${workdir}/a.key"
expect_start_failure "tls_key: .*a.crt holds no unencrypted PEM private key" \
  --tls_cert="${workdir}/a.crt" --tls_key="${workdir}/a.crt"
expect_start_failure "tls_client_ca: .*a.key holds no PEM certificate" \
  --tls_cert="${workdir}/a.crt" --tls_key="${workdir}/a.key" --tls_client_ca="${workdir}/a.key"
# A broken block amid a CA bundle: gRPC would drop it and every CA after it, silently.
{
  cat "${workdir}/a.crt"
  printf -- '-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n'
  cat "${workdir}/b.crt"
} >"${workdir}/broken_bundle.crt"
expect_start_failure "tls_client_ca: .*broken_bundle.crt: certificate 2 of the 3 .* is not readable" \
  --tls_cert="${workdir}/a.crt" --tls_key="${workdir}/a.key" \
  --tls_client_ca="${workdir}/broken_bundle.crt"
# And a broken block amid the server's chain: gRPC would send the chain up to it, and clients
# needing the intermediates past it would fail their handshakes.
cat "${workdir}/a.crt" - "${workdir}/b.crt" >"${workdir}/broken_chain.crt" <<'PEM'
-----BEGIN CERTIFICATE-----
bm90IGEgY2VydGlmaWNhdGU=
-----END CERTIFICATE-----
PEM
expect_start_failure "tls_cert: .*broken_chain.crt: certificate 2 of the 3 .* is not readable" \
  --tls_cert="${workdir}/broken_chain.crt" --tls_key="${workdir}/a.key"
# A key OpenSSL's security level will not serve (RSA-1024): gRPC listened, then failed every
# handshake, unsaid (until 2026-12-07).
openssl req -x509 -newkey rsa:1024 -nodes -days 2 -subj "/CN=weak" \
  -keyout "${workdir}/weak.key" -out "${workdir}/weak.crt" 2>/dev/null
expect_start_failure "tls_cert: .*weak.crt: OpenSSL will not serve its certificate with --tls_key .*weak.key: ee key too small" \
  --tls_cert="${workdir}/weak.crt" --tls_key="${workdir}/weak.key"
# A CA bundle in the old header OpenSSL still reads is taken (it was refused as unreadable).
sed 's/BEGIN CERTIFICATE/BEGIN X509 CERTIFICATE/; s/END CERTIFICATE/END X509 CERTIFICATE/' \
  "${workdir}/b.crt" | cat "${workdir}/a.crt" - >"${workdir}/old_header_bundle.crt"
start_attnserve "${attnserve}" --tls_cert="${workdir}/a.crt" --tls_key="${workdir}/a.key" \
  --tls_client_ca="${workdir}/old_header_bundle.crt" --drain_grace_seconds=0
stop_attnserve
# A certificate past its notAfter (made with `openssl ca`, the one way to choose its dates in
# OpenSSL 3.0) is refused, naming when it expired; one not valid yet only warns (clock skew).
validity() {  # NAME START END: NAME.crt, self-signed, valid from START to END.
  (cd "${workdir}" &&
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$1" -keyout "$1.key" -out "$1.csr" 2>/dev/null &&
    rm -f index.txt && touch index.txt && echo 01 >serial &&
    printf '[ca]\ndefault_ca=d\n[d]\ndatabase=index.txt\nnew_certs_dir=.\nserial=serial\ndefault_md=sha256\npolicy=p\n[p]\ncommonName=supplied\n' >ca.cnf &&
    openssl ca -config ca.cnf -selfsign -keyfile "$1.key" -in "$1.csr" -startdate "$2" \
      -enddate "$3" -batch -out "$1.crt" 2>/dev/null) || fail "openssl could not make $1.crt"
}
validity expired 20200101000000Z 20200102000000Z
expect_start_failure "tls_cert: .*expired.crt: its certificate expired at Jan  2 00:00:00 2020 GMT" \
  --tls_cert="${workdir}/expired.crt" --tls_key="${workdir}/expired.key"
validity future 21000101000000Z 21000102000000Z
start_attnserve "${attnserve}" --tls_cert="${workdir}/future.crt" --tls_key="${workdir}/future.key" \
  --drain_grace_seconds=0
stop_attnserve
grep -q "future.crt: its certificate is valid only from Jan  1 00:00:00 2100 GMT" "${workdir}/server.log" ||
  fail "a certificate not valid yet was not warned of"
# An encrypted key is refused, never prompted for: with stdin a pipe nobody writes to (a FIFO
# held open read-write, so it never ends), OpenSSL's default prompt would wait there.
openssl pkey -in "${workdir}/a.key" -aes256 -passout pass:secret -out "${workdir}/encrypted.key"
mkfifo "${workdir}/silent_stdin"
exec 3<>"${workdir}/silent_stdin"
expect_start_failure "tls_key: .*encrypted.key holds no unencrypted PEM private key" \
  --tls_cert="${workdir}/a.crt" --tls_key="${workdir}/encrypted.key" <&3
exec 3<&-
# A token no client can send in gRPC's 8 KiB of headers.
head -c 5000 /dev/zero | tr '\0' 'x' >"${workdir}/token_long"
expect_start_failure "token_long holds a token of 5000 bytes on line 1, expected at most 4096" \
  --auth_token_file="${workdir}/token_long"

# An access log that is a FIFO no process reads stopped start-up before it listened, for as long
# as no reader came (and a signal's "during start-up" was all it said).
mkfifo "${workdir}/access_fifo"
expected_status=2 expect_start_failure \
  "access_log .*access_fifo is a FIFO no process reads; expected stdout, stderr, a file, or a FIFO a reader has open" \
  --access_log="${workdir}/access_fifo"
# With a reader, it is the log.
cat "${workdir}/access_fifo" >"${workdir}/access_fifo.out" &
reader=$!
start_attnserve "${attnserve}" --access_log="${workdir}/access_fifo" --drain_grace_seconds=0
stop_attnserve
wait "${reader}" || fail "the access log's reader failed"
# Weights over --max_weights_bytes are a configuration that cannot work: exit 2, as budgets that
# do not fit the memory limit are.
expected_status=2 expect_start_failure \
  "RESOURCE_EXHAUSTED: weights 'demo' need [0-9]+ bytes, more than the whole --max_weights_bytes limit of 1" --max_weights_bytes=1

# Kubernetes mounts a volume as ..<timestamp>/ with a ..data link to it and a link per entry.
dir="${workdir}/k8s" && make_weights "${dir}/..2026_12_01/mounted" &&
  ln -s ..2026_12_01 "${dir}/..data" && ln -s ..data/mounted "${dir}/mounted"
printf 'token-1\n' >"${workdir}/token_ok"
start_attnserve "${attnserve}" --weights_dir="${dir}" --auth_token_file="${workdir}/token_ok" \
  --tls_cert="${workdir}/a.crt" --tls_key="${workdir}/a.key" --drain_grace_seconds=0
grep -q "^attnserve weights: demo, mounted$" "${workdir}/server.log" ||
  fail "the Kubernetes-style folder did not load: $(cat "${workdir}/server.log")"
! grep -q "attnserve: warning" "${workdir}/server.log" ||
  fail "a warning with one token: $(cat "${workdir}/server.log")"
stop_attnserve
# Several tokens without admin tokens: each may change the others' weight sets, said at start-up
# (an audit of tenant isolation, 2026-12-07); with admin tokens, not.
printf 'token-1\ntoken-2\n' >"${workdir}/token_two"
start_attnserve "${attnserve}" --auth_token_file="${workdir}/token_two" --drain_grace_seconds=0
grep -q "attnserve: warning: auth_token_file holds 2 tokens and no weights_admin_token_file is \
set: any of them may put or delete any weight set" "${workdir}/server.log" ||
  fail "no warning of shared weight changes: $(cat "${workdir}/server.log")"
stop_attnserve
start_attnserve "${attnserve}" --auth_token_file="${workdir}/token_two" \
  --weights_admin_token_file="${workdir}/token_ok" --drain_grace_seconds=0
! grep -q "attnserve: warning" "${workdir}/server.log" ||
  fail "a warning with admin tokens: $(cat "${workdir}/server.log")"
stop_attnserve

# Memory budgets that cannot fit the memory limit (here physical memory or the cgroup's, both
# far below 2^60 bytes) stop start-up with exit 2, naming each term.
expected_status=2 expect_start_failure \
  "memory budgets do not fit the memory limit: --max_weights_bytes 1152921504606846976 .* --max_inflight_bytes 1048576 .* bytes of (physical memory|cgroup )" \
  --max_weights_bytes=$((1 << 60)) --max_inflight_bytes=1048576
expected_status=2 expect_start_failure "max_inflight_bytes is -1, expected >= 0" \
  --max_inflight_bytes=-1
# The process's own address-space limit binds too: under ulimit -v 300 MiB nothing is left once
# the process has its 256 MiB, where planned from physical memory the budgets let large calls
# fail malloc and end the process. (Not under a sanitizer, whose shadow memory needs terabytes
# of address space; ldd's output taken whole, as pipefail would fail `ldd | grep -q` on
# SIGPIPE.)
if [[ $(ldd "${attnserve}") == *lib[at]san* ]]; then
  echo "skipped: ulimit -v under a sanitizer build"
else
  attnserve_prefix=(bash -c 'ulimit -v "$0" && exec "$@"' $((300 << 10)))
  expected_status=2 expect_start_failure \
    "memory budgets do not fit the memory limit: .* bytes of RLIMIT_AS \(ulimit -v\)"
  # A small limit plans small budgets (the buffer pool among them) and starts, saying that a
  # message of --max_message_bytes cannot fit one connection's share (until 2026-12-06 every
  # limit up to 1 GiB was refused: a fixed 256 MiB pool, weights and KV cache a quarter each of
  # the whole limit).
  attnserve_prefix=(bash -c 'ulimit -v "$0" && exec "$@"' $((768 << 10)))
  start_attnserve "${attnserve}" --drain_grace_seconds=0
  grep -q "attnserve: warning: one connection may hold [0-9]* bytes of calls in flight .* less \
than a message of max_message_bytes 67108864" "${workdir}/server.log" ||
    fail "no warning of a message too large for the budget: $(cat "${workdir}/server.log")"
  pool=$(sed -n 's/.* buffer_pool_bytes=\([0-9]*\) .*/\1/p' "${workdir}/server.log")
  [[ -n ${pool} && ${pool} -gt 0 && ${pool} -lt $((96 << 20)) ]] ||
    fail "the buffer pool not derived from ulimit -v 768 MiB: $(cat "${workdir}/server.log")"
  stop_attnserve
  # With room, the budgets are planned from it.
  attnserve_prefix=(bash -c 'ulimit -v "$0" && exec "$@"' $((2 << 20)))
  start_attnserve "${attnserve}" --drain_grace_seconds=0
  # Less what the process has mapped but not touched (thread stacks, arenas).
  limit=$(sed -n 's/.* of a memory limit of \([0-9]*\) (RLIMIT_AS (ulimit -v)).*/\1/p' \
    "${workdir}/server.log")
  [[ -n ${limit} && ${limit} -lt $((2 << 30)) && ${limit} -gt $((1 << 30)) ]] ||
    fail "budgets not planned from ulimit -v 2 GiB: $(cat "${workdir}/server.log")"
  stop_attnserve
  attnserve_prefix=()
fi
# The budget's share for calls in flight is said at start-up.
start_attnserve "${attnserve}" --max_inflight_bytes=$((64 << 20)) --drain_grace_seconds=0
grep -q "max_inflight_bytes=67108864 (16777216 for gRPC's buffers) of a memory limit of" \
  "${workdir}/server.log" || fail "no budget in the start-up line: $(cat "${workdir}/server.log")"
stop_attnserve
# gRPC's quota (a quarter of the budget) under four of the largest messages is warned of: one
# client sending a few at once had gRPC reset or close other clients' calls (an audit, 2026-12-07).
start_attnserve "${attnserve}" --max_inflight_bytes=$((64 << 20)) --max_message_bytes=$((8 << 20)) \
  --drain_grace_seconds=0
grep -q "attnserve: warning: gRPC's transport buffers may hold 16777216 bytes (a quarter of \
max_inflight_bytes 67108864), fewer than 4 messages of max_message_bytes 8388608" \
  "${workdir}/server.log" || fail "no warning of a small quota: $(cat "${workdir}/server.log")"
stop_attnserve
start_attnserve "${attnserve}" --max_inflight_bytes=$((64 << 20)) --max_message_bytes=$((4 << 20)) \
  --drain_grace_seconds=0
! grep -q "attnserve: warning" "${workdir}/server.log" ||
  fail "a warning with room for four messages: $(cat "${workdir}/server.log")"
stop_attnserve
echo "PASS"
