"""Rapid reset (CVE-2023-44487's pattern): one connection opens Attend streams and resets each at
once, up to 50,000 times, no token needed. gRPC 1.51 has no cap on the reset rate; the server's
own (--max_client_resets_per_second, given here as argv[4]) must shut the connection down long
before the 50,000 are sent (with the cap at 0, all are sent). Either way the server's RSS must stay
bounded (before: 200,000 resets grew it from 127 MB to 2.52 GB) and a well-behaved client on
another connection must keep getting its small Attends answered within a stated bound (before:
one took 12.4 s).

usage: rapid_reset_test.py PORT SERVER_PID STUBS_DIR MAX_CLIENT_RESETS_PER_SECOND
"""
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, sys.argv[3])
import h2.config  # noqa: E402
import h2.connection  # noqa: E402
import h2.errors  # noqa: E402
from attend_messages import attend_request  # noqa: E402
from raw_http2 import exit_with, rss_bytes, unary_call  # noqa: E402

RESETS = 50_000
# What the server may grow by, more for a sanitized build (hostile_http2_test.sh). With the cap
# on, a few MiB are seen. With it off, nothing bounds how many reset streams gRPC 1.51 holds at
# once but how far the client gets ahead of the server: 108 to 298 MiB were seen on a 2-vCPU
# AMD EPYC, and 657 MiB once in CI, with the 50,000 resets sent in 1.9 s beside other tests
# (about 13.5 KiB each: nearly all of them held at once). What the test can assert without the
# cap is what the server holds for each stream: at most the 16 KiB of the budget a stream is
# given, for all 50,000 at once.
OVERHEAD = int(os.environ.get("ATTNSERVE_RSS_OVERHEAD_BYTES", 64 << 20))
# Set by hostile_http2_test.sh for an AddressSanitizer build.
SANITIZED = os.environ.get("ATTNSERVE_SANITIZED") == "1"
GROWTH_BOUND_CAPPED = (192 << 20) + OVERHEAD
GROWTH_BOUND_UNCAPPED = RESETS * (16 << 10) + OVERHEAD
# The other client's slowest Attend. With the cap on, the guard's claim. With it off the flood
# runs its whole course at whatever pace the machine allows: 3.7 s was typical, and 10.5 s once
# in CI beside other tests, so there the bound, under the probe's 30 s deadline, asserts only
# that the other client is answered, not how soon.
PROBE_BOUND_S_CAPPED = 5.0
PROBE_BOUND_S_UNCAPPED = 25.0
ATTEND = "/attnserve.v1.AttentionService/Attend"


def main():
    port, pid, cap = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
    base = peak = rss_bytes(pid)
    message = attend_request(2, 8, 8).SerializeToString()
    probes, stop = [], threading.Event()

    def probe():
        while not stop.is_set():
            started = time.monotonic()
            try:
                status, _ = unary_call(port, ATTEND, message, timeout_s=30)
            except (OSError, ConnectionError) as error:
                status = repr(error)
            probes.append((status, time.monotonic() - started))
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    started = time.monotonic()
    resets = 0
    try:
        for i in range(RESETS):
            stream = conn.get_next_available_stream_id()
            conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"),
                                       (":path", ATTEND), (":authority", "localhost"),
                                       ("content-type", "application/grpc"), ("te", "trailers")])
            conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
            if i % 500 == 499:
                sock.sendall(conn.data_to_send())
                resets = i + 1
                peak = max(peak, rss_bytes(pid))
    except OSError as error:  # the server shut the connection down
        print(f"the connection ended after {resets} resets sent: {error!r}")
    sent = time.monotonic() - started
    for _ in range(20):  # what the server still has queued
        peak = max(peak, rss_bytes(pid))
        time.sleep(0.25)
    stop.set()
    prober.join()
    sock.close()
    slowest = max(seconds for _, seconds in probes)
    failed = [status for status, _ in probes if status != 0]
    print(f"{resets} resets in {sent:.1f} s; RSS {base / 2**20:.0f} MiB -> peak "
          f"{peak / 2**20:.0f} MiB; {len(probes)} small Attends on another connection, "
          f"slowest {slowest:.2f} s, not OK: {failed[:3]}")
    failures = []
    if cap > 0 and resets >= RESETS:
        taken = f"all {RESETS} resets were taken, over a cap of {cap} a second"
        # The guard counts the reset calls the service takes: a sanitized build, several times
        # slower, may fall behind gRPC's transport, which then drops reset calls it never
        # handed over (it did in 2 of 4 AddressSanitizer runs on 2026-12-07, the memory and the
        # other client within their bounds). The cap's tripping is the Release runs' to assert,
        # a starved server's included; a sanitized run asserts the bounds below.
        if SANITIZED:
            print(f"note: {taken} (a sanitized build fell behind)")
        else:
            failures.append(taken)
    if cap == 0 and resets < RESETS:
        failures.append(f"the connection ended after {resets} resets without a cap")
    bound = GROWTH_BOUND_CAPPED if cap > 0 else GROWTH_BOUND_UNCAPPED
    if peak > base + bound:
        failures.append(f"RSS grew {peak - base} bytes, over {bound}")
    probe_bound = PROBE_BOUND_S_CAPPED if cap > 0 else PROBE_BOUND_S_UNCAPPED
    if failed or slowest > probe_bound:
        failures.append(f"the other client's Attends: slowest {slowest:.1f} s, failed {failed[:3]}")
    exit_with(failures)


if __name__ == "__main__":
    main()
