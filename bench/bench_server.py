"""What the Python benchmarks share: attnserve started on free loopback ports,
and its /metrics read as {series: value}."""
import os
import re
import socket
import subprocess
import urllib.request


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_server_arguments(parser):
    """The positional ATTNSERVE and STUBS_DIR every script here takes: the
    server binary and the Python package the build assembles (build/python)."""
    parser.add_argument("attnserve", nargs="?",
                        default=os.path.join(ROOT, "build/server/attnserve"))
    parser.add_argument("stubs", nargs="?",
                        default=os.path.join(ROOT, "build/python"))


def start_attnserve(binary, *flags):
    """Starts `binary` on 127.0.0.1 with a free gRPC and /metrics port and
    `flags`; returns (process, port, metrics_port) once it listens."""
    with socket.socket() as probe:  # --metrics_port=0 would turn /metrics off.
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--address=127.0.0.1", "--port=0", f"--metrics_port={metrics_port}",
         "--drain_grace_seconds=0", "--demo_weights=false", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = process.stdout.readline()
    ports = re.findall(r"127\.0\.0\.1:(\d+)", line)
    if len(ports) < 2:
        process.kill()
        raise SystemExit(f"attnserve did not start: {line}")
    return process, int(ports[0]), metrics_port


def scrape(metrics_port):
    """Every series of the server's /metrics, by its name and labels."""
    text = urllib.request.urlopen(
        f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    samples = {}
    for row in text.splitlines():
        if row and not row.startswith("#"):
            name, value = row.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
