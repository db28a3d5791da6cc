// Validates rendered kustomizations of deploy/k8s (k8s_manifests_test.sh renders them):
//   1. every object against its Kubernetes API schema (kubernetes-models: core, apps,
//      autoscaling, policy, networking; @kubernetes-models/prometheus-operator: ServiceMonitor);
//   2. the invariants the deployment depends on (INVARIANTS below): probes and ports agree with
//      the flags in the ConfigMap, the grace period outlasts preStop plus the server's drain,
//      the pod is non-root with a read-only root and no privileges, resources are set and hold
//      the flags' memory budgets, and Services, HPA, PDB, NetworkPolicy and ServiceMonitor all
//      point at the Deployment's pods and ports; where the HPA scales on Pods metrics (the
//      sessions profile), the prometheus-adapter config that comes with the rendering defines
//      each of them from metrics attnserve exports (docs/metrics.md), and rollouts and
//      scale-down take one pod at a time;
//   3. that each invariant catches what it guards: MUTATIONS break a valid rendering one way
//      each, and the named invariant must fail.
// Writes each rendering's flag file (the ConfigMap's) beside it as NAME.flags, for the shell
// test to start attnserve with, and the adapter's queries with their templates filled in as
// NAME.adapter-queries.yml, a Prometheus rules file for promtool. Exits 1 on any failure.
//
// A rendering NAME.yaml may come with NAME.adapter-config: the prometheus-adapter ConfigMap
// (prometheus-adapter-config.yaml beside the kustomization, which does not include it).
//
// usage: NODE_PATH=.../node_modules node k8s_manifests_test.js DOCKERFILE METRICS_MD \
//            RENDERED.yaml...
"use strict";

const fs = require("fs");
const path = require("path");
const YAML = require("yaml");

const MODEL_MODULES = {
  "v1": "kubernetes-models/v1",
  "apps/v1": "kubernetes-models/apps/v1",
  "autoscaling/v2": "kubernetes-models/autoscaling/v2",
  "policy/v1": "kubernetes-models/policy/v1",
  "networking.k8s.io/v1": "kubernetes-models/networking.k8s.io/v1",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
};

// After SIGTERM attnserve keeps taking calls for --drain_grace_seconds, then lets work in
// flight finish for at most 30 s (kShutdownGrace in server/process/server.cc), then gRPC's own
// shutdown for at most about 7 s more (server.cc: 0.1-1 s settling, 0.2 s of held refusals, up
// to 5 s for gRPC to stop taking calls, 0.1 s for its GOAWAY), and exits.
const IN_FLIGHT_GRACE_SECONDS = 37;
// attnserve's flag defaults (server/process/flags.cc: ServerOptions' own, but for --metrics_port
// and --drain_grace_seconds), for flags the flag file leaves out.
const FLAG_DEFAULTS = {
  address: "0.0.0.0",
  port: "50051",
  metrics_port: "9464",
  executors: "1",
  max_batch: "1",
  max_queue: "1024",
  max_message_bytes: String(64 * 2 ** 20),
  max_request_memory_bytes: String(4 * 2 ** 30),
  max_weights_bytes: "0",
  max_inflight_bytes: "0",
  kv_cache_bytes: "0",
  buffer_pool_bytes: "-1",
  max_connections: "0",
  drain_grace_seconds: "5",
  demo_weights: "true",
};
// Memory a replica needs beyond its flags' budgets: code, oneDNN and gRPC state
// (kProcessOverheadBytes in server/include/attnserve/server/process/memory_plan.h).
const BASE_MEMORY_BYTES = 256 * 2 ** 20;
// What the memory plan counts for each connection --max_connections allows (kConnectionBytes).
const CONNECTION_BYTES = 32 * 2 ** 10;
const WILDCARD_ADDRESSES = ["0.0.0.0", "::", "[::]"];
// A sessions profile (an HPA on Pods metrics) removes a pod only after load stayed low this
// long: each removal drops the pod's sessions, which their clients rebuild elsewhere.
const MIN_SESSIONS_SCALE_DOWN_WINDOW_SECONDS = 600;
// Labels a scrape adds to attnserve's own (the ServiceMonitor's target labels), which adapter
// queries may match on.
const TARGET_LABELS = ["namespace", "pod", "job", "instance", "service", "container", "endpoint"];
// The templates prometheus-adapter fills in a rule's metricsQuery.
const ADAPTER_TEMPLATES = ["<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"];

// --- Helpers

function schemaErrors(object) {
  const modulePath = MODEL_MODULES[object.apiVersion];
  const Model = modulePath && require(modulePath)[object.kind];
  if (!Model) return [`no schema for ${object.apiVersion} ${object.kind}`];
  try {
    new Model(object).validate();
    return [];
  } catch (error) {
    return [`${object.kind}/${object.metadata && object.metadata.name}: ${error.message}`];
  }
}

