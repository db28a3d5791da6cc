"""The package shared by threads: one Session stepped from a thread per layer while its
replica dies and a rebuild hook restores it (from threads of its own, too), and Replicas
refreshed and closed from many threads at once (thread switches forced every microsecond, as
a loaded host makes them)."""
import concurrent.futures
import sys
import threading
import time

import grpc
import numpy as np
import pytest

import attnserve
from attnserve import replicas as replicas_module
from attnserve_client import reference_sdpa
from conftest import Server

H, HKV, D = 4, 2, 16


def expected_step(q, keys, values):
    return reference_sdpa(q[None], keys[None], values[None], causal=True,
                          causal_alignment="BOTTOM_RIGHT")[0]


@pytest.fixture()
def forced_switches():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.fixture()
def two():
    """Two replicas, and Replicas over them with one retry."""
    servers = [Server(f"--replica_name=t-{i}") for i in range(2)]
    try:
        with attnserve.Replicas("ipv4:" + ",".join(s.target for s in servers),
                                retry=attnserve.RetryPolicy(max_attempts=2)) as replicas:
            yield servers, replicas
    finally:
        for server in servers:
            server.stop()


def test_a_thread_per_layer_waits_out_another_threads_rebuild(two):
    servers, replicas = two
    session = replicas.create_session(num_layers=2, num_heads=H, num_kv_heads=HKV,
                                      key_dim=D)
    victim = next(s for s in servers if s.target == session.address)
    survivor = next(s for s in servers if s is not victim)
    rng = np.random.default_rng(31)
    held = [rng.uniform(-1, 1, (HKV, 16, D)).astype(np.float32) for _ in range(2)]
    guard = threading.Lock()
    for layer in range(2):
        session.step(layer, key=held[layer], value=held[layer])
    rebuilds = []

    def prefill(fresh, lengths, timeout):
        rebuilds.append(lengths)
        for layer, length in enumerate(lengths):
            with guard:
                tokens = held[layer][:, :length]
            fresh.step(layer, key=tokens, value=tokens, timeout=timeout)
            time.sleep(0.3)  # a prefill takes a while: the other thread comes

    session.rebuild_hook = prefill
    outcome = {}

    def layer0():
        for _ in range(60):
            k = rng.uniform(-1, 1, (HKV, 1, D)).astype(np.float32)
            session.step(0, key=k, value=k, timeout=20)
            with guard:
                held[0] = np.concatenate([held[0], k], 1)
            time.sleep(0.01)
            if rebuilds:
                break
        outcome[0] = "ok"

    def layer1():
        time.sleep(0.4)  # while the replica dies and layer 0's step rebuilds
        q = rng.uniform(-1, 1, (H, 1, D)).astype(np.float32)
        k = rng.uniform(-1, 1, (HKV, 1, D)).astype(np.float32)
        result = session.step(1, key=k, value=k, query=q, timeout=20)
        with guard:
            held[1] = np.concatenate([held[1], k], 1)
        outcome[1] = (result, q)

    threads = [threading.Thread(target=layer0), threading.Thread(target=layer1)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    victim.process.kill()
    for thread in threads:
        thread.join(60)
    assert outcome.get(0) == "ok" and 1 in outcome, outcome
    result, q = outcome[1]
    assert result.length == held[1].shape[1] == 17
    np.testing.assert_allclose(result.output, expected_step(q, held[1], held[1]),
                               atol=1e-5)
    # Rebuilt once, on the survivor, and its layers hold what the client believes.
    assert len(rebuilds) == 1 and session.address == survivor.target
    assert len(replicas.client(survivor.target).list_sessions()) == 1
    server_lengths = list(replicas.client(survivor.target).get_session(session.id)
                          .lengths)
    assert server_lengths == session.lengths == [held[0].shape[1], 17]


def test_a_rebuild_hook_may_restore_the_layers_from_threads_of_its_own(two):
    servers, replicas = two
    session = replicas.create_session(num_layers=2, num_heads=H, num_kv_heads=HKV,
                                      key_dim=D)
    rng = np.random.default_rng(32)
    held = [rng.uniform(-1, 1, (HKV, 5, D)).astype(np.float32) for _ in range(2)]
    for layer in range(2):
        session.step(layer, key=held[layer], value=held[layer])
    # Timeouts are checked before any wait.
    for bad in ("5", True, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout is"):
            session.step(0, query=np.zeros((H, 1, D), np.float32), timeout=bad)

    def prefill(fresh, lengths, timeout):
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            for future in [pool.submit(fresh.step, layer,
                                       key=held[layer][:, :lengths[layer]],
                                       value=held[layer][:, :lengths[layer]],
                                       timeout=timeout)
                           for layer in range(2)]:
                future.result()

    session.rebuild_hook = prefill
    next(s for s in servers if s.target == session.address).process.kill()
    q = rng.uniform(-1, 1, (H, 1, D)).astype(np.float32)
    result = session.step(1, query=q, timeout=20)
    assert session.lengths == [5, 5]
    np.testing.assert_allclose(result.output, expected_step(q, held[1], held[1]),
                               atol=1e-5)


def test_replicas_refreshed_and_closed_from_many_threads_make_each_client_once(
        monkeypatch, forced_switches):
    made = []

    class CountingClient(replicas_module.Client):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    resolved = ["127.0.0.1:1"]
    monkeypatch.setattr(replicas_module, "Client", CountingClient)
    monkeypatch.setattr(replicas_module, "resolve", lambda target: sorted(resolved))
    replicas = attnserve.Replicas("dns:///scaling:1")
    for round_ in range(10):
        resolved.extend(f"127.0.{round_ + 1}.{i}:1" for i in range(1, 4))  # a scale-up
        barrier = threading.Barrier(8)

        def refresh():
            barrier.wait(5)
            replicas.refresh()

        threads = [threading.Thread(target=refresh) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert len(made) == len(resolved) == 31
    assert all(replicas.client(address) is not None for address in resolved)

    errors = []
    for round_ in range(20):
        other = attnserve.Replicas("dns:///scaling:1")
        resolved.extend(f"10.8.{round_}.{i}:1" for i in range(10))
        barrier = threading.Barrier(2)

        def closer():
            barrier.wait(5)
            try:
                other.close()
            except Exception as error:  # noqa: BLE001 - any exception is the failure
                errors.append(error)

        def refresher():
            barrier.wait(5)
            other.refresh()

        threads = [threading.Thread(target=closer), threading.Thread(target=refresher)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        # Whatever refresh made before close() is closed; nothing after.
        assert all(client._closed for client in other._clients.values())
    assert errors == []
    replicas.close()
    with pytest.raises(attnserve.AttnserveError, match="is closed") as closed:
        replicas.create_session(num_layers=1, num_heads=H, key_dim=D)
    assert closed.value.code.name == "CANCELLED"


def test_a_step_waiting_for_another_threads_keeps_to_the_default_timeout(server):
    """A step given no timeout waits for the session's lock and then calls, all within the
    client's default: until 2026-12-07 it waited up to the default and then had the whole
    default again (a server slow to answer both: 3.9 s for a default of 2 s, an audit)."""
    with attnserve.Client(server.target, timeout=2.0) as client:
        session = client.create_session(num_layers=1, num_heads=H, num_kv_heads=HKV,
                                         key_dim=D)
        real = client.call_counting

        def slow(method, request, timeout=None, retryable=True, also_retry_on=()):
            time.sleep(timeout)  # A server that answers only at the deadline.
            raise attnserve.AttnserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"{method}: slow")

        query = np.zeros((H, 1, D), np.float32)

        def first():
            with pytest.raises(attnserve.AttnserveError):
                session.step(0, query=query)

        client.call_counting = slow
        try:
            thread = threading.Thread(target=first)
            thread.start()
            time.sleep(0.3)
            began = time.monotonic()
            with pytest.raises(attnserve.AttnserveError):
                session.step(0, query=query)
            took = time.monotonic() - began
            thread.join()
        finally:
            client.call_counting = real
        assert took < 3.0, f"the second step took {took:.2f} s with a default of 2 s"
        session.delete()
