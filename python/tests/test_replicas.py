"""attnserve.Replicas and ShardedSession against three live replicas: placement by rendezvous
hashing (the same weights as the C++ library's), pinning, a killed replica told apart and
rebuilt through the caller's hook, a restarted one told by every call of a session (and the
new session that took its id untouched), and a sharded session equal to the float64
reference."""
import os
import signal
import socket
import time

import grpc
import numpy as np
import pytest

import attnserve
from attnserve.replicas import resolve
from attnserve_client import reference_sdpa
from conftest import Server

RNG = np.random.default_rng(24)
H, HKV, D = 2, 2, 8


def uniform(*shape):
    return RNG.uniform(-1, 1, shape).astype(np.float32)


def expected_step(q, keys, values):
    return reference_sdpa(q[None], keys[None], values[None], causal=True,
                          causal_alignment="BOTTOM_RIGHT")[0]


def stop(server):
    """SIGSTOP, then wait until every thread of the server has stopped: one running on
    another CPU (the io thread spins) goes on until the signal reaches it, which on a loaded
    VM can take long enough to answer the next call."""
    server.process.send_signal(signal.SIGSTOP)
    tasks = f"/proc/{server.process.pid}/task"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(tasks):
            try:
                with open(f"{tasks}/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # a thread that ended meanwhile
                pass
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"attnserve {server.target} did not stop within 10 s")


@pytest.fixture()
def three():
    servers = [Server(f"--replica_name=py-{i}") for i in range(3)]
    yield servers
    for server in servers:
        server.stop()


def test_weights_and_targets_match_the_cpp_library():
    assert attnserve.rendezvous_weight(
        "127.0.0.1:50051", "00112233445566778899aabbccddeeff") == 18300100417772493994
    assert resolve("ipv4:127.0.0.2:7002,127.0.0.1:7001") == ["127.0.0.1:7001",
                                                               "127.0.0.2:7002"]
    assert resolve("ipv6:[::1]:7004") == ["[::1]:7004"]
    assert set(resolve("dns:///localhost:7005")) <= {"127.0.0.1:7005", "[::1]:7005"}
    with pytest.raises(ValueError):
        resolve("ipv4:127.0.0.1")
    assert len(attnserve.random_session_id()) == 32


def test_a_name_that_does_not_resolve_is_named(monkeypatch):
    def no_such_name(host, port, **kwargs):  # as glibc answers, without asking a resolver
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    with pytest.raises(socket.gaierror, match="target 'dns:///db.invalid:1': db.invalid does "
                                              "not resolve: Name or service not known"):
        resolve("dns:///db.invalid:1")


