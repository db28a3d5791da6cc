"""A caller with the token declares 60 MiB messages on 16 streams and stops sending: past
--message_timeout_seconds the server must end every one of those calls (a reset or a status),
so that it holds none of their bytes. Before the watchdog, they stayed open as long as the
connection did.

usage: stalled_message_test.py PORT TOKEN_FILE
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from raw_http2 import partial_messages  # noqa: E402


def main():
    port = int(sys.argv[1])
    token = open(sys.argv[2]).read().strip()
    started = time.monotonic()
    statuses, sent = partial_messages(
        port, "/attnserve.v1.AttentionService/Attend", streams=16, declared_bytes=60 << 20,
        headers=[("authorization", f"Bearer {token}")], timeout_s=15.0)
    elapsed = time.monotonic() - started
    print(f"statuses {statuses} after {sent} bytes sent, {elapsed:.1f} s")
    if any(status is None for status in statuses):
        print("FAIL: a stalled call was still open after 15 s")
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
