#!/usr/bin/env python3
"""Decode through the server, by the server's own timing: a stateless Attend
of (1, H 32, Hkv 8, Lq 1, CONTEXT, D 128) sent as FLOAT32, BFLOAT16 and
FLOAT16, then a decode Step over a session of CONTEXT tokens (f32 and bf16
caches). Prints the medians of each call's compute_us and server_us (and the
client's round trip) over CALLS calls, after ten uncounted ones.

  bench/decode_compute.py [--context=4096] [--calls=50] [ATTNSERVE [STUBS_DIR]]
"""
import argparse
import statistics
import sys
import time

from bench_server import add_server_arguments, start_attnserve

HEADS, KV_HEADS, DIM = 32, 8, 128
WARMUP = 10


def main():
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    sys.path.insert(0, args.stubs)
    import grpc  # noqa: E402
    import numpy as np  # noqa: E402
    from attnserve.v1 import attention_pb2 as pb  # noqa: E402
    from attnserve.v1 import attention_pb2_grpc as rpc  # noqa: E402

    rng = np.random.default_rng(1)

    def tensor(shape, dtype):
        values = rng.standard_normal(shape).astype(np.float32)
        if dtype == "FLOAT32":
            data = values.tobytes()
        elif dtype == "BFLOAT16":  # Truncated: any bf16 values will do.
            data = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            data = values.astype(np.float16).tobytes()
        return pb.Tensor(dtype=getattr(pb, dtype), shape=list(shape), data=data)

    def timed(call):
        compute, server, client = [], [], []
        for i in range(WARMUP + args.calls):
            start = time.perf_counter()
            response = call()
            elapsed = time.perf_counter() - start
            if i >= WARMUP:
                compute.append(response.timing.compute_us)
                server.append(response.timing.server_us)
                client.append(elapsed * 1e6)
        median = statistics.median
        return (f"compute {median(compute):.0f} us, server {median(server):.0f}"
                f" us, round trip {median(client):.0f} us")

    server, port, _ = start_attnserve(args.attnserve)
    try:
        stub = rpc.AttentionServiceStub(grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_send_message_length", 64 << 20),
                     ("grpc.max_receive_message_length", 64 << 20)]))
        for dtype in ("FLOAT32", "BFLOAT16", "FLOAT16"):
            request = pb.AttendRequest(
                query=tensor((1, HEADS, 1, DIM), dtype),
                key=tensor((1, KV_HEADS, args.context, DIM), dtype),
                value=tensor((1, KV_HEADS, args.context, DIM), dtype),
                options=pb.AttentionOptions(output_dtype=pb.FLOAT32))
            print(f"Attend {dtype} inputs, context {args.context}: "
                  f"{timed(lambda: stub.Attend(request))}")
        for cache in ("FLOAT32", "BFLOAT16"):
            session = stub.CreateSession(pb.CreateSessionRequest(
                num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS,
                key_dim=DIM, value_dim=DIM, dtype=getattr(pb, cache),
                max_tokens=args.context + WARMUP + args.calls)).session
            length = 0
            while length < args.context:
                chunk = min(1024, args.context - length)
                stub.Step(pb.StepRequest(steps=[pb.SessionStep(
                    session_id=session.session_id, expected_length=length,
                    key=tensor((KV_HEADS, chunk, DIM), "FLOAT32"),
                    value=tensor((KV_HEADS, chunk, DIM), "FLOAT32"))]))
                length += chunk
            query = tensor((HEADS, 1, DIM), "FLOAT32")
            key = tensor((KV_HEADS, 1, DIM), "FLOAT32")
            value = tensor((KV_HEADS, 1, DIM), "FLOAT32")
            state = {"length": length}

            def step():
                response = stub.Step(pb.StepRequest(steps=[pb.SessionStep(
                    session_id=session.session_id,
                    expected_length=state["length"], key=key, value=value,
                    query=query)]))
                result = response.results[0]
                if result.HasField("error") and result.error.code != 0:
                    raise SystemExit(f"step failed: {result.error.message}")
                state["length"] += 1
                return response

            print(f"Step, {cache} cache of {args.context} tokens: {timed(step)}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
