"""The in-flight memory budget (--max_inflight_bytes) against three kinds of traffic that used
to grow the server without bound (hostile_http2_test.sh's prober is the well-behaved client
that must keep being answered meanwhile):

  large: many concurrent, individually valid Attends of 12 MiB each (gRPC's Python client);
         those the budget has no room for get RESOURCE_EXHAUSTED at once.
  unread: Attends asking for PER_HEAD weights (33 MB answers) on a connection that never reads
         its answers: answers not yet sent keep their share of the budget, so once it is held,
         later calls are refused, until the connection goes and the budget comes back.
  unread_timeout: (the server at --message_timeout_seconds=2) the same unread answers on two
         connections that stay open: once the timeout (and a second per MiB) passes each call
         is cancelled (CANCELLED, or its stream reset), and its share of the budget comes back.
  streams: idle Health.Watch and AttendStream calls, 16 KiB of the budget each while open:
         past the budget new ones are refused.
  addresses: 100 connections from 127.0.0.2, each with 16 idle Health.Watch calls, more than
         the budget holds: the connections of one address together may not take it past seven
         eighths, so a client from another address (127.0.0.1) still opens streams and is
         answered.
  queue: (the server at --max_queue=4 --executors=1) 16 Attends kept open from 127.0.0.2 fill
         the compute queue; a client from 127.0.0.1 calling one Attend at a time is never
         refused: the queue gives the flood's newest place to it and takes the clients in turns
         (until 2026-12-07 one FIFO refused it as it refused the flood).
  queue_identities: (the server at --max_queue=4 --executors=1 --auth_token_file=TOKENS) the
         same three times for 4 s each: the flood and the other client both from 127.0.0.1,
         each with a token of its own (TOKENS' second and third; the prober has the first),
         calling Attend, then AttendStream (one message a call); then the two with one token,
         from 127.0.0.2 and 127.0.0.1: the queue's turns are the callers' addresses with their
         identities, so the other client is never refused (until 2026-12-07 they were the
         addresses alone: the first two refused it; keyed by identity alone, the third).
  connections: (the server at --max_connections=64) 200 idle HTTP/2 connections from 127.0.0.2:
         those past seven eighths of 64 are closed as soon as accepted; of 100 more from
         127.0.0.3 a few are kept, as the places left allow; clients from 127.0.0.1 and
         127.0.0.4 still connect and are answered; once the floods' connections close,
         127.0.0.2 connects again. Until 2026-12-07 no limit held connections, 15 KiB of the
         server's memory each when idle.

Each scenario asserts the server's peak RSS stays under its RSS before the scenario plus the
budget plus OVERHEAD_BYTES (what gRPC and the allocator hold beyond the budget's count).

usage: memory_budget_test.py PORT SERVER_PID STUBS_DIR BUDGET_BYTES
       large|unread|unread_timeout|streams|addresses|queue|connections
       | queue_identities TOKENS_FILE
"""
import collections
import selectors
import socket
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, sys.argv[3])
import grpc  # noqa: E402
from attnserve.v1 import attention_pb2_grpc  # noqa: E402
from attend_messages import attend_request  # noqa: E402
from raw_http2 import Calls, exit_with, rss_bytes  # noqa: E402

OK, CANCELLED, RESOURCE_EXHAUSTED = 0, 1, 8
# AddressSanitizer's builds keep freed memory in a 256 MiB quarantine: hostile_http2_test.sh
# raises the overhead for them.
OVERHEAD_BYTES = int(os.environ.get("ATTNSERVE_RSS_OVERHEAD_BYTES", 64 << 20))
ATTEND = "/attnserve.v1.AttentionService/Attend"
ATTEND_STREAM = "/attnserve.v1.AttentionService/AttendStream"


class RssWatch:
    """Samples the server's RSS every 50 ms while it runs."""

    def __init__(self, pid):
        self.pid, self.peak, self.base = pid, 0, rss_bytes(pid)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.05)

    def finish(self):
        self.stop.set()
        self.thread.join()
        return self.base, self.peak


