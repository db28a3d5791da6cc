"""A caller without the token declares 60 MiB messages on 16 streams and sends only the first
bytes: the server must answer each UNAUTHENTICATED on its headers, without waiting for (and
buffering) the message, and its RSS must not grow by the declared bytes. Before the gate moved
to the headers, each stream's bytes were held until the connection closed (809 MB for 16).

usage: unauthenticated_partial_test.py PORT SERVER_PID
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from raw_http2 import partial_messages, rss_bytes  # noqa: E402

UNAUTHENTICATED = 16


def main():
    port, pid = int(sys.argv[1]), int(sys.argv[2])
    before = rss_bytes(pid)
    for rpc in ("Attend", "MultiHeadAttention", "PutWeights"):
        statuses, sent = partial_messages(
            port, f"/attnserve.v1.AttentionService/{rpc}", streams=16,
            declared_bytes=60 << 20, timeout_s=10.0)
        print(f"{rpc}: statuses {statuses} after {sent} bytes sent")
        if statuses != [UNAUTHENTICATED] * 16:
            print(f"FAIL: {rpc} without a token was not refused on its headers")
            sys.exit(1)
    growth = rss_bytes(pid) - before
    print(f"RSS grew {growth / 2**20:.1f} MiB")
    if growth > 64 << 20:
        print("FAIL: the server held the partial messages")
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
