#!/usr/bin/env bash
# The Kubernetes manifests (deploy/k8s): renders every kustomization with `kubectl kustomize`,
# validates each rendering with k8s_manifests_test.js (the Kubernetes API schemas, the
# deployment's invariants, and mutations that each invariant must catch), with the
# prometheus-adapter config beside a kustomization (prometheus-adapter-config.yaml) and
# attnserve's metrics (docs/metrics.md) for an HPA on Pods metrics; checks the adapter's queries
# with `promtool check rules`; then starts the real attnserve with each rendering's flag file (on
# loopback; --address, ports and memory budgets overridden) to prove the ConfigMap's flags
# parse. KServe's (deploy/kserve) likewise, with kserve_manifests_test.js, its runtime's
# container args as the flag file.
#
# The validator's npm packages (package.json, package-lock.json) are installed with `npm ci`
# into NODE_DIR when missing or when the lock file changed.
#
# usage: k8s_manifests_test.sh REPO_ROOT NODE_DIR ATTNSERVE
set -euo pipefail

root=$1
node_dir=$2
attnserve=$3
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
  exit 1
}

for tool in kubectl node npm; do
  command -v "${tool}" >/dev/null ||
    fail "${tool} is missing (kubectl, and node with npm, come with the machine image)"
done
echo "kubectl $(kubectl version --client -o yaml | sed -n 's/^ *gitVersion: //p' | head -1)," \
  "node $(node --version)"

mkdir -p "${node_dir}"
if [[ ! -d ${node_dir}/node_modules ]] ||
   ! cmp -s "${root}/tests/deploy/package-lock.json" "${node_dir}/package-lock.json"; then
  cp "${root}/tests/deploy/package.json" "${root}/tests/deploy/package-lock.json" "${node_dir}/"
  echo "npm ci in ${node_dir}"
  (cd "${node_dir}" && timeout 600 npm ci --no-audit --no-fund --loglevel=error) ||
    fail "npm ci failed"
fi

mapfile -t kustomizations < <(find "${root}/deploy/k8s" -name kustomization.yaml \
  -exec dirname {} \; | sort)
((${#kustomizations[@]} >= 2)) || fail "expected base and overlays under deploy/k8s"
for dir in "${kustomizations[@]}"; do
  name=${dir#"${root}/deploy/k8s/"}
  name=${name//\//-}
  timeout 60 kubectl kustomize "${dir}" >"${workdir}/${name}.yaml" ||
    fail "kubectl kustomize ${dir} failed"
  echo "rendered ${dir#"${root}/"}: $(grep -c '^kind:' "${workdir}/${name}.yaml") objects"
  # The adapter's rules are not part of the kustomization (they go to the adapter's namespace).
  if [[ -f ${dir}/prometheus-adapter-config.yaml ]]; then
    cp "${dir}/prometheus-adapter-config.yaml" "${workdir}/${name}.adapter-config"
  fi
done

NODE_PATH="${node_dir}/node_modules" timeout 120 \
  node "${root}/tests/deploy/k8s_manifests_test.js" "${root}/Dockerfile" \
  "${root}/docs/metrics.md" "${workdir}"/*.yaml || fail "manifest checks failed"

# prometheus-adapter's queries, their templates filled in for two pods, must be PromQL.
for queries in "${workdir}"/*.adapter-queries.yml; do
  [[ -e ${queries} ]] || continue
  command -v promtool >/dev/null ||
    fail "promtool is missing (it checks the prometheus-adapter queries)"
  promtool check rules "${queries}" >"${queries}.log" 2>&1 ||
    fail "promtool check rules ${queries##*/}: $(cat "${queries}.log")"
  echo "promtool check rules: the prometheus-adapter queries of ${queries##*/} parse"
done

# KServe's runtime and InferenceService (deploy/kserve): their own checks, and the runtime's
# container args join the flag files below.
timeout 60 kubectl kustomize "${root}/deploy/kserve" >"${workdir}/kserve.yaml" ||
  fail "kubectl kustomize deploy/kserve failed"
NODE_PATH="${node_dir}/node_modules" timeout 120 \
  node "${root}/tests/deploy/kserve_manifests_test.js" "${root}/Dockerfile" \
  "${workdir}/kserve.yaml" || fail "KServe manifest checks failed"

# The flags as attnserve reads them: later flags override the flag file's, so the server
# listens on loopback only, on a free port, without metrics, stops without a drain grace,
# reads an empty weights folder (the pods' volume is not here), and takes small memory budgets:
# a pod's (up to 22.75 GiB) need not fit this machine, and k8s_manifests_test.js has checked
# them against the container's limit.
mkdir -p "${workdir}/weights"
for flags in "${workdir}"/*.flags; do
  log=${flags%.flags}.server.log
  "${attnserve}" --flagfile="${flags}" --address=127.0.0.1 --port=0 --metrics_port=0 \
    --drain_grace_seconds=0 --weights_dir="${workdir}/weights" \
    --max_weights_bytes=67108864 --kv_cache_bytes=67108864 --buffer_pool_bytes=16777216 \
    --max_inflight_bytes=268435456 >"${log}" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 100); do
    grep -q "^attnserve .* listening on 127\.0\.0\.1:" "${log}" && break
    kill -0 "${server_pid}" 2>/dev/null || fail "attnserve rejects ${flags##*/}: $(cat "${log}")"
    sleep 0.1
  done
  grep -q "listening on" "${log}" || fail "attnserve did not start within 10 s with ${flags##*/}"
  kill -TERM "${server_pid}"
  set +e
  timeout 40 tail --pid="${server_pid}" -f /dev/null
  wait "${server_pid}"
  status=$?
  set -e
  server_pid=""
  [[ ${status} -eq 0 ]] || fail "attnserve exited ${status} after SIGTERM"
  echo "attnserve accepts the flags of ${flags##*/}: $(head -1 "${log}" | cut -c1-150)..."
done
echo "PASS"
