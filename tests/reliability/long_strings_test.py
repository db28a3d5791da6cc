"""Client strings the server echoes in its errors: a Health.Check (open without a token) and a
DeleteWeights naming a 60 MiB service or weight set, and an Attend whose query has 5,000,000
dimensions. Before, the check got no answer in 40 s with the server at 390 MB, the delete ended
"Stream removed" after 7.9 s, and the shape came back as a 15-70 MB error message. Each must now
be answered within 10 s with a message of at most 1 KiB, the server growing by less than
GROWTH_BOUND (the 60 MiB message itself, which gRPC buffers whole, and its parse).

usage: long_strings_test.py PORT SERVER_PID STUBS_DIR
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, sys.argv[3])
from attnserve.v1 import attention_pb2  # noqa: E402
from raw_http2 import Calls, exit_with, rss_bytes  # noqa: E402

INVALID_ARGUMENT = 3
# 192 MiB, and what a sanitized build keeps besides (hostile_http2_test.sh).
GROWTH_BOUND = (128 << 20) + int(os.environ.get("ATTNSERVE_RSS_OVERHEAD_BYTES", 64 << 20))
NAME_BYTES = 60 << 20


def varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def main():
    port, pid = int(sys.argv[1]), int(sys.argv[2])
    name = b"n" * NAME_BYTES
    health = b"\x0a" + varint(len(name)) + name  # HealthCheckRequest.service
    delete = attention_pb2.DeleteWeightsRequest(name=name.decode()).SerializeToString()
    attend = attention_pb2.AttendRequest()
    attend.query.dtype = attention_pb2.FLOAT32
    attend.query.shape.extend([1] * 5_000_000)
    cases = [("/grpc.health.v1.Health/Check", health),
             ("/attnserve.v1.AttentionService/DeleteWeights", delete),
             ("/attnserve.v1.AttentionService/Attend", attend.SerializeToString())]
    failures = []
    for path, message in cases:
        base = peak = rss_bytes(pid)
        done = threading.Event()

        def watch():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, rss_bytes(pid))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        calls = Calls(port)
        stream = calls.start(path, message)
        calls.pump(10)
        calls.close()
        elapsed = time.monotonic() - started
        done.set()
        watcher.join()
        status, text = calls.statuses[stream], calls.messages.get(stream, "")
        print(f"{path} with {len(message)} bytes: {status} after {elapsed:.1f} s, message of "
              f"{len(text)} bytes ({text[:100]}...); RSS +{(peak - base) / 2**20:.0f} MiB")
        if status != INVALID_ARGUMENT:
            failures.append(f"{path}: {status}, expected INVALID_ARGUMENT within 10 s")
        if len(text) > 1024:
            failures.append(f"{path}: a message of {len(text)} bytes")
        if peak - base > GROWTH_BOUND:
            failures.append(f"{path}: RSS grew {peak - base} bytes, over {GROWTH_BOUND}")
    exit_with(failures)


if __name__ == "__main__":
    main()