def large(port, failures):
    """24 concurrent 12 MiB Attends on one channel, with the budget room for a few."""
    request = attend_request(16, 1024, 64)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
    stub = attention_pb2_grpc.AttentionServiceStub(channel)
    futures = [stub.Attend.future(request, timeout=120) for _ in range(24)]
    codes, messages = collections.Counter(), collections.Counter()
    for future in futures:
        try:
            future.result()
            codes["OK"] += 1
        except grpc.RpcError as error:
            codes[error.code().name] += 1
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                messages[error.details()] += 1
    channel.close()
    print(f"24 large Attends: {dict(codes)}; RESOURCE_EXHAUSTED: {dict(messages)}")
    # Which calls are answered depends on the order their messages arrive in and how fast the
    # server answers them: each message takes its share when it arrives, its compute's only
    # once validated, and gRPC's transport quota (a quarter of the budget) resets streams under
    # pressure, answered ones included. So no call need be answered here (the unread scenario
    # shows budgeted calls answered), and none need be refused: a server that answers as fast
    # as the messages come holds a few at a time (with the call loop's standby thread handling
    # arrivals while gRPC reads the rest, all 24 were answered once, beside other tests; the
    # unread and streams scenarios show the refusals). Every call that is not answered must
    # end with a refusal that says why, and the RSS bound holds either way.
    if not set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}:
        failures.append(f"large Attends got {dict(codes)}, expected OK or RESOURCE_EXHAUSTED")
    # Under that pressure gRPC resets streams with RST_STREAM ENHANCE_YOUR_CALM (11), and its
    # reclaimer may end the whole connection (UNAVAILABLE: a GOAWAY, a broken pipe); every other
    # RESOURCE_EXHAUSTED must be the budget's.
    # When the transport reset every refused stream, their messages never reached the budget
    # (arrival order again: seen under AddressSanitizer's slower handlers); otherwise the
    # budget must have refused some itself.
    unexplained = [m for m in messages
                   if "max_inflight_bytes" not in m and "error code 11" not in m]
    all_reset = bool(messages) and all("error code 11" in m for m in messages)
    if unexplained or (messages and not (all_reset or
                                         any("max_inflight_bytes" in m for m in messages))):
        failures.append(f"refusals that do not name the budget: {dict(messages)}")


def unread(port, failures):
    """Calls whose 33 MB answers are never read keep their share of the budget: on one
    connection the second and third are refused (one connection may hold half the budget);
    a second connection's call is taken, a third connection's refused (the budget is full);
    once the connections close, a call is answered again."""
    message = attend_request(4, 1024, 16, weights=True).SerializeToString()

    def stuck_call(calls):
        stream = calls.start(ATTEND, message)
        calls.pump(8, until=lambda: calls.statuses[stream] is not None)  # computed, unsent
        return calls.statuses[stream]

    def refused(calls, count):
        streams = [calls.start(ATTEND, message) for _ in range(count)]
        calls.pump(10, until=lambda: all(calls.statuses[s] is not None for s in streams))
        return [calls.statuses[s] for s in streams]

    first, second, third = (Calls(port, read_answers=False) for _ in range(3))
    held_first = stuck_call(first)
    same_connection = refused(first, 2)
    held_second = stuck_call(second)
    full = refused(third, 1)
    print(f"first connection: {held_first} held, then {same_connection}; second: "
          f"{held_second} held; third: {full}")
    if held_first is not None or held_second is not None:
        failures.append("an answer nobody reads was sent or refused")
    if same_connection != [RESOURCE_EXHAUSTED] * 2 or full != [RESOURCE_EXHAUSTED]:
        failures.append(f"calls while unread answers held the budget got {same_connection} "
                        f"and {full}, expected RESOURCE_EXHAUSTED")
    for calls in (first, second, third):
        calls.close()
    time.sleep(1)
    reader = Calls(port, read_answers=True)
    again = reader.start(ATTEND, message)
    reader.pump(30)
    reader.close()
    print(f"after those connections closed: {reader.statuses[again]}")
    if reader.statuses[again] != OK:
        failures.append(f"after the unread answers' connections closed: "
                        f"{reader.statuses[again]}")