def test_a_resolution_that_hangs_keeps_to_the_deadline(monkeypatch):
    """getaddrinfo has no deadline: a resolver that does not answer held a refresh, and the
    create_session that asked for it, for its own timeouts (10 s or more) past the call's."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    target = f"localhost:{free.getsockname()[1]}"  # nothing listens: UNAVAILABLE at once
    free.close()
    replicas = attnserve.Replicas(target, retry=attnserve.RetryPolicy(max_attempts=1))
    real = socket.getaddrinfo

    def hangs(*args, **kwargs):
        time.sleep(4)
        return real(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hangs)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"resolving '{target}' took past the call's"):
        replicas.refresh(timeout=0.3)
    assert time.monotonic() - start < 2
    start = time.monotonic()
    with pytest.raises(attnserve.AttnserveError) as refused:
        replicas.create_session(num_layers=1, num_heads=1, key_dim=4, timeout=1.0)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 3
    replicas.close()


class Model:
    """What a session holds, as the test sent it."""

    def __init__(self):
        self.keys, self.values = np.zeros((HKV, 0, D), np.float32), np.zeros((HKV, 0, D),
                                                                             np.float32)

    def append(self, tokens):
        k, v = uniform(HKV, tokens, D), uniform(HKV, tokens, D)
        self.keys = np.concatenate([self.keys, k], 1)
        self.values = np.concatenate([self.values, v], 1)
        return k, v


def decode(session, model, timeout=None):
    k, v = model.append(1)
    q = uniform(H, 1, D)
    try:
        result = session.step(0, key=k, value=v, query=q, timeout=timeout)
    except attnserve.AttnserveError:
        model.keys, model.values = model.keys[:, :-1], model.values[:, :-1]
        raise
    np.testing.assert_allclose(result.output, expected_step(q, model.keys, model.values),
                               atol=1e-5)


def test_sessions_are_pinned_told_gone_and_rebuilt(three):
    target = "ipv4:" + ",".join(server.target for server in three)
    with attnserve.Replicas(target, retry=attnserve.RetryPolicy(max_attempts=2)) as replicas:
        sessions, models, on = [], [], {}
        while not any(len(held) == 2 for held in on.values()):
            session = replicas.create_session(num_layers=1, num_heads=H, num_kv_heads=HKV,
                                              key_dim=D)
            assert session.address == replicas.rank(session.id)[0]
            index = [s.target for s in three].index(session.address)
            assert session.replica.name == f"py-{index}"
            on.setdefault(session.address, []).append(len(sessions))
            sessions.append(session)
            models.append(Model())
            assert len(sessions) < 40
        for session, model in zip(sessions, models):
            k, v = model.append(4)
            session.step(0, key=k, value=v)
            decode(session, model)
        victim = next(address for address, held in on.items() if len(held) == 2)
        a, b = on[victim]
        three[[s.target for s in three].index(victim)].process.kill()

        with pytest.raises(attnserve.ReplicaGoneError) as gone:
            decode(sessions[a], models[a])
        assert gone.value.code == grpc.StatusCode.ABORTED
        assert "is gone, and the session with it: it is unreachable" in gone.value.message
        assert gone.value.attempts == 2  # The unanswered calls' (it said 1 until 2026-12-07).

        # A hook that restores too little: the new session is deleted, and this one stays
        # the lost one, its lengths as they were, still told gone (it used to become the
        # half-restored session, whose next step attended without the missing tokens).
        partial = []

        def short(fresh, lengths, timeout):
            partial.append(fresh)
            fresh.step(0, key=models[b].keys[:, :lengths[0] - 1],
                       value=models[b].values[:, :lengths[0] - 1], timeout=timeout)

        sessions[b].rebuild_hook = short
        lost_id, lost_lengths = sessions[b].id, list(sessions[b].lengths)
        with pytest.raises(attnserve.ReplicaGoneError) as gone:
            decode(sessions[b], models[b])
        assert "rebuilding it failed: the rebuild hook left session" in gone.value.message
        assert "this session is still the lost one" in gone.value.message
        assert (sessions[b].id, sessions[b].lengths) == (lost_id, lost_lengths)
        assert partial[0].deleted
        with attnserve.Client(partial[0].address) as direct:
            with pytest.raises(attnserve.AttnserveError) as missing:
                direct.get_session(partial[0].id)
        assert missing.value.code == grpc.StatusCode.NOT_FOUND

        # A hook that fails on the step's deadline: nothing is left to delete its session
        # with, and the step keeps to its timeout (until 2026-12-07 the delete had a second
        # of its own past it, an audit found).
        waited = []

        def wait_it_out(fresh, lengths, timeout):
            waited.append(fresh)
            time.sleep(timeout)
            raise attnserve.AttnserveError(grpc.StatusCode.DEADLINE_EXCEEDED, "ran out of time")

        sessions[b].rebuild_hook = wait_it_out
        with pytest.raises(attnserve.ReplicaGoneError) as gone:
            decode(sessions[b], models[b], timeout=1.0)
        assert ("rebuilding it failed: ran out of time (no time was left to delete it: it "
                "goes at its TTL; this session is still the lost one" in gone.value.message)
        assert not waited[0].deleted and sessions[b].id == lost_id
        waited[0].delete()

        calls, began = [], time.monotonic()

        def prefill(fresh, lengths, timeout):
            calls.append((lengths, timeout, time.monotonic() - began))
            fresh.step(0, key=models[b].keys[:, :lengths[0]],
                       value=models[b].values[:, :lengths[0]], timeout=timeout)

        sessions[b].rebuild_hook = prefill
        decode(sessions[b], models[b], timeout=20.0)
        assert [lengths for lengths, _, _ in calls] == [[5]] and sessions[b].address != victim
        # The hook has what is left of the step's 20 s, not all of it (until 2026-12-07 the
        # step's timeout went whole to its rebuild, its hook and its second sending).
        _, timeout, at = calls[0]
        assert timeout <= 20.0 - at + 0.01, (timeout, at)
        decode(sessions[b], models[b])
        for address, held in on.items():
            if address != victim:
                for s in held:
                    decode(sessions[s], models[s])


def test_a_restarted_replica_is_told_by_every_call_and_its_new_session_untouched():
    first = Server("--replica_name=py-r")
    second = None
    try:
        with attnserve.Replicas(f"ipv4:{first.target}",
                                retry=attnserve.RetryPolicy(max_attempts=2)) as replicas:
            stale = replicas.create_session(num_layers=1, num_heads=H, num_kv_heads=HKV,
                                            key_dim=D)
            model = Model()
            k, v = model.append(3)
            stale.step(0, key=k, value=v)
            second_stale = replicas.create_session(num_layers=1, num_heads=H,
                                                   num_kv_heads=HKV, key_dim=D)
            first.stop()
            # The same name and address, another process; another caller takes the id.
            second = Server("--replica_name=py-r", f"--port={first.port}")
            grpc.channel_ready_future(replicas.client(first.target)._channel).result(10)
            with attnserve.Client(second.target) as other:
                taken = other.create_session(num_layers=1, num_heads=H, num_kv_heads=HKV,
                                             key_dim=D, session_id=stale.id)
                taken.step(0, key=uniform(HKV, 2, D), value=uniform(HKV, 2, D))
                for call in (lambda: stale.truncate(1), stale.fork, stale.sync,
                             lambda: decode(stale, model)):
                    with pytest.raises(attnserve.ReplicaGoneError) as gone:
                        call()
                    assert gone.value.code == grpc.StatusCode.ABORTED
                    assert "it restarted" in gone.value.message, gone.value.message
                    assert "this is replica py-r" in gone.value.message
                # A delete is done: the session went with the process that held it (it
                # raised "create the session again elsewhere" every time until 2026-12-07).
                stale.delete()
                assert stale.deleted
                # The only replica, restarted, is there and empty: a rebuild makes the
                # session anew on it (it was never asked until 2026-12-07, and a single
                # replica's sessions could not be rebuilt).
                lost_id = second_stale.id
                second_stale.rebuild(timeout=10)
                assert second_stale.address == first.target and second_stale.id != lost_id
                assert second_stale.lengths == [0]
                second_stale.delete()
                # The new session never saw the stale handle's calls.
                assert list(other.get_session(stale.id).lengths) == [2]
                assert len(other.list_sessions()) == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_blip_shorter_than_the_reconnect_backoff_is_not_a_replica_gone():
    """The retries of a pinned session's call span a fraction of a second, less than gRPC's
    reconnect backoff: UNAVAILABLE past them is a replica gone only if a GetSession waiting
    for the replica to be reached gets no answer either. Until 2026-12-07 a blip of 0.6 s
    told a live session gone, and a rebuild hook made it anew elsewhere (an audit)."""
    server = Server("--replica_name=py-blip")
    try:
        with attnserve.Replicas(f"ipv4:{server.target}") as replicas:
            session = replicas.create_session(num_layers=1, num_heads=H, num_kv_heads=HKV,
                                              key_dim=D)
            model = Model()
            k, v = model.append(3)
            session.step(0, key=k, value=v)
            rebuilt = []
            session.rebuild_hook = lambda *args: rebuilt.append(args)
            client = replicas.client(server.target)
            real = client.call_counting

            def blip(method, request, timeout=None, retryable=True, also_retry_on=()):
                client.call_counting = real  # Over once the retries have failed.
                failure = attnserve.AttnserveError(grpc.StatusCode.UNAVAILABLE,
                                                   "Connection reset by peer")
                failure.attempts = 3
                raise failure

            client.call_counting = blip
            k, v = model.append(1)
            with pytest.raises(attnserve.AttnserveError) as failed:
                session.step(0, key=k, value=v, timeout=5)
            assert not isinstance(failed.value, attnserve.ReplicaGoneError)
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE
            assert "answered again at once and holds session" in failed.value.message
            assert failed.value.attempts == 3 and not rebuilt
            # Sent again, the step goes to the same session.
            assert session.step(0, key=k, value=v).length == 4
            assert not rebuilt and session.address == server.target
    finally:
        server.stop()


def test_a_full_replica_passes_the_session_to_the_next():
    """A replica refusing a create for want of room (RESOURCE_EXHAUSTED: here max_sessions
    with kv_eviction none) passes it to the next in rendezvous order; every replica full is
    RESOURCE_EXHAUSTED naming each. A refusal of the request itself, which the server marks
    and every replica would make, ends the create at once. Until 2026-12-07 the first full
    replica ended it (an audit)."""
    servers = [Server("--max_sessions=1", "--kv_eviction=none", "--kv_cache_bytes=4194304")
               for _ in range(2)]
    try:
        target = "ipv4:" + ",".join(server.target for server in servers)
        with attnserve.Replicas(target) as replicas:
            held = [replicas.create_session(num_layers=1, num_heads=H, num_kv_heads=HKV,
                                            key_dim=D) for _ in range(2)]
            assert {session.address for session in held} == {s.target for s in servers}
            with pytest.raises(attnserve.AttnserveError) as full:
                replicas.create_session(num_layers=1, num_heads=H, num_kv_heads=HKV,
                                        key_dim=D)
            assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert full.value.message.startswith("no replica of ")
            assert all(s.target in full.value.message for s in servers)
            for session in held:
                session.delete()
            # A session whose first page passes the whole KV cache: refused by the first
            # replica asked, for good.
            with pytest.raises(attnserve.AttnserveError) as too_large:
                replicas.create_session(num_layers=1, num_heads=64, key_dim=256,
                                        max_tokens=4096)
            assert too_large.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert too_large.value.permanent
            assert not too_large.value.message.startswith("no replica of ")
    finally:
        for server in servers:
            server.stop()


def test_a_sharded_session_refuses_positional_variants(three):
    target = "ipv4:" + ",".join(server.target for server in three)
    with attnserve.Replicas(target) as replicas:
        for options in ({"window_left": 4}, {"window_left": 0}, {"num_sink_tokens": 2},
                        {"alibi_slopes": np.full(4, 0.5, np.float32)}, {"rope_theta": 1e4}):
            with pytest.raises(ValueError, match="cannot be sharded"):
                attnserve.ShardedSession(replicas, 16, num_layers=1, num_heads=4,
                                         num_kv_heads=2, key_dim=D, **options)
        sharded = attnserve.ShardedSession(replicas, 16, num_layers=1, num_heads=4,
                                           num_kv_heads=2, key_dim=D, window_left=-1,
                                           num_sink_tokens=0)
        sharded.delete()


def test_a_sharded_session_equals_the_reference(three):
    target = "ipv4:" + ",".join(server.target for server in three)
    with attnserve.Replicas(target) as replicas:
        sharded = attnserve.ShardedSession(replicas, 16, num_layers=1, num_heads=4,
                                           num_kv_heads=2, key_dim=D)
        keys, values = uniform(2, 40, D), uniform(2, 40, D)
        sharded.step(0, key=keys, value=values)
        assert [s.lengths[0] for s in sharded.shards] == [16, 16, 8]
        assert len({s.address for s in sharded.shards}) == 3
        for _ in range(3):
            k, v, q = uniform(2, 1, D), uniform(2, 1, D), uniform(4, 1, D)
            output, lse, length = sharded.step(0, key=k, value=v, query=q, return_lse=True)
            keys, values = np.concatenate([keys, k], 1), np.concatenate([values, v], 1)
            assert length == keys.shape[1] and lse.shape == (4, 1)
            np.testing.assert_allclose(output, expected_step(q, keys, values), atol=1e-5)
        with pytest.raises(ValueError, match="query holds 2 rows"):
            sharded.step(0, query=uniform(4, 2, D))
        # Checked before any shard is sent anything: a layer outside the session, an option.
        with pytest.raises(ValueError, match=r"layer is 1, expected 0 to 0"):
            sharded.step(1, key=uniform(2, 20, D), value=uniform(2, 20, D))
        with pytest.raises(ValueError, match="output_dtype is 'bool'"):
            sharded.step(0, key=uniform(2, 20, D), value=uniform(2, 20, D),
                         query=uniform(4, 1, D), output_dtype="bool")
        # A query, key or value a shard would refuse, with an append spanning shards.
        for inputs, message in (
                (dict(query=uniform(5, 1, D)), r"query is an array of shape \[5, 1, 8\]"),
                (dict(query=uniform(4, 1, D + 1)), r"expected \[4, T, 8\] \(the session's\)"),
                (dict(value=uniform(2, 20, D + 2)), r"value is an array of shape"),
                (dict(query=np.ones((4, 1, D), np.int32)), "query is a NumPy int32 array"),
                (dict(value=uniform(2, 19, D)), "key holds 20 tokens and value 19")):
            step = dict(dict(key=uniform(2, 20, D), value=uniform(2, 20, D)), **inputs)
            with pytest.raises(ValueError, match=message):
                sharded.step(0, **step)
        assert sharded.lengths == [keys.shape[1]]
        assert [s.lengths[0] for s in sharded.shards] == [16, 16, keys.shape[1] - 32]
        # The merged answer in the dtype one session answers (float32 always until
        # 2026-12-07); a key given as nested lists, as Session.step takes it.
        q = uniform(4, 1, D)
        for options, dtype in ((dict(output_dtype="float16"), np.float16),
                               (dict(input_dtype="float16"), np.float16),
                               (dict(output_dtype="bfloat16"), np.float32),
                               (dict(), np.float32)):
            output, _, _ = sharded.step(0, query=q, **options)
            assert output.dtype == dtype, options
            if options.get("output_dtype") == "bfloat16":
                assert not np.any(output.view(np.uint32) & 0xFFFF)
            np.testing.assert_allclose(output, expected_step(q, keys, values), atol=1e-2)
        k, v = uniform(2, 1, D), uniform(2, 1, D)
        assert sharded.step(0, key=k.tolist(), value=v.tolist())[2] == keys.shape[1] + 1
        sharded.delete()


def test_a_sharded_step_that_failed_half_way_is_not_appended_twice(three):
    """A step whose query shard failed while its last shard appended: the append stands and
    lengths says so (a retried step appended twice until 2026-12-06); the pieces cut at shard
    boundaries keep the step's input_dtype; a shard is still made, on a holder, when the only
    replica to spare is gone."""
    target = "ipv4:" + ",".join(server.target for server in three)
    with attnserve.Replicas(target) as replicas:
        sharded = attnserve.ShardedSession(replicas, 4, num_layers=1, num_heads=H,
                                           num_kv_heads=HKV, key_dim=D)
        keys, values = uniform(HKV, 6, D), uniform(HKV, 6, D)
        # Rounded to bfloat16 on every shard, the piece cut at the boundary too.
        sharded.step(0, key=keys, value=values, input_dtype="bfloat16")
        keys = attnserve.bfloat16_bits_to_float32(attnserve.float32_to_bfloat16_bits(keys))
        values = attnserve.bfloat16_bits_to_float32(
            attnserve.float32_to_bfloat16_bits(values))
        by_target = {server.target: server for server in three}
        first = by_target[sharded.shards[0].address]
        k, v, q = uniform(HKV, 1, D), uniform(HKV, 1, D), uniform(H, 1, D)
        stop(first)
        try:
            with pytest.raises(attnserve.AttnserveError, match=r"append stands \(lengths is 7\)"):
                sharded.step(0, key=k, value=v, query=q, timeout=1.5)
        finally:
            first.process.send_signal(signal.SIGCONT)
        assert sharded.lengths == [7]
        keys, values = np.concatenate([keys, k], 1), np.concatenate([values, v], 1)
        output, _, length = sharded.step(0, query=q)
        assert length == 7
        np.testing.assert_allclose(output, expected_step(q, keys, values), atol=1e-5)

        holding = {shard.address for shard in sharded.shards}
        for server in three:
            if server.target not in holding:
                server.process.kill()
                server.process.wait(30)
        sharded.step(0, key=uniform(HKV, 2, D), value=uniform(HKV, 2, D))
        assert len(sharded.shards) == 3 and sharded.shards[2].address in holding
        assert sharded.lengths == [9]


def test_a_new_shard_goes_to_a_holder_when_the_spares_hang(three):
    # Both replicas to spare are stopped, their channels connected: they get half the step's
    # time, and the shard goes on the replica holding shard 0 (the spares took it all, and
    # the step failed DEADLINE_EXCEEDED, until 2026-12-07).
    target = "ipv4:" + ",".join(server.target for server in three)
    with attnserve.Replicas(target) as replicas:
        for server in three:
            replicas.client(server.target).list_sessions()
        sharded = attnserve.ShardedSession(replicas, 2, num_layers=1, num_heads=H,
                                           num_kv_heads=HKV, key_dim=D)
        model = Model()
        k, v = model.append(2)
        sharded.step(0, key=k, value=v)
        holder = sharded.shards[0].address
        spares = [server for server in three if server.target != holder]
        for server in spares:
            stop(server)
        try:
            k, v = model.append(1)
            q = uniform(H, 1, D)
            output, _, length = sharded.step(0, key=k, value=v, query=q, timeout=8)
        finally:
            for server in spares:
                server.process.send_signal(signal.SIGCONT)
        assert length == 3 and sharded.shards[1].address == holder
        np.testing.assert_allclose(output, expected_step(q, model.keys, model.values),
                                   atol=1e-5)
        sharded.delete()
        # What a sharded session cannot take, as the C++ one refuses it.
        for options, message in ((dict(session_id="a" * 32), "session_id cannot be given"),
                                 (dict(max_tokens=4), r"shard_tokens is 8, expected 1 to 4 "
                                                      r"\(max_tokens\)")):
            with pytest.raises(ValueError, match=message):
                attnserve.ShardedSession(replicas, 8, num_layers=1, num_heads=H,
                                         num_kv_heads=HKV, key_dim=D, **options)


def test_a_sharded_step_says_which_tokens_stand_and_a_lost_shard_ends_the_session(three):
    """A prefill whose later shard failed says which of its tokens stand, and lengths agrees
    (it said nothing, and the retried step appended them twice, until 2026-12-06); a shard
    whose replica is gone says the sharded session is not rebuilt, and a shard rebuilt empty
    by hand is refused rather than merged; delete() deletes every shard it can reach."""
    target = "ipv4:" + ",".join(server.target for server in three)
    by_target = {server.target: server for server in three}
    with attnserve.Replicas(target) as replicas:
        sharded = attnserve.ShardedSession(replicas, 4, num_layers=1, num_heads=H,
                                           num_kv_heads=HKV, key_dim=D)
        keys, values = uniform(HKV, 4, D), uniform(HKV, 4, D)
        sharded.step(0, key=keys, value=values)
        sharded._ensure(2, None)  # as a step that failed after making its shards leaves them
        assert len({shard.address for shard in sharded.shards}) == 3
        third = by_target[sharded.shards[2].address]
        k, v = uniform(HKV, 5, D), uniform(HKV, 5, D)
        stop(third)
        try:
            with pytest.raises(attnserve.AttnserveError,
                               match=r"^DEADLINE_EXCEEDED: shard 2: .*; the step's first 4 "
                                     r"tokens stand \(lengths is 8\): send the rest"):
                sharded.step(0, key=k, value=v, timeout=1.5)
        finally:
            third.process.send_signal(signal.SIGCONT)
        assert sharded.lengths == [8]
        sharded.step(0, key=k[:, 4:], value=v[:, 4:])  # the rest
        keys, values = np.concatenate([keys, k], 1), np.concatenate([values, v], 1)
        q = uniform(H, 1, D)
        output, _, length = sharded.step(0, query=q)
        assert length == 9 and [s.lengths[0] for s in sharded.shards] == [4, 4, 1]
        np.testing.assert_allclose(output, expected_step(q, keys, values), atol=1e-5)

        second = by_target[sharded.shards[1].address]
        second.process.kill()
        second.process.wait(30)
        with pytest.raises(attnserve.ReplicaGoneError) as gone:
            sharded.step(0, key=k[:, :1], value=v[:, :1], query=q, timeout=10)
        assert gone.value.message.startswith("shard 1: ")
        assert "a sharded session is not rebuilt: delete() it" in gone.value.message
        assert "send the query again" not in gone.value.message
        # Not the Session's advice to rebuild the shard, which the next step would refuse.
        assert "rebuild" not in gone.value.message.replace("is not rebuilt", "")
        assert sharded.lengths == [10]
        # Every later step touching the lost shard's tokens is refused, an append to the last
        # shard alone too (it was taken, and the layer held a hole, until 2026-12-07).
        for step in (dict(key=k[:, :1], value=v[:, :1]), dict(query=q)):
            with pytest.raises(attnserve.AttnserveError,
                               match=r"^FAILED_PRECONDITION: shard 1 \(session .*\) was lost "
                                     r"with its replica, and with it layer 0's tokens from 4"):
                sharded.step(0, **step)
        assert sharded.lengths == [10]
        live = [sharded.shards[0], sharded.shards[2]]
        for _ in range(2):  # the shard on the dead replica fails each time; the rest go
            with pytest.raises(attnserve.ReplicaGoneError, match=r"^ABORTED: shard 1: "):
                sharded.delete(timeout=10)
            for shard in live:
                assert shard.deleted
                assert shard.id not in {info.session_id for info in
                                        replicas.client(shard.address).list_sessions()}
        # A query on a layer with no tokens asks shard 0 alone: a lost shard 0 is told the
        # same way (it said "rebuild()" without the shard).
        empty = attnserve.ShardedSession(replicas, 4, num_layers=2, num_heads=H,
                                         num_kv_heads=HKV, key_dim=D)

        def lost(*args, **kwargs):
            raise attnserve.ReplicaGoneError("its replica is gone", empty.shards[0].address)

        empty.shards[0].step = lost
        with pytest.raises(attnserve.ReplicaGoneError) as told:
            empty.step(1, query=q)
        assert told.value.message.startswith("shard 0: its replica is gone")
        assert "a sharded session is not rebuilt: delete() it" in told.value.message
        del empty.shards[0].step
        empty.delete()
        # A replica that hangs does not keep the others' shards alive either.
        hung = attnserve.ShardedSession(replicas, 4, num_layers=1, num_heads=H,
                                        num_kv_heads=HKV, key_dim=D)
        hung.step(0, key=uniform(HKV, 6, D), value=uniform(HKV, 6, D))
        stopped = by_target[hung.shards[0].address]
        stop(stopped)
        try:
            with pytest.raises(attnserve.AttnserveError):
                hung.delete(timeout=2)
        finally:
            stopped.process.send_signal(signal.SIGCONT)
        assert [shard.deleted for shard in hung.shards] == [False, True]
        hung.delete(timeout=10)
        # Rebuilt empty by hand, the lost shard is still refused, not merged.
        sharded.shards[1].rebuild(timeout=10)
        with pytest.raises(attnserve.AttnserveError, match=r"shard 1 \(session .*\) was lost"):
            sharded.step(0, query=q)
        sharded.delete(timeout=10)  # the rebuilt shard alone
        assert sharded.shards[1].deleted
        # A shard rebuilt empty by hand before any step saw it lost: refused too.
        rebuilt = attnserve.ShardedSession(replicas, 4, num_layers=1, num_heads=H,
                                           num_kv_heads=HKV, key_dim=D)
        rebuilt.step(0, key=uniform(HKV, 6, D), value=uniform(HKV, 6, D))
        rebuilt.shards[1].rebuild(timeout=10)
        with pytest.raises(attnserve.AttnserveError,
                           match=r"shard 1 \(session .*\) holds 0 tokens of layer 0, "
                                 r"expected 2 of its 6"):
            rebuilt.step(0, query=q)
        rebuilt.delete(timeout=10)


def test_a_fork_on_a_draining_replica_says_its_sessions_go_with_it():
    server = Server("--drain_grace_seconds=10", "--replica_name=py-draining")
    try:
        with attnserve.Replicas("ipv4:" + server.target) as replicas:
            session = replicas.create_session(num_layers=1, num_heads=H, key_dim=D)
            session.step(0, key=uniform(H, 3, D), value=uniform(H, 3, D))
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while True:  # until the drain has begun
                try:
                    session.fork().delete()
                except attnserve.ReplicaGoneError as gone:
                    assert "is gone, and the session with it: it is unreachable or draining" \
                        in gone.message and "is draining" in gone.message
                    break
                assert time.monotonic() < deadline, "the drain did not begin"
                time.sleep(0.02)
            # Its steps are served through the grace.
            assert session.step(0, key=uniform(H, 1, D), value=uniform(H, 1, D),
                                query=uniform(H, 1, D)).length == 4
    finally:
        server.stop()


def test_a_hung_replica_gets_its_share_of_a_create_not_all_of_it(three):
    # A stopped replica that is a session's first choice answers nothing: it is given an equal
    # share of the time left (2 s of 6 s with three to ask), and the session goes to the next.
    # It used to take the whole 6 s, and the create failed DEADLINE_EXCEEDED.
    target = "ipv4:" + ",".join(server.target for server in three)
    with attnserve.Replicas(target) as replicas:
        hung = three[1]
        session_id = attnserve.random_session_id()
        while replicas.rank(session_id)[0] != hung.target:
            session_id = attnserve.random_session_id()
        for server in three:  # connected: a call to the stopped one waits, unanswered
            replicas.client(server.target).list_sessions()
        stop(hung)
        try:
            session = replicas.create_session(session_id=session_id, timeout=6, num_layers=1,
                                              num_heads=H, num_kv_heads=HKV, key_dim=D)
        finally:
            hung.process.send_signal(signal.SIGCONT)
        assert session.address != hung.target
        model = Model()
        k, v = model.append(3)
        session.step(0, key=k, value=v)
        decode(session, model)