// Kubernetes quantity ("2", "500m", "2Gi", "1G") to a number (CPUs or bytes).
function quantity(value) {
  const match = /^([0-9.]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$/.exec(String(value));
  if (!match) throw new Error(`not a quantity: ${value}`);
  const scale = {
    m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, E: 1e18,
    Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50, Ei: 2 ** 60,
  };
  return Number(match[1]) * (match[2] ? scale[match[2]] : 1);
}

function labelsMatch(selector, labels) {
  return Object.entries(selector || {}).every(([key, value]) => (labels || {})[key] === value);
}

// The attnserve flags the container runs with: args in order, --flagfile expanded in place
// from the ConfigMap mounted at its folder (as absl does), over attnserve's defaults.
function containerFlags(pod, container, configMaps) {
  const flags = { ...FLAG_DEFAULTS };
  let flagFileText = null;
  const apply = (argument) => {
    const match = /^--?([a-z_]+)=(.*)$/.exec(argument.trim());
    if (!match) throw new Error(`cannot read flag '${argument}'`);
    if (match[1] !== "flagfile") {
      flags[match[1]] = match[2];
      return;
    }
    const file = match[2];
    const mount = (container.volumeMounts || []).find((m) => m.mountPath === path.dirname(file));
    const volume = mount && (pod.volumes || []).find((v) => v.name === mount.name);
    const configMap = volume && volume.configMap &&
        configMaps.find((c) => c.metadata.name === volume.configMap.name);
    const text = configMap && configMap.data && configMap.data[path.basename(file)];
    if (text === undefined) throw new Error(`${file} is not a key of a mounted ConfigMap`);
    flagFileText = text;
    for (const line of text.split("\n")) {
      if (line.trim() !== "" && !line.trim().startsWith("#")) apply(line);
    }
  };
  for (const argument of container.args || []) apply(argument);
  return { flags, flagFileText };
}

function preStopSeconds(container) {
  const preStop = container.lifecycle && container.lifecycle.preStop;
  if (!preStop) return 0;
  if (preStop.sleep) return Number(preStop.sleep.seconds);
  const command = (preStop.exec && preStop.exec.command) || [];
  if (command.length === 2 && /(^|\/)sleep$/.test(command[0])) return Number(command[1]);
  throw new Error(`cannot tell how long preStop ${JSON.stringify(preStop)} takes`);
}

// A Service or NetworkPolicy port (name or number) to the container port it reaches.
function containerPort(container, port) {
  const found = (container.ports || []).find((p) => p.name === port || p.containerPort === port);
  return found ? found.containerPort : undefined;
}

// The series attnserve exports, from docs/metrics.md's table: series name -> { metric, type,
// labels }. A histogram is NAME_bucket (with le), NAME_sum and NAME_count.
function exportedSeries(markdown) {
  const series = new Map();
  for (const line of markdown.split("\n")) {
    const row = /^\| `(attnserve_[a-z0-9_]+)` \| ([a-z]+)[^|]* \| ([^|]*) \|/.exec(line);
    if (!row) continue;
    const [, metric, type, labelCell] = row;
    // "`rpc` (compute RPCs: ...)", "`change` (`registered`, ...)": the names outside brackets.
    const labels = [...labelCell.replace(/\([^)]*\)/g, "").matchAll(/`([a-z_]+)`/g)]
      .map((match) => match[1]);
    if (type === "histogram") {
      series.set(`${metric}_bucket`, { metric, type, labels: labels.concat("le") });
      series.set(`${metric}_sum`, { metric, type, labels });
      series.set(`${metric}_count`, { metric, type, labels });
    } else {
      series.set(metric, { metric, type, labels });
    }
  }
  return series;
}

// A PromQL series selector, NAME{label="value",...} or {__name__="NAME",...}: { name, matchers }
// (name undefined when it names none), or null when it is not one.
function parseSelector(text) {
  const match = /^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*(?:\{([^{}]*)\})?\s*$/.exec(String(text));
  if (!match || (!match[1] && match[2] === undefined)) return null;
  const matchers = parseMatchers(match[2] || "");
  if (!matchers) return null;
  const named = matchers.find((m) => m.label === "__name__" && m.op === "=");
  return { name: match[1] || (named && named.value), matchers };
}

// label="value", label!~"regex", ...: a list of { label, op, value }, or null.
function parseMatchers(text) {
  const body = text.trim().replace(/,$/, "");
  const matcher = new RegExp(String.raw`\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*` +
                             String.raw`("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')\s*(?:,|$)`, "y");
  const matchers = [];
  while (matcher.lastIndex < body.length) {
    const found = matcher.exec(body);
    if (!found) return null;
    matchers.push({ label: found[1], op: found[2], value: found[3].slice(1, -1) });
  }
  return matchers;
}

// The selectors of attnserve series in a metricsQuery: { name, braces } for each
// `attnserve_x{...}` or `<<.Series>>{...}` (braces null when it has none).
function querySelectors(query) {
  return [...String(query).matchAll(
    /(?<![A-Za-z0-9_:])(attnserve_[A-Za-z0-9_:]*|<<\.Series>>)\s*(\{([^{}]*)\})?/g)]
    .map((match) => ({ name: match[1], braces: match[2] === undefined ? null : match[3] }));
}

// The prometheus-adapter rules of the ConfigMap (data["config.yaml"], `rules:`): { rules } or
// { error }.
function adapterRules(configMap) {
  const text = configMap && configMap.data && configMap.data["config.yaml"];
  if (configMap.kind !== "ConfigMap" || typeof text !== "string") {
    return { error: "the prometheus-adapter config is not a ConfigMap with a config.yaml key" };
  }
  let config;
  try {
    config = YAML.parse(text);
  } catch (error) {
    return { error: `config.yaml: ${error.message}` };
  }
  const rules = config && config.rules;
  return Array.isArray(rules) && rules.length > 0 ? { rules } :
    { error: "config.yaml has no `rules:` list" };
}

// The metrics an HPA takes per pod from the custom metrics API: [{ name, target }].
function podsMetrics(hpa) {
  return ((hpa && hpa.spec.metrics) || []).filter((m) => m.type === "Pods" && m.pods)
    .map((m) => ({ name: m.pods.metric && m.pods.metric.name, target: m.pods.target || {} }));
}

// --- The rendering, indexed

function index({ objects, adapter }, { dockerUid, exported }) {
  const ofKind = (kind) => objects.filter((o) => o.kind === kind);
  const hpa = ofKind("HorizontalPodAutoscaler")[0];
  const deployment = ofKind("Deployment")[0];
  const pod = deployment && deployment.spec.template.spec;
  const container = pod && pod.containers.find((c) => c.name === "attnserve");
  const services = ofKind("Service");
  return {
    objects, adapter, exported, ofKind, deployment, pod, container, services, dockerUid,
    podLabels: deployment && deployment.spec.template.metadata.labels,
    headless: services.filter((s) => s.spec.clusterIP === "None"),
    clusterIp: services.filter((s) => s.spec.clusterIP !== "None"),
    hpa,
    // Pods metrics (KV-cache use, queue wait) mark a sessions profile.
    podsMetrics: podsMetrics(hpa),
    pdb: ofKind("PodDisruptionBudget")[0],
    networkPolicy: ofKind("NetworkPolicy")[0],
    serviceMonitor: ofKind("ServiceMonitor")[0],
    namespace: ofKind("Namespace")[0],
    flags: () => containerFlags(pod, container, ofKind("ConfigMap")).flags,
  };
}

// --- Invariants: [name, function(rendering) -> list of failures]

