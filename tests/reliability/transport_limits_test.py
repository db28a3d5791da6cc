"""HTTP/2 limits a client without a token meets first: the server advertises
MAX_CONCURRENT_STREAMS (gRPC 1.51 advertises none by default), and refuses a gzip-compressed
request (a "bomb" of 32 MiB of zeros in 32 KiB) with UNIMPLEMENTED before inflating it; its RSS
must not grow by the inflated size. Before: the bomb was inflated whole, then refused by size.

usage: transport_limits_test.py PORT SERVER_PID EXPECTED_MAX_STREAMS
"""
import gzip
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from raw_http2 import exit_with, rss_bytes, server_max_concurrent_streams, unary_call  # noqa: E402,E501

UNIMPLEMENTED = 12


def main():
    port, pid, expected_streams = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    failures = []
    streams = server_max_concurrent_streams(port)
    print(f"MAX_CONCURRENT_STREAMS {streams}")
    if streams != expected_streams:
        failures.append(f"MAX_CONCURRENT_STREAMS is {streams}, expected {expected_streams}")

    bomb = gzip.compress(bytes(32 << 20), compresslevel=9)
    before = rss_bytes(pid)
    for encoding in ("gzip", "deflate"):
        status, text = unary_call(port, "/attnserve.v1.AttentionService/Attend", bomb,
                                  headers=[("grpc-encoding", encoding)], compressed=True)
        print(f"{encoding} request of {len(bomb)} bytes: status {status} {text}")
        if status != UNIMPLEMENTED:
            failures.append(f"a {encoding} request got {status} {text}, expected UNIMPLEMENTED")
    growth = rss_bytes(pid) - before
    print(f"RSS grew {growth / 2**20:.1f} MiB")
    if growth > 16 << 20:
        failures.append(f"RSS grew {growth} bytes: the bomb was inflated")
    exit_with(failures)


if __name__ == "__main__":
    main()
