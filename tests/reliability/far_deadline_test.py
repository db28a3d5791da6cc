"""grpc-timeout goes up to 99999999H (11,000 years). A deadline past 2262 does not fit
std::chrono::system_clock's nanoseconds; it must mean "no deadline" on Attend and
MultiHeadAttention, never DEADLINE_EXCEEDED "the deadline passed before the compute started".
gRPC's own clients cannot send such a header, so this uses raw_http2.

usage: far_deadline_test.py PORT STUBS_DIR (hostile_http2_test.sh runs it)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, sys.argv[2])
from attend_messages import tensor  # noqa: E402
from attnserve.v1 import attention_pb2  # noqa: E402
from raw_http2 import exit_with, unary_call  # noqa: E402

SERVICE = "/attnserve.v1.AttentionService/"


def attend():
    request = attention_pb2.AttendRequest()
    tensor(request.query, [1, 2, 3, 4], 0.5)
    tensor(request.key, [1, 1, 5, 4], 0.25)
    tensor(request.value, [1, 1, 5, 4], 1.0)
    return request.SerializeToString()


def multi_head():
    request = attention_pb2.MultiHeadAttentionRequest()
    tensor(request.query_input, [1, 3, 64], 0.5)
    request.weights_name = "demo"
    return request.SerializeToString()


def main():
    port = int(sys.argv[1])
    failures = []
    for rpc, message in (("Attend", attend()), ("MultiHeadAttention", multi_head())):
        for timeout in ("10S", "2000000H", "2200000H", "99999999H"):
            status, text = unary_call(port, SERVICE + rpc, message,
                                      headers=[("grpc-timeout", timeout)])
            print(f"{rpc} grpc-timeout {timeout}: status {status} {text}")
            if status != 0:
                failures.append(f"{rpc} with grpc-timeout {timeout}: {status} {text}")
    exit_with(failures)


if __name__ == "__main__":
    main()
