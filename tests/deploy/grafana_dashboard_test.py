#!/usr/bin/env python3
"""Checks deploy/grafana/attnserve-dashboard.json: valid JSON, the panels the metrics issue asks
for, every PromQL expression parses (promtool check rules), and every metric it reads is one
attnserve exports (listed in docs/metrics.md).

usage: grafana_dashboard_test.py REPO_ROOT
"""
import json
import os
import re
import subprocess
import sys
import tempfile

root = sys.argv[1]
dashboard = json.load(open(os.path.join(root, "deploy/grafana/attnserve-dashboard.json")))
documented = open(os.path.join(root, "docs/metrics.md")).read()

failures = []
titles = " | ".join(panel["title"] for panel in dashboard["panels"])
for needed in ["by RPC and code", "latency p50 / p99", "Queue wait", "Batch size", "FLOP/s",
               "In flight", "Sessions", "KV cache bytes", "Session removals", "steps per call"]:
    if needed not in titles:
        failures.append(f"no panel for '{needed}' (panels: {titles})")

expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
for expression in expressions:
    for metric in set(re.findall(r"\battnserve_[a-z_]+", expression)):
        base = re.sub(r"_(bucket|sum|count)$", "", metric)
        if f"`{base}`" not in documented:
            failures.append(f"{metric} is not documented in docs/metrics.md")

with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as rules:
    rules.write("groups:\n  - name: dashboard\n    rules:\n")
    for i, expression in enumerate(expressions):
        concrete = expression.replace("$__rate_interval", "1m").replace("$namespace", ".*")
        rules.write(f"      - record: dashboard:expr{i}\n        expr: {json.dumps(concrete)}\n")
check = subprocess.run(["promtool", "check", "rules", rules.name], capture_output=True,
                       text=True)
os.unlink(rules.name)
if check.returncode != 0:
    failures.append("promtool check rules:\n" + check.stdout + check.stderr)

for failure in failures:
    print("FAIL:", failure)
print(f"dashboard: {len(expressions)} expressions checked, {len(failures)} problems")
sys.exit(1 if failures else 0)
