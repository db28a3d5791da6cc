"""A caller with the token declares 60 MiB messages on 16 streams and stops sending: past
--message_timeout_seconds the server must end every one of those Attend calls (a reset or a
status), so that it holds none of their bytes. Before the watchdog, they stayed open as long as
the connection did. The same for AttendStream past --stream_idle_timeout_seconds: 16 streams
with a stalled message and 16 that send nothing at all.

usage: stalled_message_test.py PORT TOKEN_FILE
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from raw_http2 import Calls, exit_with, partial_messages  # noqa: E402

SERVICE = "/attnserve.v1.AttentionService/"


def main():
    port = int(sys.argv[1])
    token = open(sys.argv[2]).read().strip()
    headers = [("authorization", f"Bearer {token}")]
    failures = []
    for method in ("Attend", "AttendStream"):
        started = time.monotonic()
        statuses, sent = partial_messages(port, SERVICE + method, streams=16,
                                          declared_bytes=60 << 20, headers=headers,
                                          timeout_s=15.0)
        elapsed = time.monotonic() - started
        print(f"{method}: statuses {statuses} after {sent} bytes sent, {elapsed:.1f} s")
        if any(status is None for status in statuses):
            failures.append(f"a stalled {method} call was still open after 15 s")
    idle = Calls(port)
    for _ in range(16):
        idle.start(SERVICE + "AttendStream", None, headers=headers, end_stream=False)
    started = time.monotonic()
    idle.pump(15)
    idle.close()
    print(f"idle AttendStreams: {list(idle.statuses.values())}, "
          f"{time.monotonic() - started:.1f} s")
    if idle.open_calls():
        failures.append(f"{idle.open_calls()} idle AttendStreams were still open after 15 s")
    exit_with(failures)


if __name__ == "__main__":
    main()