def unread_timeout(port, failures):
    """Answers nobody takes are dropped once --message_timeout_seconds (plus a second per MiB
    of answer) passes, and give their share of the budget back while their connections stay
    open (before, they held it for as long as the connection lived): two 33 MB answers on two
    connections fill the budget, a third connection's call is refused, the two end CANCELLED
    after about 2 + 32 s, and the third connection's next call is answered."""
    message = attend_request(4, 1024, 16, weights=True).SerializeToString()
    held = []
    for _ in range(2):
        calls = Calls(port, read_answers=False)
        stream = calls.start(ATTEND, message)
        calls.pump(4, until=lambda: False)  # computed, its answer waiting on the window
        held.append((calls, stream))
    reader = Calls(port, read_answers=True)
    refused = reader.start(ATTEND, message)
    reader.pump(10, until=lambda: reader.statuses[refused] is not None)
    print(f"while two unread answers are held, another connection's call: "
          f"{reader.statuses[refused]}")
    if reader.statuses[refused] != RESOURCE_EXHAUSTED:
        failures.append(f"a call while two unread answers held the budget got "
                        f"{reader.statuses[refused]}, expected RESOURCE_EXHAUSTED")
    start = time.monotonic()
    for calls, stream in held:
        calls.pump(max(0.1, start + 90 - time.monotonic()),
                   until=lambda: calls.statuses[stream] is not None)
    ended = [calls.statuses[stream] for calls, stream in held]
    print(f"unread answers ended {ended} {time.monotonic() - start:.1f} s later")
    # gRPC ends a cancelled call with grpc-status CANCELLED where it can, else resets it.
    if not all(status in (CANCELLED, "reset") for status in ended):
        failures.append(f"unread answers ended {ended}, expected CANCELLED or a reset")
    again = reader.start(ATTEND, message)
    reader.pump(60, until=lambda: reader.statuses[again] is not None)
    print(f"with those connections still open: {reader.statuses[again]}")
    if reader.statuses[again] != OK:
        failures.append(f"a call once the dropped answers gave the budget back, their "
                        f"connections still open: {reader.statuses[again]}")
    for calls in [reader] + [calls for calls, _ in held]:
        calls.close()


def streams(port, failures):
    """Idle Health.Watch and AttendStream calls, 250 per connection on 4 connections."""
    connections = []
    for path in ("/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/Watch",
                 "/attnserve.v1.AttentionService/AttendStream",
                 "/attnserve.v1.AttentionService/AttendStream"):
        calls = Calls(port)
        watch = path.endswith("Watch")
        for _ in range(250):
            calls.start(path, b"" if watch else None, end_stream=False)
        connections.append((path, calls))
    for path, calls in connections:
        calls.pump(2, until=lambda: False)
    held, refused, other = 0, 0, collections.Counter()
    for path, calls in connections:
        for status in calls.statuses.values():
            if status is None:
                held += 1
            elif status == RESOURCE_EXHAUSTED:
                refused += 1
            else:
                other[status] += 1
    print(f"1,000 idle streams: {held} open, {refused} refused, others {dict(other)}")
    if refused == 0 or held == 0 or other:
        failures.append(f"idle streams: {held} open, {refused} refused, {dict(other)}, "
                        "expected some open and the rest refused")
    for _, calls in connections:
        calls.close()


def addresses(port, failures):
    """Many connections from one address hold at most seven eighths of the budget together."""
    watch = "/grpc.health.v1.Health/Watch"
    flood = []
    for _ in range(100):
        calls = Calls(port, source="127.0.0.2")
        for _ in range(16):
            calls.start(watch, b"", end_stream=False)
        calls.pump(0.05, until=lambda: False)
        flood.append(calls)
    for calls in flood:
        calls.pump(0.05, until=lambda: False)
    statuses = collections.Counter(
        "open" if status is None else status for calls in flood for status in calls.statuses.values())
    print(f"1,600 idle watches from 127.0.0.2 on 100 connections: {dict(statuses)}")
    if statuses["open"] == 0 or statuses[RESOURCE_EXHAUSTED] == 0 or len(statuses) != 2:
        failures.append(f"the flood's watches: {dict(statuses)}, expected some open and the "
                        "rest refused RESOURCE_EXHAUSTED")
    # Another address: 32 idle watches and an Attend on one connection, while the flood holds.
    other = Calls(port, source="127.0.0.1")
    watches = [other.start(watch, b"", end_stream=False) for _ in range(32)]
    attend = other.start(ATTEND, attend_request(1, 16, 8).SerializeToString())
    other.pump(10, until=lambda: other.statuses[attend] is not None)
    other.pump(0.5, until=lambda: False)
    refused = [other.statuses[s] for s in watches if other.statuses[s] is not None]
    print(f"from 127.0.0.1 meanwhile: Attend {other.statuses[attend]}, "
          f"{32 - len(refused)} of 32 watches open")
    if other.statuses[attend] != OK or refused:
        failures.append(f"a client from another address got Attend {other.statuses[attend]} "
                        f"and watches {refused}, expected OK and all open")
    other.close()
    for calls in flood:
        calls.close()


