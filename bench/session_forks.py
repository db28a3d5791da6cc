#!/usr/bin/env python3
"""The memory of forks: one session of CONTEXT tokens (H 32, Hkv 8, D 128,
bf16 cache, one layer), FORKS forks of it, each fork then decoding STEPS
tokens of its own; the server's KV gauges (attnserve_kv_cache_bytes and
_shared_bytes) after each phase, next to one copy of the parent's pages and
the forks' own new pages.

  bench/session_forks.py [--context=4096] [--forks=64] [--steps=1] \\
      [ATTNSERVE [STUBS_DIR]]
"""
import argparse
import sys

from bench_server import add_server_arguments, scrape, start_attnserve

def main():
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--forks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, args.stubs)
    import grpc  # noqa: E402
    import numpy as np  # noqa: E402
    from attnserve.v1 import attention_pb2 as pb  # noqa: E402
    from attnserve.v1 import attention_pb2_grpc as rpc  # noqa: E402

    server, port, metrics_port = start_attnserve(args.attnserve)
    try:
        stub = rpc.AttentionServiceStub(grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]))

        def gauges():
            samples = scrape(metrics_port)
            return (samples["attnserve_kv_cache_bytes"],
                    samples["attnserve_kv_cache_shared_bytes"])

        heads, kv_heads, dim = 32, 8, 128
        rng = np.random.default_rng(3)

        def tensor(shape):
            values = rng.uniform(-1, 1, shape).astype(np.float32)
            return pb.Tensor(dtype=pb.FLOAT32, shape=list(shape), data=values.tobytes())

        parent = stub.CreateSession(pb.CreateSessionRequest(
            num_layers=1, num_heads=heads, num_kv_heads=kv_heads, key_dim=dim,
            dtype=pb.BFLOAT16), timeout=30).session.session_id
        length, chunk = 0, 1024
        while length < args.context:
            tokens = min(chunk, args.context - length)
            step = pb.SessionStep(session_id=parent, expected_length=length,
                                  key=tensor((kv_heads, tokens, dim)),
                                  value=tensor((kv_heads, tokens, dim)))
            result = stub.Step(pb.StepRequest(steps=[step]), timeout=60).results[0]
            assert not result.HasField("error"), result.error.message
            length = result.length
        one_copy, _ = gauges()
        children = [stub.ForkSession(pb.ForkSessionRequest(session_id=parent), timeout=30)
                    .session.session_id for _ in range(args.forks)]
        forked, shared = gauges()
        for child in children:
            for step_index in range(args.steps):
                step = pb.SessionStep(session_id=child, expected_length=length + step_index,
                                      key=tensor((kv_heads, 1, dim)),
                                      value=tensor((kv_heads, 1, dim)),
                                      query=tensor((heads, 1, dim)))
                result = stub.Step(pb.StepRequest(steps=[step]), timeout=30).results[0]
                assert not result.HasField("error"), result.error.message
        decoded, shared_after = gauges()
        page = 64 * kv_heads * 2 * dim * 2
        own = args.forks * -(-((length % 64) + args.steps) // 64) * page
        print(f"attnserve session forks: one session of {length} tokens (H={heads} "
              f"Hkv={kv_heads} D={dim}, bf16 cache, pages of 64 tokens = {page} bytes)")
        print(f"one copy: {one_copy / 2**20:.1f} MiB; after {args.forks} forks: "
              f"{forked / 2**20:.1f} MiB ({forked / one_copy:.3f}x), shared "
              f"{shared / 2**20:.1f} MiB")
        print(f"after {args.steps} decode step(s) per fork: {decoded / 2**20:.1f} MiB = "
              f"{decoded / (one_copy + own):.3f}x (one copy + the forks' own new pages, "
              f"{own / 2**20:.1f} MiB); shared {shared_after / 2**20:.1f} MiB")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