const INVARIANTS = [
  ["objects match the Kubernetes API schemas",
    (r) => r.objects.concat(r.adapter ? [r.adapter] : []).flatMap(schemaErrors)],

  ["one of each object, two Services", (r) => {
    const expected = {
      Deployment: 1, Service: 2, HorizontalPodAutoscaler: 1, PodDisruptionBudget: 1,
      NetworkPolicy: 1, ServiceMonitor: 1, ConfigMap: 1,
    };
    const failures = Object.entries(expected)
      .filter(([kind, count]) => r.ofKind(kind).length !== count)
      .map(([kind, count]) => `${r.ofKind(kind).length} ${kind}, expected ${count}`);
    // A PersistentVolumeClaim for --weights_dir may come with the rendering.
    const optional = { Namespace: 1, PersistentVolumeClaim: 1 };
    const extra = r.objects.filter((o) => !(o.kind in expected) && !(o.kind in optional));
    for (const [kind, most] of Object.entries(optional)) {
      if (r.ofKind(kind).length > most) failures.push(`${r.ofKind(kind).length} ${kind}`);
    }
    return failures.concat(extra.map((o) => `unexpected ${o.kind}/${o.metadata.name}`));
  }],

  ["one namespace, with the restricted Pod Security Standard if the rendering makes it", (r) => {
    const namespaces = new Set(r.objects.filter((o) => o.kind !== "Namespace")
      .map((o) => o.metadata.namespace || "(current)"));
    const failures = namespaces.size === 1 ? [] : [`objects span ${[...namespaces]}`];
    if (r.namespace) {
      if (!namespaces.has(r.namespace.metadata.name)) failures.push("objects outside Namespace");
      const enforce = (r.namespace.metadata.labels || {})["pod-security.kubernetes.io/enforce"];
      if (enforce !== "restricted") failures.push(`Pod Security enforce is ${enforce}`);
    }
    return failures;
  }],

  ["flags come from the ConfigMap and listen on every address", (r) => {
    const address = r.flags().address;
    return WILDCARD_ADDRESSES.includes(address) ? [] :
        [`--address=${address}: probes and Services reach the pod IP, not it`];
  }],

  ["container ports are --port (grpc) and --metrics_port (metrics)", (r) => {
    const flags = r.flags();
    const failures = [];
    if (containerPort(r.container, "grpc") !== Number(flags.port)) {
      failures.push(`port grpc is ${containerPort(r.container, "grpc")}, --port=${flags.port}`);
    }
    if (containerPort(r.container, "metrics") !== Number(flags.metrics_port)) {
      failures.push(`port metrics is ${containerPort(r.container, "metrics")}, ` +
                    `--metrics_port=${flags.metrics_port}`);
    }
    return failures;
  }],

  ["startup, readiness and liveness are gRPC health probes on --port", (r) => {
    const port = Number(r.flags().port);
    return ["startupProbe", "readinessProbe", "livenessProbe"].flatMap((name) => {
      const probe = r.container[name];
      if (!probe) return [`no ${name}`];
      if (!probe.grpc) return [`${name} is not a grpc probe`];
      const failures = probe.grpc.port === port ? [] :
          [`${name} checks port ${probe.grpc.port}, --port=${port}`];
      if (probe.grpc.service) failures.push(`${name} checks service ${probe.grpc.service}`);
      if (!probe.timeoutSeconds) failures.push(`${name} has no timeoutSeconds`);
      return failures;
    });
  }],

  ["terminationGracePeriodSeconds outlasts preStop plus the server's whole drain", (r) => {
    const drain = Number(r.flags().drain_grace_seconds) + IN_FLIGHT_GRACE_SECONDS;
    const preStop = preStopSeconds(r.container);
    const grace = r.pod.terminationGracePeriodSeconds;
    return grace > preStop + drain ? [] :
        [`terminationGracePeriodSeconds ${grace} <= preStop ${preStop} + drain ${drain} s`];
  }],

  ["requests and limits set; CPU limit whole CPUs (the OpenMP team)", (r) => {
    return r.pod.containers.flatMap((container) => {
      const resources = container.resources || {};
      return ["cpu", "memory"].flatMap((resource) => {
        const request = (resources.requests || {})[resource];
        const limit = (resources.limits || {})[resource];
        if (request === undefined || limit === undefined) {
          return [`${container.name}: ${resource} request ${request}, limit ${limit}`];
        }
        const failures = quantity(request) <= quantity(limit) ? [] :
            [`${container.name}: ${resource} request ${request} > limit ${limit}`];
        if (resource === "cpu" && !(Number.isInteger(quantity(limit)) && quantity(limit) >= 1)) {
          failures.push(`${container.name}: cpu limit ${limit} is not a whole number of CPUs`);
        }
        return failures;
      });
    });
  }],

  ["memory limit holds weights + KV cache + pool + in-flight budget + connections + 256 MiB, " +
    "each set explicitly",
    (r) => {
      const flag = (name) => Number(r.flags()[name]);
      // 0 (-1 for the pool) derives a budget from the cgroup's limit at start-up; the
      // manifests say theirs.
      const unset = ["max_weights_bytes", "kv_cache_bytes", "max_inflight_bytes",
        "max_connections"]
          .filter((name) => !(flag(name) > 0))
          .concat(flag("buffer_pool_bytes") >= 0 ? [] : ["buffer_pool_bytes"]);
      if (unset.length) return [`${unset.join(", ")} not set in the flag file`];
      const needed = flag("max_weights_bytes") + flag("kv_cache_bytes") +
          flag("buffer_pool_bytes") + flag("max_inflight_bytes") +
          flag("max_connections") * CONNECTION_BYTES + BASE_MEMORY_BYTES;
      const limit = quantity(r.container.resources.limits.memory);
      return limit >= needed ? [] : [`memory limit ${limit} B < ${needed} B the flags allow`];
    }],

  // The built-in `demo` set answers whoever names it, with weights from a fixed seed: fine for
  // trying a server out (base keeps it), not where callers expect only their own sets.
  ["the production profile (its own Namespace) registers no demo weights", (r) => {
    if (!r.namespace) return [];
    const value = String(r.flags().demo_weights).toLowerCase();
    return ["false", "0", "no", "n", "f"].includes(value) ? [] :
      [`--demo_weights=${r.flags().demo_weights} in namespace ${r.namespace.metadata.name}`];
  }],

  ["non-root (the image's uid), read-only root, no escalation, no capabilities", (r) => {
    const pod = r.pod.securityContext || {};
    const failures = [];
    for (const container of r.pod.containers) {
      const own = container.securityContext || {};
      const effective = (field) => (own[field] !== undefined ? own[field] : pod[field]);
      const fail = (message) => failures.push(`${container.name}: ${message}`);
      if (effective("runAsNonRoot") !== true) fail("runAsNonRoot is not true");
      if (effective("runAsUser") !== r.dockerUid) {
        fail(`runAsUser ${effective("runAsUser")}, the image's USER is ${r.dockerUid}`);
      }
      if (own.allowPrivilegeEscalation !== false) fail("allowPrivilegeEscalation is not false");
      if (own.readOnlyRootFilesystem !== true) fail("readOnlyRootFilesystem is not true");
      if (own.privileged === true) fail("privileged");
      const capabilities = own.capabilities || {};
      if (!(capabilities.drop || []).includes("ALL")) fail("capabilities not dropped (ALL)");
      if ((capabilities.add || []).length > 0) fail(`capabilities added: ${capabilities.add}`);
      const seccomp = effective("seccompProfile");
      if (!seccomp || !["RuntimeDefault", "Localhost"].includes(seccomp.type)) {
        fail("no RuntimeDefault or Localhost seccomp profile");
      }
    }
    for (const field of ["hostNetwork", "hostPID", "hostIPC"]) {
      if (r.pod[field]) failures.push(`${field} is set`);
    }
    if (r.pod.automountServiceAccountToken !== false) {
      failures.push("automountServiceAccountToken is not false");
    }
    return failures;
  }],

  // --weights_dir is read from a volume every replica mounts (the same sets everywhere), read-only;
  // a claim the rendering makes is ReadOnlyMany, as many pods on many nodes mount it.
  ["--weights_dir is a read-only volume shared by the replicas", (r) => {
    const dir = r.flags().weights_dir;
    if (!dir) return [];
    const mount = (r.container.volumeMounts || []).find((m) => m.mountPath === dir);
    if (!mount) return [`--weights_dir=${dir} but no volume is mounted there`];
    const failures = mount.readOnly ? [] : [`the volume at ${dir} is writable`];
    const volume = (r.pod.volumes || []).find((v) => v.name === mount.name) || {};
    if (volume.emptyDir) failures.push(`${dir} is an emptyDir: each replica's own, and empty`);
    const claimName = volume.persistentVolumeClaim && volume.persistentVolumeClaim.claimName;
    const claim = claimName &&
        r.ofKind("PersistentVolumeClaim").find((c) => c.metadata.name === claimName);
    if (claim && !(claim.spec.accessModes || []).includes("ReadOnlyMany")) {
      failures.push(`claim ${claimName} is not ReadOnlyMany`);
    }
    return failures;
  }],

  ["a writable emptyDir /tmp under the read-only root", (r) => {
    const mount = (r.container.volumeMounts || []).find((m) => m.mountPath === "/tmp");
    const volume = mount && r.pod.volumes.find((v) => v.name === mount.name);
    return volume && volume.emptyDir && !mount.readOnly ? [] : ["no writable emptyDir at /tmp"];
  }],

  ["the image has a pinned tag or digest", (r) => {
    const image = r.container.image;
    const pinned = /@sha256:[0-9a-f]{64}$/.test(image) ||
        (/:[^/:]+$/.test(image) && !image.endsWith(":latest"));
    return pinned ? [] : [`image ${image} is not pinned`];
  }],

  ["no replicas in the Deployment: the HPA owns the count", (r) => {
    return r.deployment.spec.replicas === undefined ? [] :
        [`spec.replicas is ${r.deployment.spec.replicas}`];
  }],

  ["Services select the pods; ports reach grpc and metrics; one is headless", (r) => {
    const failures = [];
    for (const service of r.services) {
      const name = `Service/${service.metadata.name}`;
      if (!service.spec.selector || !labelsMatch(service.spec.selector, r.podLabels)) {
        failures.push(`${name} does not select the pods`);
      }
      for (const port of service.spec.ports) {
        if (containerPort(r.container, port.targetPort) === undefined) {
          failures.push(`${name} port ${port.name} targets ${port.targetPort}, no such port`);
        }
      }
    }
    const reaches = (service, name) => service.spec.ports.some((p) =>
      containerPort(r.container, p.targetPort) === containerPort(r.container, name));
    if (r.headless.length !== 1) return failures.concat(`${r.headless.length} headless`);
    const [headless] = r.headless;
    if (!reaches(headless, "grpc")) failures.push("headless Service has no gRPC port");
    if (headless.spec.publishNotReadyAddresses) failures.push("headless publishes unready pods");
    for (const service of r.clusterIp) {
      for (const port of ["grpc", "metrics"]) {
        if (!reaches(service, port)) failures.push(`Service/${service.metadata.name}: no ${port}`);
      }
    }
    return failures;
  }],

  ["HPA scales the Deployment on CPU, from at least 2 replicas", (r) => {
    const { scaleTargetRef: target, minReplicas, maxReplicas, metrics } = r.hpa.spec;
    const failures = [];
    if (target.apiVersion !== "apps/v1" || target.kind !== "Deployment" ||
        target.name !== r.deployment.metadata.name) {
      failures.push(`scaleTargetRef ${JSON.stringify(target)} is not the Deployment`);
    }
    if (!(minReplicas >= 2)) failures.push(`minReplicas ${minReplicas} < 2`);
    if (!(maxReplicas >= minReplicas)) failures.push(`maxReplicas ${maxReplicas} < min`);
    if (!(metrics || []).some((m) => m.type === "Resource" && m.resource.name === "cpu")) {
      failures.push("no CPU metric");
    }
    return failures;
  }],

  ["PDB selects the pods and lets drains proceed", (r) => {
    const { selector, minAvailable, maxUnavailable } = r.pdb.spec;
    const failures = labelsMatch(selector.matchLabels, r.podLabels) &&
        Object.keys(selector.matchLabels || {}).length > 0 ? [] : ["does not select the pods"];
    if ((minAvailable === undefined) === (maxUnavailable === undefined)) {
      failures.push("needs exactly one of minAvailable and maxUnavailable");
    }
    if (Number.isInteger(minAvailable) && minAvailable >= r.hpa.spec.minReplicas) {
      failures.push(`minAvailable ${minAvailable} blocks every drain at minReplicas`);
    }
    if (maxUnavailable === 0 || maxUnavailable === "0%") failures.push("maxUnavailable 0");
    return failures;
  }],

  ["NetworkPolicy covers the pods and admits gRPC and metrics", (r) => {
    const policy = r.networkPolicy.spec;
    const failures = labelsMatch(policy.podSelector.matchLabels, r.podLabels) ? [] :
        ["podSelector does not select the pods"];
    if (!(policy.policyTypes || []).includes("Ingress")) failures.push("no Ingress policy");
    const admitted = new Set();
    for (const rule of policy.ingress || []) {
      for (const port of rule.ports || []) {
        const number = containerPort(r.container, port.port);
        if (number === undefined) failures.push(`ingress port ${port.port}: no container port`);
        admitted.add(number);
      }
    }
    for (const name of ["grpc", "metrics"]) {
      if (!admitted.has(containerPort(r.container, name))) failures.push(`${name} not admitted`);
    }
    return failures;
  }],

  ["ServiceMonitor scrapes /metrics through exactly one Service", (r) => {
    const { selector, endpoints, namespaceSelector } = r.serviceMonitor.spec;
    const selected = r.services.filter((s) => labelsMatch(selector.matchLabels, s.metadata.labels));
    if (selected.length !== 1) return [`selects ${selected.length} Services`];
    if (namespaceSelector && !namespaceSelector.any && namespaceSelector.matchNames &&
        !namespaceSelector.matchNames.includes(selected[0].metadata.namespace)) {
      return ["namespaceSelector misses the Service's namespace"];
    }
    const metricsPort = containerPort(r.container, "metrics");
    return (endpoints || []).length === 0 ? ["no endpoints"] : endpoints.flatMap((endpoint) => {
      const port = selected[0].spec.ports.find((p) => p.name === endpoint.port);
      const failures = [];
      if (!port || containerPort(r.container, port.targetPort) !== metricsPort) {
        failures.push(`endpoint port ${endpoint.port} does not reach the metrics port`);
      }
      if ((endpoint.path || "/metrics") !== "/metrics") failures.push(`path ${endpoint.path}`);
      return failures;
    });
  }],

  ["Prometheus scrape annotations name --metrics_port and /metrics", (r) => {
    const annotations = r.deployment.spec.template.metadata.annotations || {};
    const expected = {
      "prometheus.io/scrape": "true",
      "prometheus.io/port": r.flags().metrics_port,
      "prometheus.io/path": "/metrics",
    };
    return Object.entries(expected).filter(([key, value]) => annotations[key] !== value)
      .map(([key, value]) => `${key} is ${annotations[key]}, expected ${value}`);
  }],

  // The HPA reads Pods metrics from the custom metrics API, which prometheus-adapter serves by
  // its rules: a metric no rule defines is never there, and the HPA cannot scale on it.
  ["HPA Pods metrics each defined by one per-pod prometheus-adapter rule, every rule used", (r) => {
    if (r.podsMetrics.length === 0 && !r.adapter) return [];
    const names = r.podsMetrics.map((m) => m.name);
    if (!r.adapter) {
      return [`the HPA scales on ${names.join(", ")}, but no prometheus-adapter config comes ` +
              "with the rendering (prometheus-adapter-config.yaml)"];
    }
    const { rules, error } = adapterRules(r.adapter);
    if (error) return [error];
    const failures = [];
    const defined = new Map();
    rules.forEach((rule, i) => {
      const as = rule.name && rule.name.as;
      const fail = (message) => failures.push(`rule ${i} (${as}): ${message}`);
      if (typeof as !== "string" || !/^[a-zA-Z_:][a-zA-Z0-9_:]*$/.test(as)) {
        fail("name.as is not a metric name (the rule must name its metric outright)");
      } else {
        defined.set(as, (defined.get(as) || 0) + 1);
      }
      const selector = parseSelector(rule.seriesQuery);
      if (rule.name && rule.name.matches && selector && selector.name &&
          !new RegExp(rule.name.matches).test(selector.name)) {
        fail(`name.matches ${rule.name.matches} misses the seriesQuery's ${selector.name}`);
      }
      // Pods metrics: the adapter must tie each series to its pod and namespace.
      const overrides = (rule.resources && rule.resources.overrides) || {};
      const resource = (label) => overrides[label] && overrides[label].resource;
      if (!["namespace", "namespaces"].includes(resource("namespace"))) {
        fail("resources.overrides does not map the namespace label to the namespace");
      }
      if (!["pod", "pods"].includes(resource("pod"))) {
        fail("resources.overrides does not map the pod label to the pod");
      }
      if (selector && !["namespace", "pod"].every((label) =>
        selector.matchers.some((m) => m.label === label))) {
        fail("seriesQuery does not select series with namespace and pod labels");
      }
      const query = String(rule.metricsQuery || "");
      if (!query.includes("<<.GroupBy>>")) fail("metricsQuery does not group by <<.GroupBy>>");
      const selectors = querySelectors(query);
      if (selectors.length === 0) fail("metricsQuery reads no attnserve series");
      for (const { name, braces } of selectors) {
        if (braces === null || !braces.includes("<<.LabelMatchers>>")) {
          fail(`metricsQuery reads ${name} without <<.LabelMatchers>>: ` +
               "every pod's, not the one asked for");
        }
      }
    });
    for (const { name, target } of r.podsMetrics) {
      const count = defined.get(name) || 0;
      if (count !== 1) failures.push(`the HPA's Pods metric ${name} is defined by ${count} rules`);
      if (target.type !== "AverageValue") {
        failures.push(`Pods metric ${name}: target type ${target.type}, expected AverageValue`);
      }
    }
    for (const name of defined.keys()) {
      if (!names.includes(name)) failures.push(`rule defines ${name}, which the HPA does not use`);
    }
    return failures;
  }],

  // A rule over a series attnserve does not export (or a label it does not have) matches nothing:
  // the metric is missing, and the HPA does not scale on it.
  ["prometheus-adapter rules query only metrics attnserve exports (docs/metrics.md), " +
   "by their labels",
    (r) => {
      if (!r.adapter) return [];
      const { rules, error } = adapterRules(r.adapter);
      if (error) return [error];
      const failures = [];
      const checkSeries = (where, name, matchers) => {
        const series = r.exported.get(name);
        if (!series) {
          failures.push(`${where} reads ${name}, which attnserve does not export`);
          return;
        }
        for (const { label } of matchers) {
          if (label !== "__name__" && !series.labels.includes(label) &&
              !TARGET_LABELS.includes(label)) {
            failures.push(`${where} matches label ${label}, which ${name} does not have`);
          }
        }
      };
      rules.forEach((rule, i) => {
        const where = `rule ${i} (${rule.name && rule.name.as})`;
        const selector = parseSelector(rule.seriesQuery);
        if (!selector || !selector.name) {
          failures.push(`${where}: seriesQuery ${rule.seriesQuery} does not name one series`);
          return;
        }
        checkSeries(`${where} seriesQuery`, selector.name, selector.matchers);
        const query = String(rule.metricsQuery || "");
        const unknown = (query.match(/<<[^>]*>>/g) || [])
          .filter((template) => !ADAPTER_TEMPLATES.includes(template));
        if (unknown.length) failures.push(`${where}: metricsQuery uses ${unknown.join(", ")}`);
        for (const { name, braces } of querySelectors(query)) {
          const matchers = parseMatchers((braces || "").replace("<<.LabelMatchers>>", "")
            .replace(/^\s*,/, "").replace(/,\s*,/g, ","));
          if (!matchers) {
            failures.push(`${where}: cannot read the matchers {${braces}} of ${name}`);
            continue;
          }
          checkSeries(`${where} metricsQuery`, name === "<<.Series>>" ? selector.name : name,
                      matchers);
        }
      });
      return failures;
    }],

  // A sessions profile's pods hold state: removing one drops its sessions, and their clients
  // rebuild them (a prefill each) on other replicas. So scale-down waits for load to stay low,
  // removes one pod at a time, and not before the last one has finished draining.
  ["a sessions profile (HPA on Pods metrics) scales down one pod at a time, slowly", (r) => {
    if (r.podsMetrics.length === 0) return [];
    const scaleDown = (r.hpa.spec.behavior || {}).scaleDown;
    if (!scaleDown) {
      return ["no behavior.scaleDown (the default removes every surplus pod at once)"];
    }
    const failures = [];
    const window = scaleDown.stabilizationWindowSeconds;
    if (!(window >= MIN_SESSIONS_SCALE_DOWN_WINDOW_SECONDS)) {
      failures.push(`scaleDown stabilizationWindowSeconds ${window} < ` +
                    `${MIN_SESSIONS_SCALE_DOWN_WINDOW_SECONDS}`);
    }
    if (scaleDown.selectPolicy === "Disabled") return failures;
    const policies = scaleDown.policies || [];
    if (policies.length === 0) failures.push("no scaleDown policies (the default: 100 % at once)");
    const grace = r.pod.terminationGracePeriodSeconds;
    for (const policy of policies) {
      if (policy.type !== "Pods" || policy.value !== 1) {
        failures.push(`scaleDown policy ${policy.type} ${policy.value}: ` +
                      "more than one pod a period");
      }
      if (!(policy.periodSeconds >= grace)) {
        failures.push(`scaleDown policy removes a pod every ${policy.periodSeconds} s, less than ` +
                      `the ${grace} s a removed pod may take to drain`);
      }
    }
    return failures;
  }],

  // Rolling updates of a sessions profile: a new pod before an old one goes, and old pods
  // deleted at least a drain grace apart (minReadySeconds), so one replica at a time refuses
  // new sessions and one replica's sessions are rebuilt at a time.
  ["a sessions profile rolls out one pod at a time, new before old, minReadySeconds >= drain grace",
    (r) => {
      if (r.podsMetrics.length === 0) return [];
      const strategy = r.deployment.spec.strategy || {};
      if (strategy.type === "Recreate") return ["strategy Recreate drops every replica's sessions"];
      const rolling = strategy.rollingUpdate || {};
      const failures = [];
      if (rolling.maxSurge !== 1) failures.push(`maxSurge ${rolling.maxSurge}, expected 1`);
      if (rolling.maxUnavailable !== 0 && rolling.maxUnavailable !== "0%") {
        failures.push(`maxUnavailable ${rolling.maxUnavailable}, expected 0`);
      }
      const minReady = r.deployment.spec.minReadySeconds || 0;
      const drain = Number(r.flags().drain_grace_seconds);
      if (!(minReady >= drain)) {
        failures.push(`minReadySeconds ${minReady} < --drain_grace_seconds=${drain}`);
      }
      return failures;
    }],
];