def queue(port, failures, flood_source="127.0.0.2", flood_token=None, other_token=None,
          path=ATTEND):
    """One client (calling `path` from `flood_source`, with `flood_token` if given) filling the
    compute queue does not refuse another's calls (`path`, from 127.0.0.1, with `other_token`):
    a call of the other's that arrives at a full queue, holding none of its places, takes the
    flood's newest place, whose call is answered "gave its place" (a few in 4 s: most find a
    place freed)."""
    def bearer(token):
        return [("authorization", f"Bearer {token}")] if token else []

    full = b"compute queue is full"
    flood = Calls(port, source=flood_source, watch_for=full)
    # 1.5 MiB, ~540 MFLOP: the compute, not the io thread's parse, is what the flood waits on,
    # so that it fills the queue under a sanitizer too (at (8, 256, 64), a quarter of the
    # FLOPs, the AddressSanitizer build's streams never filled it).
    heavy = attend_request(8, 1024, 16).SerializeToString()
    innocent = {"ok": 0, "refused": [], "other": [], "slowest": 0.0}
    done = threading.Event()

    def call_one_at_a_time():
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        small = attend_request(2, 16, 8)
        while not done.is_set():
            started = time.monotonic()
            try:
                if path == ATTEND:
                    stub.Attend(small, timeout=10, metadata=bearer(other_token))
                else:
                    answers = list(stub.AttendStream(iter([small]), timeout=10,
                                                     metadata=bearer(other_token)))
                    if len(answers) != 1 or answers[0].HasField("error"):
                        error = answers[0].error if answers else None
                        kind = "refused" if error and error.code == RESOURCE_EXHAUSTED else "other"
                        innocent[kind].append(f"AttendStream: {answers}"[:300])
                        continue
                innocent["ok"] += 1
                innocent["slowest"] = max(innocent["slowest"], time.monotonic() - started)
            except grpc.RpcError as error:
                kind = ("refused" if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        else "other")
                innocent[kind].append(f"{error.code().name}: {error.details()}")
            time.sleep(0.02)
        channel.close()

    # The flood first, so that the queue is full before the other client's first call.
    calls = [flood.start(path, heavy, headers=bearer(flood_token)) for _ in range(16)]
    flood.pump(0.5, until=lambda: False)
    thread = threading.Thread(target=call_one_at_a_time)
    thread.start()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline and not flood.closed:
        flood.pump(0.05, until=lambda: False)
        for i, stream in enumerate(calls):
            if flood.statuses[stream] is not None:
                calls[i] = flood.start(path, heavy, headers=bearer(flood_token))
    done.set()
    thread.join()
    statuses = collections.Counter(flood.statuses.values())
    # A unary call's refusal is its status; an AttendStream's, its answer's error.
    queue_full = len(flood.mentions) + sum(
        1 for stream, status in flood.statuses.items()
        if status == RESOURCE_EXHAUSTED and full.decode() in flood.messages.get(stream, ""))
    displaced = sum(1 for message in flood.messages.values() if "gave its place" in message)
    tokens = ("" if flood_token is None else
              ", the two with one token" if flood_token == other_token else
              ", each with its own token")
    print(f"{path.rsplit('/', 1)[1]} from {flood_source} and 127.0.0.1{tokens}: the flood "
          f"{dict(statuses)}, {queue_full} refused or displaced by the full queue"
          f"{f' ({displaced} displaced)' if path == ATTEND else ''}; the other client "
          f"{innocent['ok']} answered, {len(innocent['refused'])} refused, "
          f"{len(innocent['other'])} failed otherwise, the slowest answered in "
          f"{innocent['slowest']:.3f} s")
    if queue_full == 0:
        failures.append(f"{path}: the flood never filled the queue: {dict(statuses)}")
    if innocent["ok"] == 0 or innocent["refused"] or innocent["other"]:
        failures.append(f"{path}: the other client: {innocent['ok']} answered, refused "
                        f"{innocent['refused'][:3]}, failed {innocent['other'][:3]}")
    flood.close()


