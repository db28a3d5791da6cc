"""Connections with no call open are closed after --max_connection_idle_seconds (gRPC's
max_connection_idle: a GOAWAY, then the close), so that ones a client abandoned, or whose peer
vanished without closing, give their descriptor back (before: held until the transport's
keepalive looked, after two hours, or for ever). A connection with a stream open stays. A
connection that never sends HTTP/2's preface is closed after --handshake_timeout_seconds (before
2026-12-07: gRPC's 120 s, a slowloris flood's connections holding their places under
--max_connections that long).

usage: idle_connection_test.py PORT idle IDLE_SECONDS       (--max_connection_idle_seconds)
       idle_connection_test.py PORT handshake SECONDS       (--handshake_timeout_seconds, with
                                                             the idle limit far off: it ends a
                                                             silent connection too)
"""
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h2.config  # noqa: E402
import h2.connection  # noqa: E402
import h2.events  # noqa: E402
from raw_http2 import exit_with  # noqa: E402

ATTEND_STREAM = "/attnserve.v1.AttentionService/AttendStream"


def connect(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    return sock, conn


def ended_within(sock, conn, seconds, goaway_ends=False):
    """Seconds until the server closed the connection (or, with `goaway_ends`, sent GOAWAY), or
    None if that did not come within `seconds` (the client answers the server's SETTINGS and
    PINGs meanwhile)."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionError:
            return time.monotonic() - started
        if not data:
            return time.monotonic() - started
        for event in conn.receive_data(data):
            if goaway_ends and isinstance(event, h2.events.ConnectionTerminated):
                return time.monotonic() - started
        pending = conn.data_to_send()
        if pending:
            sock.sendall(pending)
    return None


def silent_ended_within(port, seconds):
    """Seconds until the server closed a connection that sends nothing, or None."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=0.5)
    started = time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - started
            except socket.timeout:
                continue
            except ConnectionError:
                return time.monotonic() - started
        return None
    finally:
        sock.close()


def check_ended(failures, what, ended, limit):
    """Adds to `failures` unless `ended` (seconds, or None: not within limit + 10 s) is at least
    half of `limit`."""
    print(f"{what} was closed after {ended} s (limit {limit} s)")
    if ended is None:
        failures.append(f"{what} stayed open {limit + 10} s")
    elif ended < limit * 0.5:
        failures.append(f"{what} ended after {ended:.2f} s, before the limit of {limit} s")


def handshake_timeout(port, handshake):
    failures = []
    check_ended(failures, "a connection that sent nothing",
                silent_ended_within(port, handshake + 10), handshake)
    exit_with(failures)


def main():
    port, mode, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    if mode == "handshake":
        handshake_timeout(port, seconds)
        return
    idle = seconds
    failures = []
    # A stream open (an AttendStream that sends nothing yet) keeps its connection.
    busy_sock, busy = connect(port)
    stream = busy.get_next_available_stream_id()
    busy.send_headers(stream, [(":method", "POST"), (":scheme", "http"),
                               (":path", ATTEND_STREAM), (":authority", "localhost"),
                               ("content-type", "application/grpc"), ("te", "trailers")])
    busy_sock.sendall(busy.data_to_send())
    idle_sock, quiet = connect(port)
    check_ended(failures, "a connection with no call open",
                ended_within(idle_sock, quiet, idle + 10), idle)
    kept = ended_within(busy_sock, busy, 1, goaway_ends=True)
    print(f"the connection with a stream open: {'kept' if kept is None else 'ended'}")
    if kept is not None:
        failures.append("a connection with a stream open was ended as idle")
    idle_sock.close()
    busy_sock.close()
    exit_with(failures)


if __name__ == "__main__":
    main()
