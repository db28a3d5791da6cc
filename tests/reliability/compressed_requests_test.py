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
from attnserve.v1 import attention_pb2  # noqa: E402
from raw_http2 import Calls, exit_with, rss_bytes  # noqa: E402

OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED = 0, 3, 8, 12
ATTEND = "/attnserve.v1.AttentionService/Attend"
CREATE_SESSION = "/attnserve.v1.AttentionService/CreateSession"
# Starts 08 3c: field 1, num_layers = 60, which is also a zlib header (CM 8, and
# 0x083c a multiple of 31).
SIXTY_LAYERS = attention_pb2.CreateSessionRequest(
    num_layers=60, num_heads=2, key_dim=8, dtype=attention_pb2.FLOAT32).SerializeToString()
SMALL = attend_request(2, 8, 8).SerializeToString()
COMPRESS = {"gzip": lambda data: gzip.compress(data, compresslevel=9),
            "deflate": lambda data: zlib.compress(data, 9)}


def call(port, encoding, message, path=ATTEND, compressed=True):
    """Sends one message as flow control allows, on a call naming grpc-encoding `encoding`,
    with the compressed flag set if `compressed`; returns (grpc-status, message)."""
    calls = Calls(port)
    try:
        stream = calls.start(path, message, headers=[("grpc-encoding", encoding)],
                             compressed=compressed)
        calls.pump(30)
        return calls.statuses[stream], calls.messages.get(stream, "")
    finally:
        calls.close()


def call_plain(port, message, path=ATTEND):
    """Sends one uncompressed message; returns (grpc-status, message)."""
    calls = Calls(port)
    try:
        stream = calls.start(path, message)
        calls.pump(30)
        return calls.statuses[stream], calls.messages.get(stream, "")
    finally:
        calls.close()


def look_alikes(port, encodings, compressed_status):
    """A plain message that starts as a zlib stream does is answered, with no grpc-encoding or
    each of `encodings` on its call; the same message gzip-compressed gets `compressed_status`."""
    failures = []
    plain = [(f"plain, grpc-encoding {encoding}",
              call(port, encoding, SIXTY_LAYERS, CREATE_SESSION, compressed=False), OK)
             for encoding in encodings]
    for name, status_text, expected in (
            ("plain, no grpc-encoding", call_plain(port, SIXTY_LAYERS, CREATE_SESSION), OK),
            *plain,
            ("gzip-compressed",
             call(port, "gzip", gzip.compress(SIXTY_LAYERS), CREATE_SESSION),
             compressed_status)):
        status, text = status_text
        print(f"CreateSession of 60 layers, {name}: {status} {text}")
        if status != expected:
            failures.append(f"a CreateSession of 60 layers, {name}, got {status} {text}, "
                            f"expected {expected}")
    return failures


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
    # Only gzip is enabled: gRPC itself refuses a call naming deflate.
    failures += look_alikes(port, ["gzip"], UNIMPLEMENTED)
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
        status, text = call(port, encoding, SMALL)
        print(f"plain bytes flagged {encoding}: {status} {text}")
        if status != INVALID_ARGUMENT or encoding not in text:
            failures.append(f"plain bytes flagged {encoding} got {status} {text}")
    failures += look_alikes(port, list(COMPRESS), OK)
    exit_with(failures)


if __name__ == "__main__":
    main()
