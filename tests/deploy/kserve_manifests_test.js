// KServe's manifests (deploy/kserve) for the Open Inference Protocol: checks, and mutations each
// check must catch.
//
// KServe's CRD schemas are not on npm, so the KServe fields are checked here against KServe's API
// types (serving.kserve.io v1alpha1 ServingRuntime, v1beta1 InferenceService); the runtime's
// containers, which are Kubernetes core Containers, are validated against the Kubernetes API
// schema (kubernetes-models) inside a Pod. Writes the runtime container's args as a flag file
// next to the rendering, for the harness to start attnserve with.
//
// usage: NODE_PATH=.../node_modules node kserve_manifests_test.js DOCKERFILE RENDERED.yaml
"use strict";

const fs = require("fs");
const YAML = require("yaml");
const { Pod } = require("kubernetes-models/v1");

const PROTOCOLS = ["v1", "v2", "grpc-v1", "grpc-v2"];  // KServe's InferenceServiceProtocol

const find = (objects, kind) => objects.find((o) => o.kind === kind);
const runtimeOf = (objects) => find(objects, "ServingRuntime");
const isvcOf = (objects) => find(objects, "InferenceService");
const containerOf = (objects) => runtimeOf(objects).spec.containers[0];

function flag(container, name) {
  const prefix = `--${name}=`;
  const found = (container.args || []).filter((arg) => arg.startsWith(prefix));
  return found.length ? found[found.length - 1].slice(prefix.length) : undefined;
}

const CHECKS = [
  ["kinds and API versions", (objects) => {
    const failures = [];
    const runtime = runtimeOf(objects), isvc = isvcOf(objects);
    if (!runtime || runtime.apiVersion !== "serving.kserve.io/v1alpha1") {
      failures.push("no serving.kserve.io/v1alpha1 ServingRuntime");
    }
    if (!isvc || isvc.apiVersion !== "serving.kserve.io/v1beta1") {
      failures.push("no serving.kserve.io/v1beta1 InferenceService");
    }
    return failures;
  }],
  ["containers against the Kubernetes schema", (objects) => {
    const pod = { apiVersion: "v1", kind: "Pod", metadata: { name: "runtime" },
                  spec: { containers: runtimeOf(objects).spec.containers } };
    try {
      new Pod(pod).validate();
      return [];
    } catch (error) {
      return [error.message];
    }
  }],
  ["runtime speaks grpc-v2 for model format attnserve", (objects) => {
    const spec = runtimeOf(objects).spec;
    const failures = [];
    for (const protocol of spec.protocolVersions || []) {
      if (!PROTOCOLS.includes(protocol)) failures.push(`unknown protocol ${protocol}`);
    }
    if (!(spec.protocolVersions || []).includes("grpc-v2")) failures.push("no grpc-v2");
    const formats = spec.supportedModelFormats || [];
    if (!formats.some((f) => f.name === "attnserve")) failures.push("no attnserve format");
    if (spec.containers.length !== 1) failures.push("one container expected");
    return failures;
  }],
  ["gRPC on the h2c port attnserve listens on", (objects) => {
    const container = containerOf(objects);
    const ports = container.ports || [];
    const h2c = ports.find((p) => p.name === "h2c");
    if (!h2c) return ["no container port named h2c (KServe routes gRPC there)"];
    const failures = [];
    if (ports.length !== 1) failures.push("Knative allows one container port");
    if (String(h2c.containerPort) !== flag(container, "port")) {
      failures.push(`h2c is ${h2c.containerPort}, attnserve's --port ${flag(container, "port")}`);
    }
    for (const name of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const probe = container[name];
      if (!probe || !probe.grpc || probe.grpc.port !== h2c.containerPort) {
        failures.push(`${name} must be a gRPC health check on the h2c port`);
      } else if (!probe.timeoutSeconds || probe.timeoutSeconds < 2) {
        // Kubernetes' default is 1 s: a busy, throttled replica misses checks it answers.
        failures.push(`${name} has timeoutSeconds ${probe.timeoutSeconds}, expected 2 or more`);
      }
    }
    return failures;
  }],
  ["weight sets from the model's storage", (objects) => {
    const container = containerOf(objects);
    const model = isvcOf(objects).spec.predictor.model;
    const failures = [];
    if (flag(container, "weights_dir") !== "/mnt/models") {
      failures.push("a storageUri is mounted at /mnt/models: --weights_dir must read it");
    }
    // Without storage /mnt/models is missing, and attnserve exits on a --weights_dir it
    // cannot read (a crash loop, a review found).
    if (!model.storageUri) failures.push("no storageUri: --weights_dir=/mnt/models would be missing");
    if (flag(container, "demo_weights") !== "false") {
      failures.push("--demo_weights=false: only the model's own sets should answer");
    }
    return failures;
  }],
  ["the InferenceService uses the runtime", (objects) => {
    const runtime = runtimeOf(objects), model = isvcOf(objects).spec.predictor.model;
    const failures = [];
    if (model.runtime !== runtime.metadata.name) {
      failures.push(`runtime ${model.runtime}, expected ${runtime.metadata.name}`);
    }
    const formats = runtime.spec.supportedModelFormats.map((f) => f.name);
    if (!model.modelFormat || !formats.includes(model.modelFormat.name)) {
      failures.push(`model format ${JSON.stringify(model.modelFormat)} not in ${formats}`);
    }
    if (model.protocolVersion !== "grpc-v2") failures.push("protocolVersion must be grpc-v2");
    return failures;
  }],
  ["runs as the image's user, read-only", (objects, dockerUid) => {
    const context = containerOf(objects).securityContext || {};
    const failures = [];
    if (!context.runAsNonRoot) failures.push("runAsNonRoot");
    if (!context.readOnlyRootFilesystem) failures.push("readOnlyRootFilesystem");
    // The restricted Pod Security Standard admits no container without one.
    const seccomp = context.seccompProfile;
    if (!seccomp || !["RuntimeDefault", "Localhost"].includes(seccomp.type)) {
      failures.push("no RuntimeDefault or Localhost seccompProfile");
    }
    if (context.runAsUser !== undefined && context.runAsUser !== dockerUid) {
      failures.push(`runAsUser ${context.runAsUser}, the image's is ${dockerUid}`);
    }
    return failures;
  }],
];

