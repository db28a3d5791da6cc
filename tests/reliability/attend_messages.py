"""AttendRequests for the reliability tests' Python clients (attention_pb2 must be importable:
the tests put the generated stubs on sys.path first).

    request = attend_request(heads=16, length=1024, dim=64)   # [1, 16, 1024, 64] each
    small = attend_request(heads=2, length=8, dim=8)          # what the well-behaved clients send
"""
import struct

from attnserve.v1 import attention_pb2


def tensor(proto, shape, fill):
    """Fills a Tensor proto: FLOAT32 of `shape`, every element `fill`."""
    proto.dtype = attention_pb2.FLOAT32
    proto.shape.extend(shape)
    count = 1
    for d in shape:
        count *= d
    proto.data = struct.pack("<f", fill) * count


def attend_request(heads, length, dim, weights=False):
    """Q, K and V of [1, heads, length, dim]; PER_HEAD weights asked for if `weights`."""
    request = attention_pb2.AttendRequest()
    tensor(request.query, [1, heads, length, dim], 0.5)
    tensor(request.key, [1, heads, length, dim], 0.25)
    tensor(request.value, [1, heads, length, dim], 1.0)
    if weights:
        request.options.return_weights = attention_pb2.AttentionOptions.PER_HEAD
    return request
