"""Live attnserve servers for the package's tests: ATTNSERVE_BINARY started on free loopback
ports, stopped with SIGTERM at the end of each module."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# The NumPy reference (float64) of examples/python, independent of the package's code.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "python"))


class Server:
    def __init__(self, *flags):
        self.folder = tempfile.mkdtemp(prefix="attnserve-pytest-")
        self.log = open(os.path.join(self.folder, "server.log"), "w+")
        self.process = subprocess.Popen(
            [os.environ["ATTNSERVE_BINARY"], "--address=127.0.0.1", "--port=0",
             "--metrics_port=0", "--drain_grace_seconds=0", "--threads=2", *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        # Sanitized builds on a loaded 2-core machine have taken over 20 s to start.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.log.seek(0)
            found = re.search(r"listening on 127\.0\.0\.1:(\d+),", self.log.read())
            if found:
                self.port = int(found.group(1))
                self.target = f"127.0.0.1:{self.port}"
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.log.seek(0)
        said = self.log.read()  # before stop() removes the folder
        self.stop()
        raise RuntimeError(f"attnserve did not start within 60 s: {said}")

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    running = Server("--accept_compressed_requests")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """A CA, and server and client certificates it signed (for 127.0.0.1 and localhost)."""
    folder = tmp_path_factory.mktemp("certificates")

    def openssl(*arguments):
        subprocess.run(["openssl", *arguments], cwd=folder, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.crt")
    for who in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout",
                f"{who}.key", "-out", f"{who}.csr")
        (folder / f"{who}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-extfile", f"{who}.ext", "-out",
                f"{who}.crt")
    return folder


@pytest.fixture(scope="module")
def secure_server(certificates):
    """Mutual TLS and a bearer token ("pytest-token")."""
    (certificates / "tokens").write_text("pytest-token\n")
    running = Server(f"--tls_cert={certificates / 'server.crt'}",
                     f"--tls_key={certificates / 'server.key'}",
                     f"--tls_client_ca={certificates / 'ca.crt'}",
                     f"--auth_token_file={certificates / 'tokens'}")
    yield running
    running.stop()