// --- Mutations: each breaks a valid rendering one way; the named invariant must catch it.

const find = (objects, kind) => objects.find((o) => o.kind === kind);
const podOf = (objects) => find(objects, "Deployment").spec.template.spec;
const containerOf = (objects) => podOf(objects).containers[0];
const replaceFlag = (objects, flag, value) => {
  const data = find(objects, "ConfigMap").data;
  const key = Object.keys(data)[0];
  data[key] = data[key].replace(new RegExp(`^--${flag}=.*$`, "m"), `--${flag}=${value}`);
};

// The flags the rendering's container runs with.
const flagsOf = (objects) => containerFlags(podOf(objects), containerOf(objects),
                                            objects.filter((o) => o.kind === "ConfigMap")).flags;
const memoryLimitOf = (objects) => String(quantity(containerOf(objects).resources.limits.memory));
const hpaOf = (objects) => find(objects, "HorizontalPodAutoscaler");
const hasPodsMetrics = (objects) => podsMetrics(hpaOf(objects)).length > 0;
// Edits the prometheus-adapter rules of a rendering's config in place.
const editRules = (rendering, edit) => {
  const config = YAML.parse(rendering.adapter.data["config.yaml"]);
  edit(config.rules);
  rendering.adapter.data["config.yaml"] = YAML.stringify(config);
};
// The rule whose metricsQuery or seriesQuery mentions `text`.
const ruleWith = (rules, text) =>
  rules.find((rule) => `${rule.seriesQuery} ${rule.metricsQuery}`.includes(text));

