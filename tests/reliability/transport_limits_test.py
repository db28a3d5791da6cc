"""HTTP/2 limits a client without a token meets first: the server advertises
MAX_CONCURRENT_STREAMS (gRPC 1.51 advertises none by default), and refuses a gzip-compressed
request (a "bomb" of 32 MiB of zeros in 32 KiB) with UNIMPLEMENTED before inflating it; its RSS
must not grow by the inflated size. Before: the bomb was inflated whole, then refused by size.
And a message of 40 million one-byte integers (which would parse into 8 bytes each) is refused
before its parse, naming the field, for Attend and ModelInfer alike.

usage: transport_limits_test.py PORT SERVER_PID EXPECTED_MAX_STREAMS
"""
import gzip
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from raw_http2 import Calls, exit_with, rss_bytes, server_max_concurrent_streams, unary_call  # noqa: E402,E501

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
    integer_flood(port, pid, failures)
    exit_with(failures)


def delimited(number, payload):
    """A length-delimited protobuf field, by hand."""
    def varint(value):
        out = bytearray()
        while True:
            out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
            value >>= 7
            if not value:
                return bytes(out)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def integer_flood(port, pid, failures):
    """40 million one-byte integers in a packed repeated field (a tensor's shape) parse into
    320 MB: the server must count them and refuse before it parses, naming the field, in
    Attend and in the Open Inference Protocol's ModelInfer."""
    packed = bytes([1]) * (40 << 20)
    attend = delimited(1, delimited(2, packed))  # AttendRequest.query.shape
    infer = delimited(5, delimited(3, packed))   # ModelInferRequest.inputs.shape
    for method, message in (("/attnserve.v1.AttentionService/Attend", attend),
                            ("/inference.GRPCInferenceService/ModelInfer", infer)):
        before = rss_bytes(pid)
        calls = Calls(port)  # Sends as flow control allows.
        try:
            stream = calls.start(method, message)
            calls.pump(60)
            status, text = calls.statuses[stream], calls.messages.get(stream, "")
        finally:
            calls.close()
        growth = rss_bytes(pid) - before
        print(f"{method}: {len(packed)} packed integers: {status} {text}; RSS grew "
              f"{growth / 2**20:.1f} MiB")
        if status != 3 or "repeated integer fields" not in text or ".shape" not in text:
            failures.append(f"{method}: an integer flood got {status} {text}")
        # The message itself is held while it arrives; its parse would add 8 bytes an integer.
        if growth > 3 * len(packed):
            failures.append(f"{method}: an integer flood grew RSS by {growth} bytes")


if __name__ == "__main__":
    main()
