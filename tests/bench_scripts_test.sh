#!/usr/bin/env bash
# The benchmark scripts BENCHMARKS.md quotes still run against the built binaries and print
# what it quotes, in a few seconds each (the figures themselves are not checked: this host is
# shared and noisy). A server with --max_batch=1 must report batches of exactly one.
#
# usage: bench_scripts_test.sh SOURCE_DIR ATTNSERVE ATTNCTL [ATTENTION_BENCH]
# (without ATTENTION_BENCH, a build without the benchmarks, kernel_turns.sh is skipped, saying so)
set -euo pipefail
source_dir=$1
attnserve=$2
export ATTNCTL=$3
attention_bench=${4:-}

fail() { echo "FAIL: $*" >&2; exit 1; }

out=$(timeout 120 "${source_dir}/bench/batching_throughput.sh" --rounds=1 --duration=1s \
  --clients=8 --max_batch=1,4 --attnserve="${attnserve}") || fail "batching_throughput.sh: $out"
echo "${out}"
grep -qE '^\| 1 \| [0-9,]+ \([0-9,]+-[0-9,]+\) \| [0-9]+ \| [0-9]+ \| 1\.00 \|$' <<<"${out}" ||
  fail "batching_throughput.sh: no max_batch 1 row with a mean batch of 1.00"
grep -qE '^\| 4 \| [0-9,]+ \([0-9,]+-[0-9,]+\) \| [0-9]+ \| [0-9]+ \| [0-9.]+ \|$' <<<"${out}" ||
  fail "batching_throughput.sh: no max_batch 4 row"
grep -qE '^max_batch 4 / max_batch 1: [0-9.]+x$' <<<"${out}" ||
  fail "batching_throughput.sh: no ratio line"
grep -qF '8 clients, (B, H, Hkv, Lq, Lk, D) = (1, 8, 8, 128, 128, 64), 1 rounds' <<<"${out}" ||
  fail "batching_throughput.sh: no header naming the default shape"
# Another shape: a few query rows over long keys, which the kernel splits by keys.
out=$(timeout 120 "${source_dir}/bench/batching_throughput.sh" --rounds=1 --duration=1s \
  --clients=4 --max_batch=1,4 --shape=1,2,2,8,1024,64 --attnserve="${attnserve}") ||
  fail "batching_throughput.sh --shape: $out"
echo "${out}"
grep -qF '4 clients, (B, H, Hkv, Lq, Lk, D) = (1, 2, 2, 8, 1024, 64), 1 rounds' <<<"${out}" ||
  fail "batching_throughput.sh --shape: no header naming the shape"
grep -qE '^\| 4 \| [0-9,]+ \([0-9,]+-[0-9,]+\) \| [0-9]+ \| [0-9]+ \| [0-9.]+ \|$' <<<"${out}" ||
  fail "batching_throughput.sh --shape: no max_batch 4 row"
if out=$("${source_dir}/bench/batching_throughput.sh" --shape=1,2,3 2>&1); then
  fail "batching_throughput.sh --shape=1,2,3 succeeded: $out"
fi
grep -qF "expected six sizes B,H,Hkv,Lq,Lk,D, got '1,2,3'" <<<"${out}" ||
  fail "batching_throughput.sh --shape=1,2,3: $out"

out=$(timeout 120 "${source_dir}/bench/loopback_latency.sh" --rounds=1 --requests=100 \
  "${attnserve}") || fail "loopback_latency.sh: $out"
echo "${out}"
grep -qE '^.*attnserve: p50 median [0-9]+ us \(rounds [0-9]+\); server CPU [0-9]+ us/call, [0-9.]+ context switches/call$' \
  <<<"${out}" || fail "loopback_latency.sh: no p50 line"
# kernel_turns.sh on a small shape and a small paged decode: a ratio per benchmark (to the
# GEMM, or to the streaming read), for each of two binaries.
if [[ -z "${attention_bench}" ]]; then
  echo "kernel_turns.sh: skipped, the benchmarks are not built (ATTNSERVE_BUILD_BENCHMARKS=OFF)"
  echo "PASS"
  exit 0
fi
out=$(timeout 200 "${source_dir}/bench/kernel_turns.sh" --rounds=2 \
  --filter='Attention/B:4/H:8/Hkv:8/Lq:512/Lk:512/D:64/causal:0/bf16:0/unfused:0|PagedDecode/S:1/.*/T:1' \
  "${attention_bench}" "${attention_bench}") || fail "kernel_turns.sh: $out"
echo "${out}"
[[ $(grep -cE '^\| .*attention_bench \| BM_Attention/B:4/H:8/.* \| [0-9.]+ \| [0-9.]+ \([0-9.]+-[0-9.]+\) \|$' \
  <<<"${out}") == 2 ]] || fail "kernel_turns.sh: not one ratio row per binary"
[[ $(grep -cE '^\| .*attention_bench \| BM_PagedDecode/S:1/.* \| [0-9.]+ \| [0-9.]+ \([0-9.]+-[0-9.]+\) \|$' \
  <<<"${out}") == 2 ]] || fail "kernel_turns.sh: not one read-ratio row per binary"
echo "PASS"