// Sets --flag=value in the flag file, appending it if absent.
const setFlag = (objects, flag, value) => {
  const data = find(objects, "ConfigMap").data;
  const key = Object.keys(data)[0];
  const line = new RegExp(`^--${flag}=.*$`, "m");
  data[key] = line.test(data[key]) ? data[key].replace(line, `--${flag}=${value}`)
                                   : `${data[key].replace(/\n?$/, "\n")}--${flag}=${value}\n`;
};

const MUTATIONS = [
  ["readiness probe on another port", "gRPC health probes",
    (o) => { containerOf(o).readinessProbe.grpc.port = 50052; }],
  ["no startup probe", "gRPC health probes", (o) => { delete containerOf(o).startupProbe; }],
  ["liveness over HTTP", "gRPC health probes",
    (o) => { containerOf(o).livenessProbe = { httpGet: { port: 9464, path: "/" } }; }],
  ["--port moved, manifests not", "container ports are", (o) => replaceFlag(o, "port", "50052")],
  ["--address loopback", "listen on every address",
    (o) => replaceFlag(o, "address", "127.0.0.1")],
  ["grace period equal to the drain", "terminationGracePeriodSeconds outlasts",
    (o) => {
      podOf(o).terminationGracePeriodSeconds =
          Number(flagsOf(o).drain_grace_seconds) + IN_FLIGHT_GRACE_SECONDS;
    }],
  ["longer drain grace, same grace period", "terminationGracePeriodSeconds outlasts",
    (o) => replaceFlag(o, "drain_grace_seconds",
                       String(podOf(o).terminationGracePeriodSeconds - IN_FLIGHT_GRACE_SECONDS))],
  ["a preStop sleep eating the margin", "terminationGracePeriodSeconds outlasts",
    (o) => {
      const margin = podOf(o).terminationGracePeriodSeconds - IN_FLIGHT_GRACE_SECONDS -
          Number(flagsOf(o).drain_grace_seconds);
      containerOf(o).lifecycle = { preStop: { exec: { command: ["sleep", String(margin)] } } };
    }],
  ["runs as root allowed", "non-root", (o) => { podOf(o).securityContext.runAsNonRoot = false; }],
  ["another uid than the image's", "non-root",
    (o) => { podOf(o).securityContext.runAsUser = 1000; }],
  ["writable root", "non-root",
    (o) => { containerOf(o).securityContext.readOnlyRootFilesystem = false; }],
  ["capabilities kept", "non-root",
    (o) => { containerOf(o).securityContext.capabilities.drop = []; }],
  ["escalation allowed", "non-root",
    (o) => { delete containerOf(o).securityContext.allowPrivilegeEscalation; }],
  ["no memory limit", "requests and limits",
    (o) => { delete containerOf(o).resources.limits.memory; }],
  ["fractional CPU limit", "requests and limits",
    (o) => { containerOf(o).resources.limits.cpu = "1500m"; }],
  ["weights budget over the memory limit", "memory limit holds",
    (o) => replaceFlag(o, "max_weights_bytes", memoryLimitOf(o))],
  ["in-flight budget over the memory limit", "memory limit holds",
    (o) => replaceFlag(o, "max_inflight_bytes", memoryLimitOf(o))],
  ["in-flight budget left to the default", "memory limit holds",
    (o) => replaceFlag(o, "max_inflight_bytes", "0")],
  ["KV-cache budget over the memory limit", "memory limit holds",
    (o) => replaceFlag(o, "kv_cache_bytes", memoryLimitOf(o))],
  ["KV-cache budget left to the default", "memory limit holds",
    (o) => replaceFlag(o, "kv_cache_bytes", "0")],
  ["connections over the memory limit", "memory limit holds",
    (o) => replaceFlag(o, "max_connections",
        String(Math.ceil(memoryLimitOf(o) / (32 * 2 ** 10))))],
  ["connections left to the default", "memory limit holds",
    (o) => replaceFlag(o, "max_connections", "0")],
  ["demo weights in a rendering with its own Namespace", "registers no demo weights",
    (o) => {
      if (!find(o, "Namespace")) {
        o.push({ apiVersion: "v1", kind: "Namespace", metadata: { name: "attnserve" } });
      }
      replaceFlag(o, "demo_weights", "true");
    }],
  ["replicas fixed", "no replicas", (o) => { find(o, "Deployment").spec.replicas = 3; }],
  ["Service selects nothing", "Services select",
    (o) => { find(o, "Service").spec.selector = { app: "other" }; }],
  ["HPA targets another Deployment", "HPA scales",
    (o) => { find(o, "HorizontalPodAutoscaler").spec.scaleTargetRef.name = "other"; }],
  ["PDB blocks drains", "PDB selects",
    (o) => {
      const spec = find(o, "PodDisruptionBudget").spec;
      delete spec.maxUnavailable;
      spec.minAvailable = 10;
    }],
  ["NetworkPolicy shuts gRPC out", "NetworkPolicy covers",
    (o) => { find(o, "NetworkPolicy").spec.ingress.shift(); }],
  ["ServiceMonitor on a port the Service lacks", "ServiceMonitor scrapes",
    (o) => { find(o, "ServiceMonitor").spec.endpoints[0].port = "web"; }],
  ["annotation on another port", "Prometheus scrape annotations",
    (o) => { find(o, "Deployment").spec.template.metadata.annotations["prometheus.io/port"] =
      "8080"; }],
  ["--weights_dir where no volume is mounted", "--weights_dir is a read-only volume",
    (o) => setFlag(o, "weights_dir", "/srv/weights")],
  ["containerPort as a string", "API schemas",
    (o) => { containerOf(o).ports[0].containerPort = "50051"; }],
  ["probe period as a string", "API schemas",
    (o) => { containerOf(o).livenessProbe.periodSeconds = "often"; }],
  // Scaling on per-pod metrics needs prometheus-adapter rules for them (in any rendering).
  ["HPA on a Pods metric no rule defines", "defined by one per-pod prometheus-adapter rule",
    (o) => {
      hpaOf(o).spec.metrics.push({ type: "Pods", pods: { metric: { name: "attnserve_sessions" },
        target: { type: "AverageValue", averageValue: "100" } } });
    }],
  // The rest break what only a sessions profile has: the adapter's rules, its HPA's behaviour
  // and its rollout.
  ["no prometheus-adapter config", "defined by one per-pod prometheus-adapter rule",
    (o, rendering) => { rendering.adapter = null; }, hasPodsMetrics],
  ["a rule naming the KV-cache metric otherwise", "defined by one per-pod prometheus-adapter rule",
    (o, rendering) => editRules(rendering, (rules) => {
      ruleWith(rules, "attnserve_kv_cache_bytes").name.as = "attnserve_kv_cache_use";
    }), hasPodsMetrics],
  ["a Pods metric with a Value target", "defined by one per-pod prometheus-adapter rule",
    (o) => {
      hpaOf(o).spec.metrics.find((m) => m.type === "Pods").pods.target =
          { type: "Value", value: "1" };
    }, hasPodsMetrics],
  ["a metricsQuery over every pod", "defined by one per-pod prometheus-adapter rule",
    (o, rendering) => editRules(rendering, (rules) => {
      rules[0].metricsQuery = rules[0].metricsQuery.replaceAll("{<<.LabelMatchers>>}", "");
    }), hasPodsMetrics],
  ["a seriesQuery without the pod label", "defined by one per-pod prometheus-adapter rule",
    (o, rendering) => editRules(rendering, (rules) => {
      rules[0].seriesQuery = rules[0].seriesQuery.replace(/,?\s*pod\s*!=\s*""/, "");
    }), hasPodsMetrics],
  ["a seriesQuery over a metric attnserve does not export", "query only metrics attnserve exports",
    (o, rendering) => editRules(rendering, (rules) => {
      const rule = ruleWith(rules, "attnserve_kv_cache_bytes");
      rule.seriesQuery = rule.seriesQuery.replace("attnserve_kv_cache_bytes",
                                                  "attnserve_kv_cache_used_bytes");
    }), hasPodsMetrics],
  ["a metricsQuery dividing by a metric attnserve does not export",
    "query only metrics attnserve exports",
    (o, rendering) => editRules(rendering, (rules) => {
      const rule = ruleWith(rules, "attnserve_kv_cache_budget_bytes");
      rule.metricsQuery = rule.metricsQuery.replace("attnserve_kv_cache_budget_bytes",
                                                    "attnserve_kv_cache_limit_bytes");
    }), hasPodsMetrics],
  ["a seriesQuery matching a label the metric lacks", "query only metrics attnserve exports",
    (o, rendering) => editRules(rendering, (rules) => {
      rules[0].seriesQuery = rules[0].seriesQuery.replace("}", ',code="OK"}');
    }), hasPodsMetrics],
  ["a metricsQuery matching a label the histogram lacks", "query only metrics attnserve exports",
    (o, rendering) => editRules(rendering, (rules) => {
      const rule = ruleWith(rules, "attnserve_queue_wait_seconds_bucket");
      rule.metricsQuery = rule.metricsQuery.replace(
        "attnserve_queue_wait_seconds_bucket{<<.LabelMatchers>>",
        'attnserve_queue_wait_seconds_bucket{<<.LabelMatchers>>,weights="demo"');
    }), hasPodsMetrics],
  ["scale-down by 50 % a period", "scales down one pod at a time",
    (o) => { hpaOf(o).spec.behavior.scaleDown.policies =
      [{ type: "Percent", value: 50, periodSeconds: 300 }]; }, hasPodsMetrics],
  ["scale-down after a minute of low load", "scales down one pod at a time",
    (o) => { hpaOf(o).spec.behavior.scaleDown.stabilizationWindowSeconds = 60; }, hasPodsMetrics],
  ["scale-down a pod a minute, within a drain", "scales down one pod at a time",
    (o) => { hpaOf(o).spec.behavior.scaleDown.policies[0].periodSeconds = 60; }, hasPodsMetrics],
  ["no scale-down behaviour", "scales down one pod at a time",
    (o) => { delete hpaOf(o).spec.behavior.scaleDown; }, hasPodsMetrics],
  ["rollout surging 25 %", "rolls out one pod at a time",
    (o) => { find(o, "Deployment").spec.strategy.rollingUpdate.maxSurge = "25%"; },
    hasPodsMetrics],
  ["rollout taking an old pod down first", "rolls out one pod at a time",
    (o) => {
      find(o, "Deployment").spec.strategy.rollingUpdate = { maxSurge: 0, maxUnavailable: 1 };
    },
    hasPodsMetrics],
  ["no minReadySeconds", "rolls out one pod at a time",
    (o) => { delete find(o, "Deployment").spec.minReadySeconds; }, hasPodsMetrics],
];

