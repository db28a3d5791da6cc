"""gRPC core's own error lines, which quote header values a client sent (an invalid
grpc-timeout, say), go through the server's log: quoted and escaped, so that a value holding a
newline and a JSON record cannot forge a log line or an access-log record, and at most one
every 10 s from each place in gRPC's sources, so that a client cannot flood the log (until
2026-12-07 each call wrote a raw line: 2,000 in 0.4 s from one connection).

usage: grpc_log_lines_test.py PORT SERVER_LOG (hostile_http2_test.sh runs it)
"""
import json
import socket
import sys
import time

import h2.config
import h2.connection

CALLS = 300
FORGED = '{"rpc":"PutWeights","code":"OK","peer":"ipv4:10.9.9.9:1","forged":%d}'


def main():
    port, log_path = int(sys.argv[1]), sys.argv[2]
    config = h2.config.H2Configuration(client_side=True, header_encoding=None,
                                       validate_outbound_headers=False,
                                       normalize_outbound_headers=False)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    for i in range(CALLS):  # each value differs: HPACK parses every one
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [
            (b":method", b"POST"), (b":scheme", b"http"),
            (b":path", b"/attnserve.v1.AttentionService/ListWeights"),
            (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"grpc-timeout", b"1x\n" + (FORGED % i).encode() + b"\n\x1b[31m")])
        conn.send_data(stream, b"\x00\x00\x00\x00\x00", end_stream=True)
        sock.sendall(conn.data_to_send())
        if i % 50 == 0:  # read what came, so that flow control never stops the calls
            sock.settimeout(0.05)
            try:
                while sock.recv(65536):
                    pass
            except (socket.timeout, BlockingIOError):
                pass
            sock.settimeout(10)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # the answers, and the log written meanwhile
        sock.settimeout(0.2)
        try:
            if not sock.recv(65536):
                break
        except socket.timeout:
            pass
    sock.close()
    time.sleep(0.5)
    failures = []
    with open(log_path, "rb") as log:
        lines = log.read().decode("utf-8", "replace").splitlines()
    for line in lines:
        if line.startswith("{"):
            try:
                if "forged" in json.loads(line):
                    failures.append(f"a forged record stands as a log line: {line[:120]}")
            except ValueError:
                pass
        if "\x1b" in line:
            failures.append(f"an escape sequence reached the log: {line[:120]!r}")
    parse_lines = [line for line in lines if "hpack_parser" in line or "metadata" in line]
    if not parse_lines:
        failures.append("no line for the malformed headers: is gRPC's log routed elsewhere?")
    elif len(parse_lines) > 3:
        failures.append(f"{len(parse_lines)} lines for {CALLS} malformed headers within seconds, "
                        f"expected at most one from each place: {parse_lines[:3]}")
    elif not all(line.startswith("attnserve: grpc ") and '\\n{\\"rpc\\"' in line
                 for line in parse_lines):
        failures.append(f"the lines are not quoted and escaped: {parse_lines}")
    print(f"grpc_log_lines: {len(parse_lines)} line(s) for {CALLS} malformed headers: "
          f"{parse_lines[:1]}")
    if failures:
        for failure in failures:
            print("FAIL:", failure)
        sys.exit(1)


if __name__ == "__main__":
    main()
