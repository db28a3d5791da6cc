#!/usr/bin/env python3
"""A flood of session creations and appends far past --kv_cache_bytes, and the
server's memory meanwhile.

Starts attnserve with a small KV budget, then THREADS clients each create a
session and append CHUNK tokens to it, over and over, for SECONDS: many times
the budget in all. Every answer is counted by code (OK; NOT_FOUND for a step
whose session was evicted before it came; RESOURCE_EXHAUSTED under
--kv_eviction=none). The server's resident memory (VmRSS from /proc) is
sampled every 50 ms; the report gives it before the flood and at its peak,
next to the budget and the KV gauges and eviction counter the server exports.

  bench/session_flood.py [--kv_cache_bytes=N] [--seconds=S] [--threads=T] \\
      [--eviction=lru|none] [--buffer_pool_bytes=N] [ATTNSERVE [STUBS_DIR]]

ATTNSERVE defaults to build/server/attnserve, STUBS_DIR to
build/python (the Python package the build assembles, its stubs in attnserve/v1).
"""
import argparse
import sys
import threading
import time

from bench_server import add_server_arguments, scrape, start_attnserve

def main():
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--kv_cache_bytes", type=int, default=64 << 20)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--eviction", default="lru")
    parser.add_argument("--buffer_pool_bytes", type=int, default=256 << 20)
    args = parser.parse_args()
    sys.path.insert(0, args.stubs)
    import grpc  # noqa: E402
    import numpy as np  # noqa: E402
    from attnserve.v1 import attention_pb2 as pb  # noqa: E402
    from attnserve.v1 import attention_pb2_grpc as rpc  # noqa: E402

    server, port, metrics_port = start_attnserve(
        args.attnserve, f"--kv_cache_bytes={args.kv_cache_bytes}",
        f"--kv_eviction={args.eviction}", "--max_sessions=100000",
        f"--buffer_pool_bytes={args.buffer_pool_bytes}")
    try:
        def rss():
            with open(f"/proc/{server.pid}/status") as status:
                for field in status:
                    if field.startswith("VmRSS:"):
                        return int(field.split()[1]) * 1024
            return 0

        heads, dim = 8, 128
        tokens = np.random.default_rng(1).uniform(-1, 1, (heads, args.chunk, dim)).astype(
            np.float32)
        tensor = pb.Tensor(dtype=pb.FLOAT32, shape=list(tokens.shape), data=tokens.tobytes())
        time.sleep(0.5)
        baseline = rss()
        peak = [baseline]
        counts = {}
        lock = threading.Lock()
        stop = time.monotonic() + args.seconds

        def flood():
            stub = rpc.AttentionServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
            while time.monotonic() < stop:
                outcome = "OK"
                try:
                    created = stub.CreateSession(pb.CreateSessionRequest(
                        num_layers=1, num_heads=heads, key_dim=dim, dtype=pb.FLOAT32),
                        timeout=30)
                    length = 0
                    for _ in range(4):
                        step = pb.SessionStep(session_id=created.session.session_id,
                                              expected_length=length, key=tensor, value=tensor)
                        result = stub.Step(pb.StepRequest(steps=[step]), timeout=30).results[0]
                        if result.HasField("error"):
                            outcome = grpc.StatusCode(
                                [c for c in grpc.StatusCode
                                 if c.value[0] == result.error.code][0]).name
                            break
                        length = result.length
                except grpc.RpcError as error:
                    outcome = error.code().name
                with lock:
                    counts[outcome] = counts.get(outcome, 0) + 1

        workers = [threading.Thread(target=flood) for _ in range(args.threads)]
        for worker in workers:
            worker.start()
        while any(worker.is_alive() for worker in workers):
            peak[0] = max(peak[0], rss())
            time.sleep(0.05)
        samples = scrape(metrics_port)
        appended = samples.get("attnserve_session_tokens_appended_total", 0)
        evicted = samples.get('attnserve_session_removals_total{reason="evicted"}', 0)
        token_bytes = heads * dim * 2 * 4
        print(f"attnserve session flood: {args.threads} threads x {args.seconds:.0f} s, "
              f"H={heads} D={dim} f32, {args.chunk}-token appends, "
              f"--kv_cache_bytes={args.kv_cache_bytes} --kv_eviction={args.eviction} "
              f"--buffer_pool_bytes={args.buffer_pool_bytes}")
        print(f"sessions created and filled: {counts}")
        print(f"tokens appended {appended:.0f} = {appended * token_bytes / 2**20:.0f} MiB "
              f"({appended * token_bytes / args.kv_cache_bytes:.1f}x the budget); evictions "
              f"{evicted:.0f}")
        print(f"KV bytes now {samples.get('attnserve_kv_cache_bytes', 0) / 2**20:.1f} MiB of "
              f"{samples.get('attnserve_kv_cache_budget_bytes', 0) / 2**20:.1f} MiB")
        print(f"RSS before {baseline / 2**20:.1f} MiB, peak {peak[0] / 2**20:.1f} MiB: "
              f"peak - budget = {(peak[0] - args.kv_cache_bytes) / 2**20:.1f} MiB, "
              f"peak - before = {(peak[0] - baseline) / 2**20:.1f} MiB")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