function evaluate(rendering, context) {
  const indexed = index(rendering, context);
  return INVARIANTS.map(([name, check]) => {
    try {
      return { name, failures: check(indexed) };
    } catch (error) {
      return { name, failures: [`cannot check: ${error.message}`] };
    }
  });
}

// The adapter's queries as Prometheus would get them for two pods of the Deployment: a rules
// file (one recording rule per query) for `promtool check rules`.
function adapterQueries(rendering) {
  const deployment = rendering.objects.find((o) => o.kind === "Deployment");
  const namespace = deployment.metadata.namespace || "default";
  const pods = `${deployment.metadata.name}-a|${deployment.metadata.name}-b`;
  const rules = adapterRules(rendering.adapter).rules.flatMap((rule) => {
    const selector = parseSelector(rule.seriesQuery) || {};
    const expr = String(rule.metricsQuery).replaceAll("<<.Series>>", selector.name)
      .replaceAll("<<.LabelMatchers>>", `namespace="${namespace}",pod=~"${pods}"`)
      .replaceAll("<<.GroupBy>>", "pod");
    return [{ record: rule.name.as, expr }, { record: `${rule.name.as}:series`,
                                             expr: String(rule.seriesQuery) }];
  });
  return YAML.stringify({ groups: [{ name: "prometheus-adapter", rules }] });
}

