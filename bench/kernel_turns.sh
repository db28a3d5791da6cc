#!/usr/bin/env bash
# The fused kernel against the same run's oneDNN GEMM, measured in turns: each round runs the
# GEMMs and the kernel shapes back to back in one attention_bench process (for every binary
# given, alternating, to compare two builds), and the table reports, per binary and shape, the
# median over rounds of kernel rate / that round's GEMM rate at the same precision (one
# repetition of each per round). A host whose
# GEMM rate jumps between runs (AMX bf16 does) then compares each kernel figure with the ceiling
# of the same minute, not of another. Benchmarks that count bytes (decode: BM_DecodeInputs,
# BM_PagedDecode) are reported as GB/s against the same round's streaming read instead.
#
#   bench/kernel_turns.sh --rounds=4 --filter=PagedDecode   # paged decode against the read
#
# usage: bench/kernel_turns.sh [--rounds=N] [--filter=REGEX] [ATTENTION_BENCH...]
#   --rounds   rounds of turns (default 7)
#   --filter   the kernel benchmarks (default: the non-causal prefill shapes of issue #21)
#   ATTENTION_BENCH  binaries to compare (default build/bench/attention_bench)
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=7
filter='Attention/B:1/H:16/Hkv:16/Lq:2048/Lk:2048/D:64/causal:0/bf16:./unfused:0|Attention/B:1/H:32/Hkv:8/Lq:2048/Lk:2048/D:128/causal:0/bf16:./unfused:0'
binaries=()
for arg in "$@"; do
  case "${arg}" in
    --rounds=*) rounds=${arg#--rounds=} ;;
    --filter=*) filter=${arg#--filter=} ;;
    -*) echo "unknown option ${arg}" >&2; exit 2 ;;
    *) binaries+=("${arg}") ;;
  esac
done
[[ ${#binaries[@]} -gt 0 ]] || binaries=(build/bench/attention_bench)
[[ ${rounds} =~ ^[1-9][0-9]*$ ]] || { echo "--rounds must be a positive integer" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT
for ((round = 0; round < rounds; ++round)); do
  for i in "${!binaries[@]}"; do
    timeout 300 "${binaries[$i]}" --benchmark_filter="OneDnnGemm|StreamRead|${filter}" --benchmark_repetitions=1 \
      --benchmark_format=json --benchmark_out="${work}/${i}.${round}.json" \
      --benchmark_out_format=json >/dev/null 2>&1
  done
done

python3 - "${work}" "${rounds}" "${binaries[@]}" <<'EOF'
import json, os, statistics, sys

work, rounds, binaries = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
with open("/proc/cpuinfo") as f:
    cpuinfo = f.read()
model = next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines()
              if l.startswith("model name")), "unknown CPU")
flags = next((l for l in cpuinfo.splitlines() if l.startswith("flags")), "")
print(f"CPU: {model}{', AMX' if 'amx_bf16' in flags else ''}"
      f"{', AVX-512' if 'avx512f' in flags else ''}; {rounds} rounds")
print("| binary | benchmark | GFLOP/s (median) | / same-round GEMM (median, min-max) |")
print("|---|---|---:|---:|")
reads = []  # Rows of the byte-rate table, printed after this one.
for i, binary in enumerate(binaries):
    rates, ratios, labels = {}, {}, {}
    byte_rates, read_ratios = {}, {}
    for r in range(rounds):
        with open(os.path.join(work, f"{i}.{r}.json")) as f:
            runs = json.load(f)["benchmarks"]
        # Each round's figure: the median of its repetitions (or its one run).
        medians = [b for b in runs if b.get("aggregate_name") == "median"] or \
            [b for b in runs if b.get("run_type") == "iteration"]
        reading = ("BM_StreamRead", "BM_DecodeInputs/", "BM_PagedDecode/")
        flops = {b["run_name"].split("/real_time")[0]: b.get("FLOPS", 0.0) for b in medians
                 if not b["run_name"].startswith(reading)}
        byte_counts = {b["run_name"].split("/real_time")[0]: b.get("BYTES", 0.0)
                       for b in medians if b["run_name"].startswith(reading)}
        stream = next((v for k, v in byte_counts.items() if "StreamRead" in k), 0.0)
        for name, value in byte_counts.items():
            if "StreamRead" in name:
                continue
            byte_rates.setdefault(name, []).append(value)
            if stream > 0:
                read_ratios.setdefault(name, []).append(value / stream)
        for b in medians:
            labels.setdefault(b["run_name"].split("/real_time")[0], b.get("label", ""))
        gemm = {"f32": next((v for k, v in flops.items() if "GemmF32" in k), 0.0),
                "bf16": next((v for k, v in flops.items() if "GemmBF16" in k), 0.0)}
        for name, value in flops.items():
            rates.setdefault(name, []).append(value)
            if "Gemm" in name:
                continue
            ceiling = gemm["bf16"] if "/bf16:1" in name and gemm["bf16"] > 0 else gemm["f32"]
            if ceiling > 0:
                ratios.setdefault(name, []).append(value / ceiling)
    for name in sorted(rates):
        rate = statistics.median(rates[name]) / 1e9
        label = f" ({labels[name]})" if labels.get(name) else ""
        if name in ratios:
            rs = ratios[name]
            ratio = f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})"
        else:
            ratio = ""
        print(f"| {os.path.basename(binary) if len(binaries) == 1 else binary} | "
              f"{name}{label} | {rate:.1f} | {ratio} |")
    for name in sorted(byte_rates):
        rs = read_ratios.get(name, [])
        ratio = f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})" if rs else ""
        reads.append(f"| {os.path.basename(binary) if len(binaries) == 1 else binary} | "
                     f"{name} | {statistics.median(byte_rates[name]) / 1e9:.1f} | {ratio} |")
if reads:
    print()
    print("| binary | benchmark | GB/s (median) | / same-round streaming read (median, min-max) |")
    print("|---|---|---:|---:|")
    print("\n".join(reads))
EOF
