"""With --accept_compressed_requests, compressed requests are taken but inflated with a bound:
a gzip or deflate "bomb" (256 MiB of zeros in about 256 KiB) against --max_message_bytes of
4 MiB must get RESOURCE_EXHAUSTED naming the limit, the server's RSS growing by less than 32 MiB
(the output stops past 4 MiB) (gRPC 1.51's own decompression inflated the whole message first: 1 GiB for a 1 MB
request); a small compressed Attend must be answered, and a corrupt stream refused.

With --refused, against a server with --response_compression=gzip but not
--accept_compressed_requests (so gRPC must let gzip requests through to the handlers, for its
responses to use gzip): every compressed request, bombs included, gets UNIMPLEMENTED (gzip ones
naming accept_compressed_requests) without being inflated, and a plain Attend is answered.

usage: compressed_requests_test.py PORT SERVER_PID STUBS_DIR [--refused]
"""
import gzip
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, sys.argv[3])
from attend_messages import attend_request  # noqa: E402
from raw_http2 import Calls, exit_with, rss_bytes  # noqa: E402

OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED = 0, 3, 8, 12
ATTEND = "/attnserve.v1.AttentionService/Attend"
SMALL = attend_request(2, 8, 8).SerializeToString()
COMPRESS = {"gzip": lambda data: gzip.compress(data, compresslevel=9),
            "deflate": lambda data: zlib.compress(data, 9)}


def call(port, encoding, message):
    """Sends one compressed message as flow control allows; returns (grpc-status, message)."""
    calls = Calls(port)
    try:
        stream = calls.start(ATTEND, message, headers=[("grpc-encoding", encoding)],
                             compressed=True)
        calls.pump(30)
        return calls.statuses[stream], calls.messages.get(stream, "")
    finally:
        calls.close()


def call_plain(port, message):
    """Sends one uncompressed message; returns (grpc-status, message)."""
    calls = Calls(port)
    try:
        stream = calls.start(ATTEND, message)
        calls.pump(30)
        return calls.statuses[stream], calls.messages.get(stream, "")
    finally:
        calls.close()


def refused(port, pid):
    """Every compressed request refused unread; plain ones answered."""
    failures = []
    for encoding, compress in COMPRESS.items():
        before = rss_bytes(pid)
        for name, message in (("Attend", compress(SMALL)),
                              ("bomb", compress(bytes(256 << 20))),
                              ("truncated stream", compress(SMALL)[:-8])):
            status, text = call(port, encoding, message)
            print(f"{encoding} {name}: {status} {text}")
            if status != UNIMPLEMENTED:
                failures.append(f"a {encoding} {name} got {status} {text}, expected "
                                f"UNIMPLEMENTED")
            if encoding == "gzip" and "accept_compressed_requests" not in text:
                failures.append(f"the refusal of a gzip {name} does not name "
                                f"accept_compressed_requests: {text}")
        growth = rss_bytes(pid) - before
        print(f"{encoding}: RSS grew {growth / 2**20:.1f} MiB")
        if growth > 32 << 20:
            failures.append(f"refusing {encoding} requests grew RSS by {growth} bytes")
    status, text = call_plain(port, SMALL)
    print(f"plain Attend: {status} {text}")
    if status != OK:
        failures.append(f"a plain Attend got {status} {text}")
    exit_with(failures)


def main():
    port, pid = int(sys.argv[1]), int(sys.argv[2])
    if "--refused" in sys.argv[4:]:
        return refused(port, pid)
    failures = []
    for encoding, compress in COMPRESS.items():
        status, text = call(port, encoding, compress(SMALL))
        print(f"{encoding} Attend: {status} {text}")
        if status != OK:
            failures.append(f"a {encoding}-compressed Attend got {status} {text}")
        before = rss_bytes(pid)
        bomb = compress(bytes(256 << 20))
        status, text = call(port, encoding, bomb)
        growth = rss_bytes(pid) - before
        print(f"{encoding} bomb of {len(bomb)} bytes: {status} {text}; RSS grew "
              f"{growth / 2**20:.1f} MiB")
        if status != RESOURCE_EXHAUSTED or "max_message_bytes" not in text:
            failures.append(f"a {encoding} bomb got {status} {text}")
        if growth > 32 << 20:
            failures.append(f"a {encoding} bomb grew RSS by {growth} bytes")
        status, text = call(port, encoding, compress(SMALL)[:-8])
        print(f"truncated {encoding}: {status} {text}")
        if status != INVALID_ARGUMENT:
            failures.append(f"a truncated {encoding} stream got {status} {text}")
    exit_with(failures)


if __name__ == "__main__":
    main()
