#!/usr/bin/env bash
# scripts/container-entrypoint, the image's entrypoint, against fake cgroup trees: the OpenMP
# thread count it derives from cgroup v2 and v1 CPU quotas (own cgroup, tightest ancestor, none,
# fractional), capped at nproc; OMP_NUM_THREADS kept when set; arguments passed through as
# they are; and exec, so that the server is the process that gets SIGTERM.
#
# usage: container_entrypoint_test.sh REPO_ROOT
set -euo pipefail

entrypoint=$1/scripts/container-entrypoint
workdir=$(mktemp -d)
trap 'rm -rf "${workdir}"' EXIT
cpus=$(nproc)
failures=0

# A stand-in for attnserve: prints its pid, OMP_NUM_THREADS, then each argument on a line.
stub=${workdir}/attnserve
cat >"${stub}" <<'STUB'
#!/usr/bin/env bash
echo "pid=$$"
echo "threads=${OMP_NUM_THREADS}"
printf 'arg=%s\n' "$@"
STUB
chmod +x "${stub}"

min() { echo $(($1 < $2 ? $1 : $2)); }

# check NAME EXPECTED_THREADS CGROUP_ROOT PROC_CGROUP_TEXT [VAR=VALUE...]
check() {
  local name=$1 expected=$2 root=$3 proc_text=$4
  shift 4
  printf '%s\n' "${proc_text}" >"${workdir}/proc-cgroup"
  local output
  output=$(env -u OMP_NUM_THREADS "$@" ATTNSERVE_ENTRYPOINT_CGROUP_ROOT="${root}" \
    ATTNSERVE_ENTRYPOINT_PROC_CGROUP="${workdir}/proc-cgroup" \
    ATTNSERVE_ENTRYPOINT_BINARY="${stub}" "${entrypoint}" 2>"${workdir}/stderr")
  if grep -qx "threads=${expected}" <<<"${output}"; then
    echo "ok   ${name}: $(cat "${workdir}/stderr")"
  else
    echo "FAIL ${name}: expected ${expected} threads, got $(grep threads= <<<"${output}")" \
      "($(cat "${workdir}/stderr"))"
    failures=$((failures + 1))
  fi
}

# A cgroup v2 tree: $1 root; then PATH=CPU_MAX pairs.
make_v2() {
  local root=$1
  shift
  mkdir -p "${root}"
  echo "cpuset cpu memory" >"${root}/cgroup.controllers"
  local entry
  for entry in "$@"; do
    mkdir -p "${root}${entry%%=*}"
    echo "${entry#*=}" >"${root}${entry%%=*}/cpu.max"
  done
}

# A cgroup v1 cpu hierarchy mounted at $1/$2; then PATH=QUOTA/PERIOD pairs.
make_v1() {
  local mount=$1/$2
  shift 2
  mkdir -p "${mount}"
  echo -1 >"${mount}/cpu.cfs_quota_us"
  echo 100000 >"${mount}/cpu.cfs_period_us"
  local entry value
  for entry in "$@"; do
    value=${entry#*=}
    mkdir -p "${mount}${entry%%=*}"
    echo "${value%/*}" >"${mount}${entry%%=*}/cpu.cfs_quota_us"
    echo "${value#*/}" >"${mount}${entry%%=*}/cpu.cfs_period_us"
  done
}

# cgroup v2, namespaced (the container's cgroup is the root, as in Kubernetes and Docker).
make_v2 "${workdir}/v2ns" "=300000 100000"
check "v2 namespaced, 3 CPUs" "$(min 3 "${cpus}")" "${workdir}/v2ns" "0::/"
make_v2 "${workdir}/v2one" "=100000 100000"
check "v2 namespaced, 1 CPU" 1 "${workdir}/v2one" "0::/"
make_v2 "${workdir}/v2half" "=50000 100000"
check "v2 half a CPU gives the minimum, 1" 1 "${workdir}/v2half" "0::/"
make_v2 "${workdir}/v2frac" "=150000 100000"
check "v2 1.5 CPUs round down to 1" 1 "${workdir}/v2frac" "0::/"
make_v2 "${workdir}/v2many" "=6400000 100000"
check "v2 64 CPUs are capped at nproc" "${cpus}" "${workdir}/v2many" "0::/"
make_v2 "${workdir}/v2max" "=max 100000"
check "v2 without a quota uses nproc" "${cpus}" "${workdir}/v2max" "0::/"
# Not namespaced: the process's own cgroup and the tightest of its ancestors.
make_v2 "${workdir}/v2tree" "=max 100000" "/kubepods=max 100000" \
  "/kubepods/pod1=100000 100000" "/kubepods/pod1/ctr=200000 100000"
check "v2 tightest ancestor (pod 1 CPU, container 2)" 1 "${workdir}/v2tree" \
  "0::/kubepods/pod1/ctr"
make_v2 "${workdir}/v2own" "=max 100000" "/a=max 100000" "/a/b=100000 50000"
check "v2 own cgroup, 2 CPUs" "$(min 2 "${cpus}")" "${workdir}/v2own" "0::/a/b"
check "v2 cgroup path missing here: the mount's root" "${cpus}" "${workdir}/v2own" \
  "0::/elsewhere/x"

# cgroup v1, as on this project's CI machines and in Docker on v1 hosts.
make_v1 "${workdir}/v1" "cpu,cpuacct" "/docker/abc=100000/100000"
check "v1 cpu,cpuacct, own cgroup 1 CPU" 1 "${workdir}/v1" \
  "$(printf '4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/')"
make_v1 "${workdir}/v1ns" "cpu" "=200000/100000"
check "v1 container mount, 2 CPUs" "$(min 2 "${cpus}")" "${workdir}/v1ns" \
  "3:cpu,cpuacct:/docker/not-visible-here"
make_v1 "${workdir}/v1none" "cpu"
check "v1 quota -1 uses nproc" "${cpus}" "${workdir}/v1none" "3:cpu,cpuacct:/"
check "no cgroup file system uses nproc" "${cpus}" "${workdir}/nothing" ""

check "OMP_NUM_THREADS set is kept" 7 "${workdir}/v2one" "0::/" OMP_NUM_THREADS=7

# Arguments pass through unchanged, and the entrypoint execs (same pid, so signals reach it).
ATTNSERVE_ENTRYPOINT_BINARY="${stub}" OMP_NUM_THREADS=3 \
  "${entrypoint}" --port=1 "two words" "" '--x=$HOME' >"${workdir}/exec.out" 2>/dev/null &
entry_pid=$!
wait "${entry_pid}"
expected_output=$(printf 'pid=%s\nthreads=3\narg=--port=1\narg=two words\narg=\narg=--x=$HOME' \
  "${entry_pid}")
if [[ $(cat "${workdir}/exec.out") == "${expected_output}" ]]; then
  echo "ok   exec and arguments"
else
  echo "FAIL exec and arguments: got"
  cat "${workdir}/exec.out"
  echo "expected"
  echo "${expected_output}"
  failures=$((failures + 1))
fi

if ((failures > 0)); then
  echo "FAIL: ${failures} case(s)"
  exit 1
fi
echo "PASS"