const MUTATIONS = [
  ["a protocol KServe does not know", "grpc-v2",
   (o) => { runtimeOf(o).spec.protocolVersions = ["grpc-v3"]; }],
  ["the h2c port renamed", "h2c", (o) => { containerOf(o).ports[0].name = "grpc"; }],
  ["--port off the h2c port", "h2c", (o) => {
    containerOf(o).args = containerOf(o).args.map((a) => a.startsWith("--port=") ? "--port=9000" : a);
  }],
  ["a liveness probe with Kubernetes' 1 s timeout", "h2c", (o) => {
    delete containerOf(o).livenessProbe.timeoutSeconds;
  }],
  ["no startup probe", "h2c", (o) => { delete containerOf(o).startupProbe; }],
  ["an HTTP readiness probe", "h2c", (o) => {
    containerOf(o).readinessProbe = { httpGet: { path: "/", port: 8081 } };
  }],
  ["--weights_dir elsewhere", "storage", (o) => {
    containerOf(o).args = containerOf(o).args.filter((a) => !a.startsWith("--weights_dir="));
  }],
  ["another runtime named", "uses the runtime", (o) => { isvcOf(o).spec.predictor.model.runtime = "triton"; }],
  ["a REST protocol asked", "uses the runtime", (o) => { isvcOf(o).spec.predictor.model.protocolVersion = "v2"; }],
  ["a container field of the wrong type", "Kubernetes schema", (o) => { containerOf(o).ports[0].containerPort = "h2c"; }],
  ["root filesystem writable", "read-only", (o) => { containerOf(o).securityContext.readOnlyRootFilesystem = false; }],
  ["no seccomp profile", "read-only", (o) => { delete containerOf(o).securityContext.seccompProfile; }],
  ["no storageUri", "storage", (o) => { delete isvcOf(o).spec.predictor.model.storageUri; }],
];

function evaluate(objects, dockerUid) {
  return CHECKS.map(([name, check]) => {
    try {
      return { name, failures: check(objects, dockerUid) };
    } catch (error) {
      return { name, failures: [`cannot check: ${error.message}`] };
    }
  });
}

function main() {
  const [dockerfile, file] = process.argv.slice(2);
  const user = /^USER\s+(\d+)/m.exec(fs.readFileSync(dockerfile, "utf8"));
  if (!user) throw new Error(`${dockerfile} has no numeric USER`);
  const dockerUid = Number(user[1]);
  const objects = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"))
    .map((document) => document.toJSON()).filter(Boolean);
  let failed = 0;
  for (const { name, failures } of evaluate(objects, dockerUid)) {
    console.log(`${failures.length ? "FAIL" : "ok  "} ${name}`);
    for (const failure of failures) console.log(`       ${failure}`);
    failed += failures.length ? 1 : 0;
  }
  for (const [mutation, check, mutate] of MUTATIONS) {
    const mutated = structuredClone(objects);
    mutate(mutated);
    const caught = evaluate(mutated, dockerUid)
      .filter((result) => result.failures.length > 0).map((result) => result.name);
    const ok = caught.some((name) => name.includes(check));
    console.log(`${ok ? "ok  " : "FAIL"} mutation "${mutation}" caught by "${check}"` +
                (ok ? "" : ` (failed instead: ${caught.join("; ") || "nothing"})`));
    failed += ok ? 0 : 1;
  }
  fs.writeFileSync(file.replace(/\.yaml$/, ".flags"), containerOf(objects).args.join("\n") + "\n");
  console.log(failed ? `FAIL: ${failed} check(s)` : "all KServe checks passed");
  process.exit(failed ? 1 : 0);
}

main();
