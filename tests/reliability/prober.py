"""The well-behaved client of the hostile HTTP/2 tests: while an abusive client runs against the
server, it calls a small Attend every 50 ms on its own connection (gRPC's Python client),
retrying a RESOURCE_EXHAUSTED or UNAVAILABLE after 50 ms as a client with a retry policy would
(attnserve::Client retries UNAVAILABLE): under the transport quota's pressure gRPC's reclaimer
may end an idle connection, this one included, with a GOAWAY. On SIGTERM it
prints how many calls it made and the slowest, and exits 1 if any call failed otherwise or took
longer than BOUND_S from its first try.

usage: prober.py PORT STUBS_DIR [TOKEN_FILE]
"""
import os
import signal
import sys
import time

# First, before the imports (grpc's takes a while on a loaded machine): a SIGTERM that came
# before the handler would end the prober silently, as a failure.
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, sys.argv[2])
import grpc  # noqa: E402
from attend_messages import attend_request  # noqa: E402
from attnserve.v1 import attention_pb2_grpc  # noqa: E402

BOUND_S = 10.0


def main():
    port = int(sys.argv[1])
    metadata = []
    if len(sys.argv) > 3:
        # The file's first token (a server's token file may hold several).
        metadata = [("authorization", "Bearer " + open(sys.argv[3]).read().split()[0])]
    request = attend_request(2, 8, 8)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = attention_pb2_grpc.AttentionServiceStub(channel)
    calls, retries, slowest, errors = 0, 0, 0.0, []
    while not stopping or calls == 0:
        started = time.monotonic()
        while True:
            try:
                stub.Attend(request, timeout=BOUND_S, metadata=metadata)
                break
            except grpc.RpcError as error:
                if (error.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         grpc.StatusCode.UNAVAILABLE)
                        or time.monotonic() - started > BOUND_S):
                    errors.append(f"{error.code().name}: {error.details()}")
                    break
                retries += 1
                time.sleep(0.05)
        calls += 1
        slowest = max(slowest, time.monotonic() - started)
        if calls == 1:
            print("prober: calling", flush=True)  # what start_server waits for
        time.sleep(0.05)
    print(f"prober: {calls} small Attends, {retries} retried, slowest {slowest:.2f} s, "
          f"errors {errors[:3]}")
    ok = calls > 0 and not errors and slowest <= BOUND_S
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