function main() {
  const [dockerfile, metricsDoc, ...files] = process.argv.slice(2);
  const user = /^USER\s+(\d+)/m.exec(fs.readFileSync(dockerfile, "utf8"));
  if (!user) throw new Error(`${dockerfile} has no numeric USER`);
  const exported = exportedSeries(fs.readFileSync(metricsDoc, "utf8"));
  if (exported.size < 20) {
    throw new Error(`${metricsDoc}: only ${exported.size} series in its table`);
  }
  const context = { dockerUid: Number(user[1]), exported };
  let failed = 0;
  for (const file of files) {
    const name = path.basename(file, ".yaml");
    const objects = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"))
      .map((document) => document.toJSON()).filter(Boolean);
    const adapterFile = file.replace(/\.yaml$/, ".adapter-config");
    const adapter = fs.existsSync(adapterFile) ? YAML.parse(fs.readFileSync(adapterFile, "utf8"))
                                               : null;
    const rendering = { objects, adapter };
    console.log(`== ${name}: ${objects.map((o) => `${o.kind}/${o.metadata.name}`).join(" ")}` +
                (adapter ? `; prometheus-adapter ${adapter.kind}/${adapter.metadata.name}` : ""));
    for (const { name: invariant, failures } of evaluate(rendering, context)) {
      console.log(`${failures.length ? "FAIL" : "ok  "} ${invariant}`);
      for (const failure of failures) console.log(`       ${failure}`);
      failed += failures.length ? 1 : 0;
    }
    const skipped = MUTATIONS.filter(([, , , applies]) => applies && !applies(objects));
    if (skipped.length) {
      console.log(`--   ${skipped.length} mutations of a sessions profile: ` +
                  "not for this rendering (no Pods metrics)");
    }
    for (const [mutation, invariant, mutate, applies] of MUTATIONS) {
      if (applies && !applies(objects)) continue;
      const mutated = structuredClone(rendering);
      mutate(mutated.objects, mutated);
      const caught = evaluate(mutated, context)
        .filter((result) => result.failures.length > 0).map((result) => result.name);
      const ok = caught.some((caughtName) => caughtName.includes(invariant));
      console.log(`${ok ? "ok  " : "FAIL"} mutation "${mutation}" caught by "${invariant}"` +
                  (ok ? "" : ` (failed instead: ${caught.join("; ") || "nothing"})`));
      failed += ok ? 0 : 1;
    }
    const deployment = objects.find((o) => o.kind === "Deployment");
    const pod = deployment.spec.template.spec;
    const { flagFileText } = containerFlags(pod, pod.containers[0],
                                            objects.filter((o) => o.kind === "ConfigMap"));
    fs.writeFileSync(file.replace(/\.yaml$/, ".flags"), flagFileText);
    if (adapter && !adapterRules(adapter).error) {
      fs.writeFileSync(file.replace(/\.yaml$/, ".adapter-queries.yml"), adapterQueries(rendering));
    }
  }
  console.log(failed ? `FAIL: ${failed} check(s)` : "all checks passed");
  process.exit(failed ? 1 : 0);
}

main();