def queue_identities(port, failures):
    """queue with tokens (TOKENS' second and third lines): the flood and the other client
    both on 127.0.0.1 with a token each, on Attend and then on AttendStream; then the two
    with one token from 127.0.0.2 and 127.0.0.1."""
    flood_token, other_token = open(sys.argv[6]).read().split()[1:3]
    for path in (ATTEND, ATTEND_STREAM):
        queue(port, failures, "127.0.0.1", flood_token, other_token, path)
    queue(port, failures, "127.0.0.2", flood_token, flood_token, ATTEND)


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def open_idle(port, source, count):
    """`count` connections from `source`, each sending HTTP/2's preface and SETTINGS."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5,
                                        source_address=(source, 0))
        try:
            sock.sendall(PREFACE)
        except OSError:
            pass  # closed at once, before the preface went
        socks.append(sock)
    return socks


def watch_states(states, seconds=10.0):
    """Reads every socket in `states` (socket -> "new", "served" or "closed") until none is
    "new", for at most `seconds`, then 0.3 s more: one the server wrote to (its SETTINGS) is
    "served", one it ended is "closed"."""
    selector = selectors.DefaultSelector()
    for sock, state in states.items():
        if state != "closed":
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + seconds
    settled = None
    while selector.get_map() and time.monotonic() < (settled or deadline):
        if settled is None and "new" not in states.values():
            settled = time.monotonic() + 0.3
        for key, _ in selector.select(timeout=0.05):
            try:
                data = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            except OSError:  # reset
                data = b""
            if data:
                states[key.fileobj] = "served"
            else:
                states[key.fileobj] = "closed"
                selector.unregister(key.fileobj)
    selector.close()


def connections(port, failures):
    """One address's connections hold at most seven eighths of --max_connections (64); past it
    an address holds fewer as the places run out, so two floods do not keep others out."""
    limit = 64
    states = {sock: "new" for sock in open_idle(port, "127.0.0.2", 200)}
    watch_states(states)
    first = collections.Counter(states.values())
    print(f"200 idle connections from 127.0.0.2 at max_connections {limit}: {dict(first)}")
    # Seven eighths of 64 is 56, the prober's connection among them.
    if not limit * 7 // 8 - 4 <= first["served"] <= limit * 7 // 8 or first["new"]:
        failures.append(f"the flood's connections: {dict(first)}, expected about "
                        f"{limit * 7 // 8} served (seven eighths of {limit}, less the prober's) "
                        "and the rest closed at once")
    # A second address: past seven eighths it takes a place only while it holds fewer than
    # 4 F^2 / 64 with F places free: 3 (at F = 8, 7, 6); the places left are for others.
    second = open_idle(port, "127.0.0.3", 100)
    states.update({sock: "new" for sock in second})
    watch_states(states)
    held = {source: sum(1 for sock, state in states.items() if state == "served"
                        and sock.getsockname()[0] == source)
            for source in ("127.0.0.2", "127.0.0.3")}
    print(f"then 100 from 127.0.0.3: connections held {held}")
    if held["127.0.0.2"] != first["served"] or not 1 <= held["127.0.0.3"] <= 4:
        failures.append(f"two floods hold {held}, expected 127.0.0.2 to keep its "
                        f"{first['served']} and 127.0.0.3 to hold 1 to 4")
    # Other addresses meanwhile, on connections of their own: calls answered.
    for source in ("127.0.0.1", "127.0.0.4"):
        other = Calls(port, source=source)
        attend = other.start(ATTEND, attend_request(1, 16, 8).SerializeToString())
        other.pump(10, until=lambda: other.statuses[attend] is not None)
        print(f"from {source} meanwhile: Attend {other.statuses[attend]}")
        if other.statuses[attend] != OK:
            failures.append(f"a client from {source} got Attend {other.statuses[attend]} "
                            f"({other.messages.get(attend)}), expected OK")
        other.close()
    for sock in states:
        sock.close()
    # The server learns of closed connections within a second (or at its next refusal).
    deadline = time.monotonic() + 10
    status = None
    while time.monotonic() < deadline and status != OK:
        try:
            again = Calls(port, source="127.0.0.2")
            attend = again.start(ATTEND, attend_request(1, 16, 8).SerializeToString())
            again.pump(2, until=lambda: again.closed or again.statuses[attend] is not None)
            status = again.statuses[attend]
            again.close()
        except OSError as error:  # closed at once
            status = str(error)
        if status != OK:
            time.sleep(0.2)
    print(f"from 127.0.0.2 once its connections closed: Attend {status}")
    if status != OK:
        failures.append(f"127.0.0.2 after closing its connections: Attend {status}, expected OK")


def main():
    port, pid, budget, scenario = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4]),
                                   sys.argv[5])
    failures = []
    watch = RssWatch(pid)
    {"large": large, "unread": unread, "unread_timeout": unread_timeout, "streams": streams,
     "addresses": addresses, "queue": queue,
     "queue_identities": queue_identities,
     "connections": connections}[scenario](port, failures)
    base, peak = watch.finish()
    print(f"RSS {base / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB, budget "
          f"{budget / 2**20:.0f} MiB + {OVERHEAD_BYTES / 2**20:.0f} MiB overhead")
    if peak > base + budget + OVERHEAD_BYTES:
        failures.append(f"peak RSS {peak} over {base} + budget {budget} + {OVERHEAD_BYTES}")
    exit_with(failures)


if __name__ == "__main__":
    main()
