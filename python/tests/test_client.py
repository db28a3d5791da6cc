"""attnserve (the Python package) against live servers, every answer checked against the
float64 NumPy reference of examples/python (reference_sdpa, reference_mha)."""
import os
import re
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

import attnserve
from attnserve.v1 import attention_pb2
from attnserve_client import reference_mha, reference_sdpa
from conftest import Server

RNG = np.random.default_rng(2026)


def uniform(*shape):
    return RNG.uniform(-1, 1, shape).astype(np.float32)


def reference_lse(q, k, scale=None, **masking):
    """log Σ_j exp(scale · q·k_j) over the keys each row sees (the reference's own masking,
    through the outputs of an all-ones value)."""
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    group = q.shape[1] // k.shape[1]
    k64 = np.repeat(k64, group, axis=1)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q64 @ k64.swapaxes(-1, -2)
    # Which keys each row sees: the reference over one-hot values.
    eye = np.broadcast_to(np.eye(k.shape[2]), k.shape[:2] + (k.shape[2], k.shape[2]))
    seen = reference_sdpa(q, k, eye, scale=scale, **masking) > 0
    scores = np.where(seen, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0]


def test_the_package_is_the_installed_one():
    expected = os.environ.get("ATTNSERVE_EXPECTED_PACKAGE_DIR")
    if expected is None:
        pytest.skip("ATTNSERVE_EXPECTED_PACKAGE_DIR is not set")
    assert os.path.realpath(attnserve.__file__).startswith(os.path.realpath(expected))


def test_attend_matches_the_reference(server):
    q, k, v = uniform(2, 4, 5, 16), uniform(2, 2, 9, 16), uniform(2, 2, 9, 8)
    options = dict(causal=True, causal_alignment="bottom_right", key_lengths=[9, 6], scale=0.3)
    with attnserve.Client(server.target) as client:
        result = client.attend(q, k, v, return_lse=True, **options)
    assert result.output.dtype == np.float32 and result.output.shape == (2, 4, 5, 8)
    np.testing.assert_allclose(result.output, reference_sdpa(q, k, v, **options), atol=1e-5)
    np.testing.assert_allclose(result.lse, reference_lse(q, k, **options), atol=1e-5)
    assert result.weights is None
    assert 0 <= result.timing.compute_us <= result.timing.server_us


def test_attend_stream_answers_in_order_and_a_bad_request_fails_alone(server):
    shapes = [((1, 2, 3, 8), (1, 2, 5, 8)), ((2, 4, 1, 16), (2, 2, 7, 16)),
              ((1, 1, 4, 8), (1, 1, 4, 8))]
    inputs = [(uniform(*q), uniform(*k), uniform(*k)) for q, k in shapes]
    with attnserve.Client(server.target) as client:
        requests = [client.attend_request(q, k, v, causal=True) for q, k, v in inputs]
        # The second asks for a key_dim its query does not have.
        requests.insert(1, client.attend_request(uniform(1, 2, 3, 8), uniform(1, 2, 5, 4),
                                                 uniform(1, 2, 5, 4)))
        answers = list(client.attend_stream(iter(requests), timeout=30))
    assert [index for index, _ in answers] == [0, 1, 2, 3]
    refused = answers[1][1]
    assert isinstance(refused, attnserve.AttnserveError)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "key" in refused.message
    for (q, k, v), (_, result) in zip(inputs, answers[:1] + answers[2:]):
        assert isinstance(result, attnserve.AttendResult)
        np.testing.assert_allclose(result.output, reference_sdpa(q, k, v, causal=True),
                                   atol=1e-5)
        assert 0 <= result.timing.compute_us <= result.timing.server_us


def test_attend_stream_refuses_what_is_not_a_request_and_a_closed_client(server):
    q = uniform(1, 1, 2, 8)
    client = attnserve.Client(server.target)
    good = client.attend_request(q, q, q)
    with pytest.raises(TypeError, match=r"requests\[1\] is a str, expected an AttendRequest"):
        list(client.attend_stream([good, "not a request"]))

    def failing():
        yield good
        raise KeyError("the caller's own")

    with pytest.raises(KeyError, match="the caller's own"):
        list(client.attend_stream(failing()))
    # A consumer that stops early ends the stream; the client goes on.
    stream = client.attend_stream(iter([good] * 3))
    assert next(stream)[0] == 0
    stream.close()
    assert client.attend(q, q, q).output.shape == (1, 1, 2, 8)
    client.close()
    with pytest.raises(attnserve.AttnserveError, match="the client is closed") as closed:
        list(client.attend_stream([good]))
    assert closed.value.code == grpc.StatusCode.CANCELLED


def test_weights_and_masks(server):
    q, k, v = uniform(1, 2, 6, 8), uniform(1, 2, 7, 8), uniform(1, 2, 7, 8)
    mask = RNG.uniform(size=(6, 7)) < 0.7
    mask[:, 0] = True  # every row sees a key
    with attnserve.Client(server.target) as client:
        result = client.attend(q, k, v, attn_mask=mask, return_weights="per_head")
    expected_weights = reference_sdpa(
        q, k, np.broadcast_to(np.eye(7), (1, 2, 7, 7)), attn_mask=mask)
    np.testing.assert_allclose(result.weights, expected_weights, atol=1e-5)
    np.testing.assert_allclose(result.output, reference_sdpa(q, k, v, attn_mask=mask),
                               atol=1e-5)


def test_bfloat16_goes_from_float32_and_comes_back_widened(server):
    q, k, v = uniform(1, 2, 4, 16), uniform(1, 2, 6, 16), uniform(1, 2, 6, 16)
    with attnserve.Client(server.target) as client:
        result = client.attend(q, k, v, input_dtype="bfloat16", output_dtype="bfloat16")
    rounded = [attnserve.bfloat16_bits_to_float32(attnserve.float32_to_bfloat16_bits(x))
               for x in (q, k, v)]
    assert result.output.dtype == np.float32
    # Every value is a bfloat16: its low 16 bits are zero.
    assert not np.any(result.output.view(np.uint32) & 0xFFFF)
    np.testing.assert_allclose(result.output, reference_sdpa(*rounded), atol=2 ** -7)


def test_bfloat16_bits_of_scalars_and_zero_dimensional_arrays():
    """A scalar or 0-d array rounds as an array does (each raised TypeError until 2026-12-07:
    NumPy's casting of a uint64 scalar with a Python int)."""
    for value in (1.0, np.float32(1.5), np.array(3.0), np.array(1.00390625, np.float32)):
        bits = attnserve.float32_to_bfloat16_bits(value)
        assert bits.shape == () and bits.dtype == np.uint16
        assert bits == attnserve.float32_to_bfloat16_bits(np.atleast_1d(value))[0]
    assert attnserve.float32_to_bfloat16_bits(1.00390625) == 0x3F80  # a tie, to even
    tensor = attnserve.to_tensor(np.array(2.0, np.float32), "bfloat16")
    assert list(tensor.shape) == [] and tensor.data == b"\x00\x40"


def test_multi_head_attention_inline_and_registered(server):
    shapes = dict(w_q=(16, 16), w_k=(8, 16), w_v=(8, 16), w_o=(16, 16), b_q=(16,), b_k=(8,),
                  b_v=(8,), b_o=(16,))
    weights = {name: RNG.uniform(-0.5, 0.5, shape).astype(np.float32)
               for name, shape in shapes.items()}
    heads = dict(num_heads=4, num_kv_heads=2)
    x = uniform(2, 5, 16)
    name = f"pytest-{os.getpid()}"
    with attnserve.Client(server.target) as client:
        inline = client.mha(x, weights=weights, causal=True, **heads)
        put = client.put_weights(name, weights, **heads)
        assert put.version > 0 and put.bytes > 0
        listed = {info.name: info for info in client.list_weights()}
        assert listed[name].version == put.version and listed[name].num_kv_heads == 2
        registered = client.mha(x, weights_name=name, causal=True)
        assert registered.weights_version == put.version
        client.delete_weights(name)
        assert name not in {info.name for info in client.list_weights()}
        with pytest.raises(attnserve.AttnserveError) as gone:
            client.mha(x, weights_name=name)
    expected = reference_mha(x, weights, heads, causal=True)
    np.testing.assert_allclose(inline.output, expected, atol=1e-4)
    np.testing.assert_allclose(registered.output, expected, atol=1e-4)
    assert gone.value.code == grpc.StatusCode.NOT_FOUND and name in gone.value.message


def test_list_weights_walks_every_page():
    # 4 KiB messages hold about 100 sets' descriptions: 200 take two pages or more.
    small = Server("--max_message_bytes=4096", "--demo_weights=false")
    try:
        tiny = {name: uniform(2, 2) for name in ("w_q", "w_k", "w_v", "w_o")}
        names = [f"set-{i:03d}" for i in range(200)]
        with attnserve.Client(small.target) as client:
            for name in names:
                client.put_weights(name, tiny, num_heads=1, num_kv_heads=1)
            first = client.call("ListWeights", attention_pb2.ListWeightsRequest())
            assert 0 < len(first.weights) < 200 and first.next_page_token
            assert [info.name for info in client.list_weights()] == names
            # The walk has one deadline: each page gets what the pages before it left.
            timeouts, call = [], client.call

            def slow_call(method, request, timeout=None, retryable=True):
                timeouts.append(timeout)
                time.sleep(0.2)
                return call(method, request, timeout, retryable)

            client.call = slow_call
            assert len(client.list_weights(timeout=30)) == 200
            assert len(timeouts) >= 2 and timeouts[0] <= 30
            assert all(b <= a - 0.2 for a, b in zip(timeouts, timeouts[1:])), timeouts
            with pytest.raises(attnserve.AttnserveError) as late:
                client.list_weights(timeout=0.1)
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        small.stop()


def test_errors_carry_the_code_and_the_field(server):
    with attnserve.Client(server.target) as client:
        with pytest.raises(attnserve.AttnserveError) as error:
            client.attend(uniform(1, 1, 2, 8), uniform(1, 1, 3, 16), uniform(1, 1, 3, 8))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "key.shape[3] (Dk)" in error.value.message
    assert str(error.value).startswith("INVALID_ARGUMENT: ")
    with pytest.raises(ValueError, match="causal_alignment"):
        attnserve.attention_options(causal_alignment="sideways")


def test_a_deadline_that_passes_is_deadline_exceeded(server):
    q = uniform(1, 8, 2048, 64)
    with attnserve.Client(server.target) as client:
        with pytest.raises(attnserve.AttnserveError) as error:
            client.attend(q, q, q, timeout=0.001)
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unavailable_is_retried_with_backoff():
    # A port nothing listens on: every attempt fails UNAVAILABLE.
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    policy = attnserve.RetryPolicy(max_attempts=4, initial_backoff=0.02, max_backoff=0.1)
    with attnserve.Client(f"127.0.0.1:{port}", retry=policy) as client:
        with pytest.raises(attnserve.AttnserveError) as error:
            client.list_weights(timeout=20)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert error.value.attempts == 4
    no_retry = attnserve.RetryPolicy(max_attempts=1)
    with attnserve.Client(f"127.0.0.1:{port}", retry=no_retry) as client:
        with pytest.raises(attnserve.AttnserveError) as error:
            client.list_weights(timeout=20)
    assert error.value.attempts == 1


def test_compression_both_ways(server):
    q, k, v = uniform(1, 2, 8, 16), np.zeros((1, 2, 64, 16), np.float32), uniform(1, 2, 64, 16)
    with attnserve.Client(server.target, compression="gzip") as client:
        out = client.attend(q, k, v).output
    np.testing.assert_allclose(out, reference_sdpa(q, k, v), atol=1e-5)
    # A request inflating to megabytes (the server inflates into 64 KiB slices; zeros
    # inflate past the end of their input), in both encodings.
    q, k, v = uniform(1, 4, 32, 64), np.zeros((1, 4, 2048, 64), np.float32), \
        uniform(1, 4, 2048, 64)
    for encoding in ("gzip", "deflate"):
        with attnserve.Client(server.target, compression=encoding) as client:
            out = client.attend(q, k, v).output
        np.testing.assert_allclose(out, reference_sdpa(q, k, v), atol=1e-5)
    with pytest.raises(ValueError, match="compression"):
        attnserve.Client(server.target, compression="zstd")


def test_tls_and_token(secure_server, certificates):
    read = lambda name: (certificates / name).read_bytes()  # noqa: E731
    tls = dict(root_certificates=read("ca.crt"), certificate_chain=read("client.crt"),
               private_key=read("client.key"))
    with attnserve.Client(secure_server.target, token="pytest-token", **tls) as client:
        assert any(info.name == "demo" for info in client.list_weights())
    with attnserve.Client(secure_server.target, **tls) as client:
        with pytest.raises(attnserve.AttnserveError) as error:
            client.list_weights()
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
    with attnserve.Client(secure_server.target, token="wrong", **tls) as client:
        with pytest.raises(attnserve.AttnserveError) as error:
            client.list_weights()
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
    # Without a client certificate the mutual-TLS handshake fails.
    no_retry = attnserve.RetryPolicy(max_attempts=1)
    with attnserve.Client(secure_server.target, token="pytest-token", retry=no_retry,
                          root_certificates=read("ca.crt")) as client:
        with pytest.raises(attnserve.AttnserveError) as error:
            client.list_weights(timeout=10)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def expected_step(q, keys, values):
    """A step's output: [H, Tq, Dk] over [Hkv, L, D], bottom-right causal."""
    return reference_sdpa(q[None], keys[None], values[None], causal=True,
                          causal_alignment="BOTTOM_RIGHT")[0]


def test_a_session_from_prefill_to_delete(server):
    H, Hkv, Dk, Dv = 4, 2, 8, 8
    with attnserve.Client(server.target) as client:
        session = client.create_session(num_layers=2, num_heads=H, num_kv_heads=Hkv,
                                        key_dim=Dk, value_dim=Dv)
        keys, values = uniform(Hkv, 10, Dk), uniform(Hkv, 10, Dv)
        assert session.step(1, key=keys, value=values).output is None
        for _ in range(3):
            k, v, q = uniform(Hkv, 1, Dk), uniform(Hkv, 1, Dv), uniform(H, 1, Dk)
            result = session.step(1, key=k, value=v, query=q, return_lse=True)
            keys, values = np.concatenate([keys, k], 1), np.concatenate([values, v], 1)
            np.testing.assert_allclose(result.output, expected_step(q, keys, values),
                                       atol=1e-5)
            assert result.lse.shape == (H, 1) and not result.recovered
            assert 0 <= result.timing.compute_us <= result.timing.server_us
        assert session.lengths == [0, 13]
        child = session.fork(length=11)
        assert child.lengths == [0, 11] and child.info.forked_from == session.id
        session.truncate(12)
        assert session.lengths == [0, 12]
        assert client.get_session(session.id).lengths == [0, 12]
        assert {s.session_id for s in client.list_sessions()} >= {session.id, child.id}
        child.delete()
        session.delete()
        with pytest.raises(attnserve.AttnserveError) as error:
            client.get_session(session.id)
    assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_a_delete_whose_answer_was_lost_is_done_at_the_next(server, monkeypatch):
    # The server deletes the session, and the answer is lost on its way (as a deadline that
    # passes meanwhile): the next delete()'s NOT_FOUND counts as done. It was raised, every
    # time, and `deleted` stayed False.
    with attnserve.Client(server.target) as client:
        session = client.create_session(num_layers=1, num_heads=2, num_kv_heads=2, key_dim=8)
        sent = client.call_counting

        def answer_lost(method, request, timeout=None, *args, **kwargs):
            sent(method, request, timeout, *args, **kwargs)
            raise attnserve.AttnserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           "Deadline Exceeded")

        monkeypatch.setattr(client, "call_counting", answer_lost)
        with pytest.raises(attnserve.AttnserveError) as lost:
            session.delete()
        assert lost.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not session.deleted
        monkeypatch.setattr(client, "call_counting", sent)
        session.delete()
        assert session.deleted
        # Without a failed delete, NOT_FOUND is the answer.
        other = client.create_session(num_layers=1, num_heads=2, num_kv_heads=2, key_dim=8)
        client.session(other.id).delete()
        with pytest.raises(attnserve.AttnserveError) as missing:
            other.delete()
        assert missing.value.code == grpc.StatusCode.NOT_FOUND and not other.deleted


def test_a_step_whose_answer_was_lost_is_recovered(server):
    """The step lands but its answer is lost (the client sees UNAVAILABLE): sent again, the
    server refuses it (the layer no longer holds the expected length), and the session finds
    the step landed and recomputes its output."""
    H, Hkv, D = 2, 1, 8
    with attnserve.Client(server.target) as client:
        session = client.create_session(num_layers=1, num_heads=H, num_kv_heads=Hkv,
                                        key_dim=D)
        keys, values = uniform(Hkv, 5, D), uniform(Hkv, 5, D)
        session.step(0, key=keys, value=values)
        real = client.call_counting

        def lose_the_answer(method, request, timeout=None, retryable=True):
            real(method, request, timeout, retryable)
            raise attnserve.AttnserveError(grpc.StatusCode.UNAVAILABLE, "answer lost")

        k, v, q = uniform(Hkv, 1, D), uniform(Hkv, 1, D), uniform(H, 1, D)
        client.call_counting = lose_the_answer
        with pytest.raises(attnserve.AttnserveError):
            session.step(0, key=k, value=v, query=q)
        client.call_counting = real
        assert session.lengths == [5]  # not known to have landed
        result = session.step(0, key=k, value=v, query=q)
        keys, values = np.concatenate([keys, k], 1), np.concatenate([values, v], 1)
        assert result.recovered and result.length == 6 and session.lengths == [6]
        np.testing.assert_allclose(result.output, expected_step(q, keys, values), atol=1e-5)
        # A stale length with no doubt about it is the server's refusal, as it is.
        session.lengths[0] = 3
        with pytest.raises(attnserve.AttnserveError) as error:
            session.step(0, key=k, value=v)
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        session.sync()
        assert session.lengths == [6]

        # The recovery keeps to the step's deadline: each call has what is left of it (until
        # 2026-12-07 the GetSession and the query's second sending each had all of it).
        client.call_counting = lose_the_answer
        with pytest.raises(attnserve.AttnserveError):
            session.step(0, key=k, value=v, query=q)
        given, began = [], time.monotonic()

        def slow(method, request, timeout=None, retryable=True):
            given.append((method, timeout, time.monotonic() - began))
            time.sleep(0.2)
            return real(method, request, timeout, retryable)

        client.call_counting = slow
        client.call = lambda method, request, timeout=None, retryable=True, also_retry_on=(): \
            slow(method, request, timeout, retryable)[0]
        result = session.step(0, key=k, value=v, query=q, timeout=1.0)
        del client.call
        client.call_counting = real
        assert result.recovered and [m for m, _, _ in given] == ["Step", "GetSession", "Step"]
        for method, timeout, at in given:
            assert timeout <= 1.0 - at + 0.01, (method, timeout, at)

        # The step landed, and sending its query again alone fails: the error says the
        # tokens are kept (it said only UNAVAILABLE, and a caller who sent the whole step
        # again appended it twice, its later outputs wrong without an error).
        client.call_counting = lose_the_answer
        with pytest.raises(attnserve.AttnserveError):
            session.step(0, key=k, value=v, query=q)
        client.call_counting = real

        asked = client.call

        def unreachable(method, request, *args, **kwargs):  # the query's second sending
            if method == "Step":
                raise attnserve.AttnserveError(grpc.StatusCode.UNAVAILABLE,
                                               "connection refused")
            return asked(method, request, *args, **kwargs)

        client.call = unreachable
        with pytest.raises(attnserve.AttnserveError) as failed:
            session.step(0, key=k, value=v, query=q)
        del client.call
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert ("the step had landed on an earlier attempt (its tokens are kept: layer 0 "
                "holds 8), but recomputing its lost output failed: connection refused; send "
                "the query again alone") in failed.value.message
        assert session.lengths == [8]
        keys = np.concatenate([keys, k, k], 1)  # the second and third sendings of k
        values = np.concatenate([values, v, v], 1)
        np.testing.assert_allclose(session.step(0, query=q).output,
                                   expected_step(q, keys, values), atol=1e-5)
        session.delete()


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_sharded_attend_is_exact(server, alignment):
    q, k, v = uniform(2, 4, 6, 8), uniform(2, 2, 23, 8), uniform(2, 2, 23, 8)
    mask = RNG.uniform(size=(2, 1, 6, 23)) < 0.8
    options = dict(causal=True, causal_alignment=alignment, key_lengths=[23, 17],
                   attn_mask=mask)
    with attnserve.Client(server.target) as one, attnserve.Client(server.target) as two:
        merged = attnserve.sharded_attend([one, two], q, k, v, shards=3, return_lse=True,
                                          **options)
        whole = one.attend(q, k, v, return_lse=True, **options)
    expected = reference_sdpa(q, k, v, **options)
    np.testing.assert_allclose(merged.output, expected, atol=1e-5)
    np.testing.assert_allclose(merged.output, whole.output, atol=2e-6)
    finite = np.isfinite(whole.lse)
    np.testing.assert_array_equal(np.isfinite(merged.lse), finite)
    np.testing.assert_allclose(merged.lse[finite], whole.lse[finite], atol=2e-6)
    with pytest.raises(ValueError, match="shards"):
        attnserve.sharded_attend([one], q, k, v, shards=24)
    for positional in (dict(window_left=4), dict(num_sink_tokens=2),
                       dict(alibi_slopes=[0.5] * q.shape[1])):
        with pytest.raises(ValueError, match="cannot be sharded"):
            attnserve.sharded_attend([one], q, k, v, shards=2, **positional)


def test_another_step_after_a_lost_answer_is_not_taken_for_the_lost_one(server):
    """Step A lands but its answer is lost; the caller then sends a different step B of the
    same length. The layer's E + T is A's doing: B is refused with FAILED_PRECONDITION saying
    A landed, and the session takes the server's length. Until 2026-12-07 B was taken for A,
    and B's query answered over A's keys, as recovered (an audit). A query alone after a lost
    append is told the same, not that another writer changed the session."""
    H, Hkv, D = 1, 1, 4
    with attnserve.Client(server.target) as client:
        session = client.create_session(num_layers=1, num_heads=H, num_kv_heads=Hkv,
                                        key_dim=D)
        session.step(0, key=uniform(Hkv, 3, D), value=uniform(Hkv, 3, D))
        real = client.call_counting

        def lose_the_answer(method, request, timeout=None, retryable=True):
            real(method, request, timeout, retryable)
            raise attnserve.AttnserveError(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost")

        def lost_step(**step):
            client.call_counting = lose_the_answer
            try:
                with pytest.raises(attnserve.AttnserveError):
                    session.step(0, **step)
            finally:
                client.call_counting = real

        a = dict(key=uniform(Hkv, 1, D), value=uniform(Hkv, 1, D), query=uniform(H, 1, D))
        lost_step(**a)
        assert session.lengths == [3]
        b = dict(key=uniform(Hkv, 1, D), value=uniform(Hkv, 1, D), query=uniform(H, 1, D))
        with pytest.raises(attnserve.AttnserveError) as refused:
            session.step(0, **b)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert ("an earlier step on layer 0 of session " in refused.value.message
                and "(1 tokens sent at length 3), given up without its answer, had landed: "
                "the layer holds 4 tokens" in refused.value.message)
        assert session.lengths == [4]
        assert session.step(0, **b).length == 5  # B, sent again after A, appends

        lost_step(key=a["key"], value=a["value"])
        with pytest.raises(attnserve.AttnserveError) as query_alone:
            session.step(0, query=a["query"])
        assert "given up without its answer, had landed" in query_alone.value.message
        assert session.lengths == [6]
        # The same step sent again is still the one recovered.
        lost_step(**a)
        result = session.step(0, **a)
        assert result.recovered and result.length == 7


def test_sharded_attend_refuses_what_one_call_refuses(server):
    """What is cut per shard is checked first, as one call checks it: a value longer than the
    key, a mask longer than Lk and a key length past Lk or negative were cut or clipped to fit
    until 2026-12-07, and answered (a negative length: every row 0)."""
    q, k, v = uniform(1, 2, 3, 8), uniform(1, 2, 4, 8), uniform(1, 2, 4, 8)
    with attnserve.Client(server.target) as client:
        for bad, message in ((dict(value=uniform(1, 2, 8, 8)), r"value.shape\[2\] is 8, expected 4"),
                             (dict(attn_mask=np.ones((3, 7), bool)), "attn_mask's shape is"),
                             (dict(key_lengths=[9]), r"key_lengths\[0\] is 9, expected 0 to 4"),
                             (dict(key_lengths=[-3]), r"key_lengths\[0\] is -3")):
            options = dict(bad)
            value = options.pop("value", v)
            with pytest.raises(attnserve.AttnserveError):
                client.attend(q, k, value, **options)
            with pytest.raises(ValueError, match=message):
                attnserve.sharded_attend([client], q, k, value, shards=2, **options)


def test_sharded_attend_refuses_a_window_of_zero(server):
    """A window of 0 is a window (only -1 or None is unbounded): as position-dependent as any,
    refused, as are ALiBi slopes given as an array; what is no window at all still shards."""
    q, k, v = uniform(1, 2, 6, 8), uniform(1, 2, 6, 8), uniform(1, 2, 6, 8)
    with attnserve.Client(server.target) as client:
        for positional in (dict(window_left=0, causal=True), dict(window_right=0),
                           dict(window_left=0, window_right=0), dict(window_left=np.int64(0)),
                           dict(alibi_slopes=np.array([0.5, 0.25], np.float32)),
                           dict(num_sink_tokens=np.int64(1))):
            with pytest.raises(ValueError, match="cannot be sharded"):
                attnserve.sharded_attend([client], q, k, v, shards=3, **positional)
        for unbounded in (dict(window_left=-1, causal=True), dict(window_right=None),
                          dict(num_sink_tokens=0, window_left=np.int64(-1))):
            merged = attnserve.sharded_attend([client], q, k, v, shards=3, **unbounded)
            whole = client.attend(q, k, v, **unbounded)
            np.testing.assert_allclose(merged.output, whole.output, atol=2e-6)


def test_sharded_attend_combines_a_bfloat16_mask_with_causality(server):
    """A uint16 mask is bfloat16 bit patterns: their values meet the causal mask, not the bits'."""
    q, k, v = uniform(1, 2, 4, 8), uniform(1, 2, 9, 8), uniform(1, 2, 9, 8)
    mask = attnserve.float32_to_bfloat16_bits(uniform(4, 9))
    with attnserve.Client(server.target) as client:
        merged = attnserve.sharded_attend([client], q, k, v, shards=3, attn_mask=mask,
                                          causal=True)
        whole = client.attend(q, k, v, attn_mask=mask, causal=True)
    np.testing.assert_allclose(merged.output, whole.output, atol=2e-6)


def test_a_value_out_of_place_is_a_value_error_before_any_call(server):
    q, k, v = uniform(1, 2, 3, 8), uniform(1, 2, 5, 8), uniform(1, 2, 5, 8)
    out_of_place = [
        (dict(output_dtype="bool"), "output_dtype is 'bool', expected float32, bfloat16 or"),
        (dict(input_dtype="bool"), "input_dtype is 'bool', expected float32, bfloat16 or"),
        (dict(causal="yes"), "causal is 'yes', expected True or False"),
        (dict(return_lse=1), "return_lse is 1, expected True or False"),
        (dict(attn_mask=np.ones((1, 5), np.int64)), "attn_mask is a NumPy int64 array"),
        (dict(key_lengths=[4.7]), r"key_lengths\[0\] is 4.7, expected an integer"),
        (dict(key_lengths=4), "key_lengths is 4, expected a sequence of integers"),
        (dict(key_lengths=np.ones((1, 1), np.int64)), "key_lengths is"),
        (dict(window_left=1.5), "window_left is 1.5, expected an integer"),
        (dict(window_right="2"), "window_right is '2', expected an integer"),
        (dict(num_sink_tokens=True), "num_sink_tokens is True, expected an integer"),
        (dict(scale="0.1"), "scale is '0.1', expected a number"),
        (dict(softcap=True), "softcap is True, expected a number"),
        (dict(alibi_slopes=["a", "b"]), "alibi_slopes is"),
        (dict(cu_seqlens_q=[0, 2.5]), r"cu_seqlens_q\[1\] is 2.5, expected an integer"),
        (dict(cu_seqlens_k=[0, 2**64]), r"cu_seqlens_k\[1\] is"),
        (dict(precision=["bf16"]), "precision is"),
    ]
    with attnserve.Client(server.target) as client:
        session = client.create_session(num_layers=2, num_heads=2, key_dim=8)
        real = client.call_counting

        def no_call(*args, **kwargs):
            raise AssertionError("a call was made")

        client.call_counting = no_call
        for options, message in out_of_place:
            with pytest.raises(ValueError, match=message):
                client.attend(q, k, v, **options)
            if "input_dtype" not in options:
                with pytest.raises(ValueError, match=message):
                    attnserve.attention_options(**options)
        with pytest.raises(ValueError, match="input_dtype is 'bool'"):
            client.mha(uniform(1, 3, 8), weights_name="demo", input_dtype="bool")
        # Names and ids that are not str, named (protobuf's TypeError named neither).
        for call, message in (
                (lambda: client.delete_weights(5), "name is 5, expected a str"),
                (lambda: client.put_weights(5, None, num_heads=1), "name is 5"),
                (lambda: client.create_session(num_layers=1, num_heads=1, key_dim=4,
                                               session_id=123), "session_id is 123"),
                (lambda: client.session(5), "session_id is 5, expected a str"),
                (lambda: client.get_session(b"id"), "session_id is b'id'")):
            with pytest.raises(ValueError, match=message):
                call()
        # The Client's own arguments, before any channel is opened.
        for options, message in ((dict(max_message_bytes=1 << 40),
                                  "max_message_bytes is 1099511627776, expected 1 to "
                                  "2147483647"),
                                 (dict(max_message_bytes="64"), "max_message_bytes is '64'"),
                                 (dict(retry=None), "retry is None, expected an attnserve"),
                                 (dict(token=b"t"), "token is of type bytes, expected a str"),
                                 # Refused without showing the token (gRPC's own ValueError
                                 # held it, at every call).
                                 (dict(token="s3cret\n"), "0x0a at offset 6"),
                                 (dict(token="s3cr\u00e9t"), "0xe9 at offset 4"),
                                 (dict(token="s3cret "), "starts or ends with a space"),
                                 (dict(token="x" * 4097), "4097 characters, expected at most")):
            with pytest.raises(ValueError, match=message) as refused:
                attnserve.Client("127.0.0.1:1", **options)
            assert "s3cr" not in str(refused.value)
        with pytest.raises(ValueError, match="shard_tokens is '4', expected an integer"):
            attnserve.ShardedSession(None, "4")
        with pytest.raises(ValueError, match="causal is 'yes'"):
            attnserve.sharded_attend([client], q, k, v, shards=2, causal="yes")
        with pytest.raises(ValueError, match=r"key_lengths\[0\] is 4.7"):
            attnserve.sharded_attend([client], q, k, v, shards=2, key_lengths=[4.7])
        with pytest.raises(ValueError, match="shards is 1.5, expected an integer"):
            attnserve.sharded_attend([client], q, k, v, shards=1.5)
        kv = dict(key=uniform(2, 1, 8), value=uniform(2, 1, 8))
        for layer in (2, -1):
            with pytest.raises(ValueError,
                               match=rf"layer is {layer}, expected 0 to 1 \(the session has 2"):
                session.step(layer, **kv)
        with pytest.raises(ValueError, match="layer is '0', expected an integer"):
            session.step("0", **kv)
        for options, message in ((dict(output_dtype="bool"), "output_dtype is 'bool'"),
                                 (dict(input_dtype="bool"), "input_dtype is 'bool'"),
                                 (dict(return_lse="yes"), "return_lse is 'yes'"),
                                 (dict(scale="1"), "scale is '1'")):
            with pytest.raises(ValueError, match=message):
                session.step(0, query=uniform(2, 1, 8), **kv, **options)
        for options, message in ((dict(dtype="bool"), "dtype is 'bool'"),
                                 (dict(num_layers=1.5), "num_layers is 1.5"),
                                 (dict(window_left="4"), "window_left is '4'"),
                                 (dict(evict_outside_window="yes"), "evict_outside_window is"),
                                 (dict(alibi_slopes=0.5), "alibi_slopes is 0.5")):
            with pytest.raises(ValueError, match=message):
                client.create_session(**dict(dict(num_layers=1, num_heads=2, key_dim=8),
                                             **options))
        for call, message in ((lambda: session.truncate(2.5), "length is 2.5"),
                              (lambda: session.fork(length=1.5), "length is 1.5"),
                              (lambda: session.fork(ttl_seconds=2.5), "ttl_seconds is 2.5"),
                              (lambda: client.mha(uniform(1, 3, 8), weights_name="demo",
                                                  weights_version=1.5),
                               "weights_version is 1.5"),
                              (lambda: client.mha(uniform(1, 3, 8), weights_name="demo",
                                                  query_positions=[0.5]),
                               r"query_positions\[0\] is 0.5"),
                              (lambda: client.put_weights("x", {}, num_heads=2,
                                                          num_kv_heads="1"),
                               "num_kv_heads is '1'")):
            with pytest.raises(ValueError, match=message):
                call()
        client.call_counting = real
        assert session.lengths == [0, 0]
        # NumPy scalars and integral floats are values in place, and mean what they say.
        good = dict(causal=np.bool_(True), scale=np.float32(0.25), key_lengths=[4.0],
                    window_left=np.int64(-1), num_sink_tokens=np.int32(0))
        np.testing.assert_allclose(
            client.attend(q, k, v, **good).output,
            reference_sdpa(q, k, v, causal=True, scale=0.25, key_lengths=[4]), atol=1e-5)
        assert session.step(np.int64(1), **kv).length == 1
        session.delete()


def variant_reference(q, k, v, *, position_offset, window_left=-1, sinks=0, alibi=None,
                      softcap=None):
    """float64 attention, causal, query i at position i + position_offset seeing keys
    position - window_left .. position and the first `sinks`; softcap, then ALiBi."""
    h, lq, _ = q.shape
    k = np.repeat(k, h // k.shape[0], axis=0).astype(np.float64)
    v = np.repeat(v, h // v.shape[0], axis=0).astype(np.float64)
    scores = np.einsum("hid,hjd->hij", q.astype(np.float64), k) / np.sqrt(q.shape[2])
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    position = np.arange(lq)[:, None] + position_offset
    j = np.arange(k.shape[1])[None, :]
    if alibi is not None:
        scores = scores - np.asarray(alibi, np.float64)[:, None, None] * np.abs(position - j)
    seen = j <= position
    if window_left >= 0:
        seen &= (j >= position - window_left) | (j < sinks)
    scores = np.where(seen[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hij,hjd->hid", weights / weights.sum(-1, keepdims=True), v)


def test_windows_sinks_alibi_and_softcap(server):
    H, Hkv, D = 4, 2, 8
    variant = dict(window_left=5, sinks=2, alibi=[0.5, 0.25, 0.125, 0.0625], softcap=3.0)
    q, k, v = uniform(1, H, 6, D), uniform(1, Hkv, 20, D), uniform(1, Hkv, 20, D)
    with attnserve.Client(server.target) as client:
        result = client.attend(q, k, v, causal=True, causal_alignment="bottom_right",
                               window_left=5, num_sink_tokens=2,
                               alibi_slopes=variant["alibi"], softcap=3.0)
        np.testing.assert_allclose(
            result.output[0], variant_reference(q[0], k[0], v[0], position_offset=14, **variant),
            atol=1e-5)
        with pytest.raises(attnserve.AttnserveError) as error:
            client.attend(q, k, v, softcap=-1.0)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "options.softcap is -1" in error.value.message
        # A session of the same variant that frees what its window left behind.
        session = client.create_session(num_layers=1, num_heads=H, num_kv_heads=Hkv, key_dim=D,
                                        window_left=5, num_sink_tokens=2,
                                        alibi_slopes=variant["alibi"], softcap=3.0,
                                        evict_outside_window=True)
        keys, values = np.zeros((Hkv, 0, D), np.float32), np.zeros((Hkv, 0, D), np.float32)
        for _ in range(30):
            kk, vv, qq = uniform(Hkv, 40, D), uniform(Hkv, 40, D), uniform(H, 1, D)
            out = session.step(0, key=kk, value=vv, query=qq).output
            keys, values = np.concatenate([keys, kk], 1), np.concatenate([values, vv], 1)
            np.testing.assert_allclose(
                out, variant_reference(qq, keys, values, position_offset=keys.shape[1] - 1,
                                       **variant), atol=1e-5)
        info = client.get_session(session.id)
        assert info.lengths == [1200] and info.defaults.evict_outside_window
        assert info.bytes <= 8 * 4096  # the sinks' page and the window's, not 1,200 tokens


def test_a_rope_session_rotates_at_the_token_positions(server):
    H, D, theta = 2, 4, 100.0

    def rotate(x, first):  # [H, T, D], GPT-NeoX pairs over the whole head
        t = np.arange(x.shape[1])[:, None] + first
        angle = t / theta ** (np.arange(D // 2) * 2 / D)
        cos, sin = np.cos(angle), np.sin(angle)
        a, b = x[..., :D // 2].astype(np.float64), x[..., D // 2:].astype(np.float64)
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    with attnserve.Client(server.target) as client:
        session = client.create_session(num_layers=1, num_heads=H, key_dim=D,
                                        rope_theta=theta)
        assert client.get_session(session.id).defaults.rope.theta == theta
        keys = np.zeros((H, 0, D))
        values = np.zeros((H, 0, D))
        for step in range(4):
            k, v, q = uniform(H, 3, D), uniform(H, 3, D), uniform(H, 1, D)
            out = session.step(0, key=k, value=v, query=q).output
            keys = np.concatenate([keys, rotate(k, 3 * step)], 1)
            values = np.concatenate([values, v], 1)
            scores = np.einsum("hd,hjd->hj", rotate(q, 3 * step + 2)[:, 0], keys) / np.sqrt(D)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            np.testing.assert_allclose(out[:, 0], np.einsum("hj,hjd->hd", weights, values),
                                       atol=1e-5)


def test_rope_weights_rotate_at_the_positions_given(server):
    B, L, E, H, D, theta = 2, 3, 8, 2, 4, 500.0

    def rotate(x, positions):  # [B, H, L, D] at positions [B, L], GPT-NeoX pairs
        angle = positions[:, None, :, None] / theta ** (np.arange(D // 2) * 2 / D)
        cos, sin = np.cos(angle), np.sin(angle)
        a, b = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    weights = {name: RNG.uniform(-0.5, 0.5, (E, E)).astype(np.float32)
               for name in ("w_q", "w_k", "w_v", "w_o")}
    x = uniform(B, L, E)
    positions = np.array([[7, 9, 30], [0, 100, 2]])
    heads = lambda y: y.reshape(B, L, H, D).transpose(0, 2, 1, 3)
    x64 = x.astype(np.float64)
    q = rotate(heads(x64 @ weights["w_q"].T), positions)
    k = rotate(heads(x64 @ weights["w_k"].T), positions)
    v = heads(x64 @ weights["w_v"].T)
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(D)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    attended = (p / p.sum(-1, keepdims=True)) @ v
    expected = attended.transpose(0, 2, 1, 3).reshape(B, L, E) @ weights["w_o"].T
    rope = dict(rope_theta=theta)
    name = f"pytest-rope-{os.getpid()}"
    with attnserve.Client(server.target) as client:
        inline = client.mha(x, weights=weights, num_heads=H, query_positions=positions,
                            key_positions=positions, **rope)
        np.testing.assert_allclose(inline.output, expected, atol=1e-5)
        client.put_weights(name, weights, num_heads=H, **rope)
        registered = client.mha(x, weights_name=name, query_positions=positions.ravel(),
                                key_positions=positions.tolist())
        np.testing.assert_allclose(registered.output, expected, atol=1e-5)
        with pytest.raises(ValueError, match="are for inline weights"):
            client.mha(x, weights_name=name, **rope)
        with pytest.raises(ValueError, match="are for inline weights"):
            client.mha(x, weights_name=name, rotary_dim=2)
        with pytest.raises(ValueError, match="rotary_dim and rope_interleaved need rope_theta"):
            client.put_weights(name, weights, num_heads=H, rope_interleaved=True)
        client.delete_weights(name)


def test_a_call_pinned_to_a_version_is_retried_on_another_replica(tmp_path):
    shapes = dict(w_q=(8, 8), w_k=(8, 8), w_v=(8, 8), w_o=(8, 8))
    servers = []
    try:
        for version in (7, 8):  # one replica a reload behind the other
            folder = tmp_path / f"v{version}" / "layer"
            folder.mkdir(parents=True)
            (folder / "config.txt").write_text(f"num_heads=2\nversion={version}\n")
            for name, shape in shapes.items():
                np.save(folder / f"{name}.npy", uniform(*shape))
            servers.append(Server(f"--weights_dir={folder.parent}", "--demo_weights=false"))
        target = "ipv4:" + ",".join(s.target for s in servers)
        x = uniform(1, 3, 8)
        for retried in (True, False):
            policy = attnserve.RetryPolicy(max_attempts=4, retry_weights_version=retried)
            with attnserve.Client(target, retry=policy) as client:
                refused = 0
                for _ in range(8):
                    try:
                        assert client.mha(x, weights_name="layer",
                                          weights_version=8).weights_version == 8
                    except attnserve.AttnserveError as error:
                        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
                        refused += 1
                assert (refused == 0) if retried else (refused > 0)
    finally:
        for s in servers:
            s.stop()


def test_a_cancellation_from_the_server_is_retried():
    from concurrent import futures
    from attnserve.v1 import attention_pb2_grpc

    class CancelsFirst(attention_pb2_grpc.AttentionServiceServicer):
        calls = 0

        def Attend(self, request, context):
            CancelsFirst.calls += 1
            if CancelsFirst.calls == 1:
                context.abort(grpc.StatusCode.CANCELLED, "cancelled by the server")
            return attention_pb2.AttendResponse()

    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    attention_pb2_grpc.add_AttentionServiceServicer_to_server(CancelsFirst(), fake)
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    try:
        for retried in (True, False):
            CancelsFirst.calls = 0
            policy = attnserve.RetryPolicy(initial_backoff=0.001,
                                           retry_cancelled_by_server=retried)
            with attnserve.Client(f"127.0.0.1:{port}", retry=policy) as client:
                if retried:
                    assert client.call_counting("Attend",
                                                attention_pb2.AttendRequest())[1] == 2
                else:
                    with pytest.raises(attnserve.AttnserveError) as refused:
                        client.call("Attend", attention_pb2.AttendRequest())
                    assert refused.value.code == grpc.StatusCode.CANCELLED
                    assert CancelsFirst.calls == 1
    finally:
        fake.stop(None)


def test_a_refusal_the_server_marks_permanent_is_not_retried():
    """A RESOURCE_EXHAUSTED with grpc-retry-pushback-ms: -1 (a limit on the request's own
    size) is sent once; one without it (want of room now) is retried. Then a real server's
    max_elements refusal, which carries the trailer."""
    from concurrent import futures
    from attnserve.v1 import attention_pb2_grpc

    class Refuses(attention_pb2_grpc.AttentionServiceServicer):
        calls = 0
        pushback = None

        def Attend(self, request, context):
            Refuses.calls += 1
            if Refuses.pushback is not None:
                context.set_trailing_metadata((("grpc-retry-pushback-ms", Refuses.pushback),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")

    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    attention_pb2_grpc.add_AttentionServiceServicer_to_server(Refuses(), fake)
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    policy = attnserve.RetryPolicy(max_attempts=4, initial_backoff=0.001,
                                   retry_on=(grpc.StatusCode.RESOURCE_EXHAUSTED,))
    try:
        with attnserve.Client(f"127.0.0.1:{port}", retry=policy) as client:
            for pushback, attempts in ((None, 4), ("-1", 1)):
                Refuses.calls, Refuses.pushback = 0, pushback
                with pytest.raises(attnserve.AttnserveError) as refused:
                    client.call("Attend", attention_pb2.AttendRequest())
                assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert (refused.value.attempts, Refuses.calls) == (attempts, attempts)
    finally:
        fake.stop(None)
    limited = Server("--max_elements=1000")
    try:
        with attnserve.Client(limited.target, retry=policy) as client:
            q = uniform(1, 1, 4, 512)
            with pytest.raises(attnserve.AttnserveError) as refused:
                client.attend(q, q, q)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "over the max_elements limit of 1000" in refused.value.message
        assert refused.value.attempts == 1
        # gRPC's own refusal of a message over a size limit is not retried either (it was
        # until 2026-12-07, with RESOURCE_EXHAUSTED in retry_on).
        with attnserve.Client(limited.target, retry=policy, max_message_bytes=4096) as client:
            q = uniform(1, 1, 16, 64)
            with pytest.raises(attnserve.AttnserveError) as too_large:
                client.attend(q, q, q)
        assert too_large.value.message.startswith("Sent message larger than max")
        assert too_large.value.attempts == 1
    finally:
        limited.stop()


def test_a_retry_policy_is_checked_when_made():
    """Values no retry can use are a ValueError naming them at once (a negative or NaN
    backoff, or a lone StatusCode as retry_on, raised a raw error at the first retry only,
    until 2026-12-07)."""
    for options, message in ((dict(max_attempts=0), "max_attempts is 0, expected 1 to 100"),
                             (dict(max_attempts=2.5), "max_attempts is 2.5"),
                             (dict(initial_backoff=-0.1), "expected 0 < initial_backoff"),
                             (dict(initial_backoff=float("nan")), "initial_backoff is nan"),
                             (dict(max_backoff=0.01), "expected 0 < initial_backoff <= "),
                             (dict(backoff_multiplier=0.5), "backoff_multiplier is 0.5"),
                             (dict(retry_on=grpc.StatusCode.UNAVAILABLE), "retry_on is"),
                             (dict(retry_on=("UNAVAILABLE",)), "expected a tuple of grpc"),
                             (dict(retry_on=5), "retry_on is 5"),
                             (dict(max_backoff=10 ** 400), "max_backoff is"),
                             (dict(retry_session_creation="yes"), "retry_session_creation")):
        with pytest.raises(ValueError, match=message):
            attnserve.RetryPolicy(**options)
    assert attnserve.RetryPolicy(retry_on=[grpc.StatusCode.UNAVAILABLE]).retry_on == (
        grpc.StatusCode.UNAVAILABLE,)
    # A generator is read once, and kept as the tuple it gave.
    assert attnserve.RetryPolicy(
        retry_on=(code for code in [grpc.StatusCode.UNAVAILABLE])).retry_on == (
        grpc.StatusCode.UNAVAILABLE,)


def test_a_broken_server_gets_attnserve_errors_not_crashes():
    """Answers no attnserve gives: every one is an AttnserveError INTERNAL or UNKNOWN, never
    a MemoryError, IndexError, StopIteration or NumPy's ValueError."""
    from concurrent import futures
    from attnserve.v1 import attention_pb2_grpc

    def info(session_id, layers=1):
        return attention_pb2.SessionInfo(session_id=session_id, num_layers=layers,
                                         num_heads=1, num_kv_heads=1, key_dim=8,
                                         value_dim=8)

    class Broken(attention_pb2_grpc.AttentionServiceServicer):
        steps = 0
        attends = 0

        def CreateSession(self, request, context):
            if request.session_id == "a" * 32:
                return attention_pb2.CreateSessionResponse(session=info("a" * 32, 1 << 40))
            if request.session_id == "c" * 32:
                return attention_pb2.CreateSessionResponse(session=info("e" * 32))
            return attention_pb2.CreateSessionResponse(session=info("f" * 32))

        def TruncateSession(self, request, context):
            return attention_pb2.TruncateSessionResponse(session=info("e" * 32))

        def Step(self, request, context):
            Broken.steps += 1
            if Broken.steps == 1:  # A code that is no gRPC status.
                return attention_pb2.StepResponse(results=[attention_pb2.StepResult(
                    error=attention_pb2.ErrorStatus(code=99, message="weird"))])
            return attention_pb2.StepResponse()  # No result for the step.

        def Attend(self, request, context):
            Broken.attends += 1
            tensors = [attention_pb2.Tensor(dtype=attention_pb2.BOOL, shape=[4],
                                            data=bytes(4)),
                       attention_pb2.Tensor(dtype=attention_pb2.FLOAT32, shape=[-1, -4],
                                            data=bytes(16)),
                       attention_pb2.Tensor(dtype=attention_pb2.FLOAT32, shape=[4, 1 << 62],
                                            data=bytes(16)),
                       attention_pb2.Tensor(dtype=99, shape=[4], data=bytes(16))]
            return attention_pb2.AttendResponse(output=tensors[(Broken.attends - 1) % 4])

    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    attention_pb2_grpc.add_AttentionServiceServicer_to_server(Broken(), fake)
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    try:
        with attnserve.Client(f"127.0.0.1:{port}") as client:
            shape = dict(num_layers=1, num_heads=1, key_dim=8)
            for session_id, says in (("a" * 32, "expected each 1 to 65536"),
                                     ("c" * 32, "with session eeee")):
                with pytest.raises(attnserve.AttnserveError) as refused:
                    client.create_session(session_id=session_id, **shape)
                assert refused.value.code == grpc.StatusCode.INTERNAL
                assert says in refused.value.message
            session = client.create_session(**shape)
            with pytest.raises(attnserve.AttnserveError) as refused:
                session.truncate(0)
            assert "answered a call on session ffff" in refused.value.message
            assert session.id == "f" * 32
            query = uniform(1, 1, 8)
            with pytest.raises(attnserve.AttnserveError) as refused:
                session.step(0, query=query)
            assert refused.value.code == grpc.StatusCode.UNKNOWN
            with pytest.raises(attnserve.AttnserveError) as refused:
                session.step(0, query=query)
            assert "0 results for 1 step" in refused.value.message
            q = uniform(1, 1, 1, 8)
            for says in ("BOOL output", "negative", "holds 16 bytes", "dtype 99"):
                with pytest.raises(attnserve.AttnserveError) as refused:
                    client.attend(q, q, q)
                assert refused.value.code == grpc.StatusCode.INTERNAL
                assert says in refused.value.message
    finally:
        fake.stop(None)


def test_arrays_in_any_byte_order_and_bfloat16_bits_under_any_input_dtype(server):
    q, k, v = uniform(1, 2, 3, 8), uniform(1, 2, 5, 8), uniform(1, 2, 5, 8)
    with attnserve.Client(server.target) as client:
        native = client.attend(q, k, v, attn_mask=np.zeros((3, 5), np.float32)).output
        swapped = client.attend(q.astype(">f4"), k.astype(">f4"), v.astype(">f4"),
                                attn_mask=np.zeros((3, 5), ">f4")).output
        np.testing.assert_array_equal(swapped, native)
        bits = [attnserve.float32_to_bfloat16_bits(x) for x in (q, k, v)]
        values = [attnserve.bfloat16_bits_to_float32(b) for b in bits]
        for input_dtype in ("float32", "float16", "bfloat16", None):
            np.testing.assert_allclose(client.attend(*bits, input_dtype=input_dtype).output,
                                       reference_sdpa(*values), atol=2e-3)
        with pytest.raises(ValueError, match="key is a NumPy int32 array, expected float32"):
            client.attend(q, k.astype(np.int32), v)
        # Still a TypeError, as before the argument was named.
        with pytest.raises(TypeError):
            client.attend(q, k.astype(np.int32), v)
        # With input_dtype, integers convert as their values.
        small = [np.round(4 * x).astype(np.int32) for x in (q, k, v)]
        np.testing.assert_allclose(client.attend(*small, input_dtype="float32").output,
                                   reference_sdpa(*[x.astype(np.float32) for x in small]),
                                   atol=1e-5)


def test_a_closed_client_fails_attnserve_errors_and_timeouts_are_numbers(server):
    q = uniform(1, 1, 2, 4)
    client = attnserve.Client(server.target)
    client.attend(q, q, q)
    client.close()
    with pytest.raises(attnserve.AttnserveError, match="the client is closed") as closed:
        client.attend(q, q, q)
    assert closed.value.code == grpc.StatusCode.CANCELLED
    with pytest.raises(ValueError, match="timeout is None, expected a finite number of"):
        attnserve.Client(server.target, timeout=None)
    with attnserve.Client(server.target) as client:
        for bad in ("1", float("nan"), float("inf")):
            with pytest.raises(ValueError, match="expected a finite number of seconds"):
                client.attend(q, q, q, timeout=bad)
        # A finite timeout past gRPC's clock (about 4e9 s) waits as a long one, not failing at
        # once (and a session's lock took it as an OverflowError).
        client.attend(q, q, q, timeout=1e12)
        session = client.create_session(num_layers=1, num_heads=1, key_dim=4)
        session.step(0, key=q[0], value=q[0], query=q[0], timeout=1e12)
        session.delete()
    # TLS options without TLS would open a plaintext channel, the token in clear.
    for options in ({"private_key": b"key"}, {"server_name_override": "name"}):
        with pytest.raises(ValueError, match="without tls, root_certificates or "
                           "certificate_chain"):
            attnserve.Client(server.target, token="t", **options)
    # Half a client key pair: gRPC's assertion ended the whole process (SIGABRT).
    for options, missing in (({"certificate_chain": b"chain"}, "private_key"),
                             ({"tls": True, "private_key": b"key"}, "certificate_chain"),
                             ({"root_certificates": b"ca", "private_key": b"key"},
                              "certificate_chain")):
        with pytest.raises(ValueError, match=f"is set without {missing}: expected both"):
            attnserve.Client(server.target, **options)
    # bool takes nonzero as True (0.5 and 256 were sent as False).
    assert attnserve.from_tensor(attnserve.to_tensor(
        np.array([0.5, 2.0, -1.0, 256.0, 0.0]), "bool")).tolist() == [True] * 4 + [False]
    half = attnserve.float32_to_bfloat16_bits(np.array([0.5, 0.0], np.float32))
    assert attnserve.from_tensor(attnserve.to_tensor(half, "bool")).tolist() == [True, False]


def test_packed_sequences_attend_within_themselves(server):
    H, D = 2, 4
    lengths = [(3, 5), (1, 1), (4, 6)]
    q = uniform(sum(lq for lq, _ in lengths), H, D)
    k = uniform(sum(lk for _, lk in lengths), H, D)
    v = uniform(sum(lk for _, lk in lengths), H, D)
    cu_q = np.cumsum([0] + [lq for lq, _ in lengths])
    cu_k = np.cumsum([0] + [lk for _, lk in lengths])
    with attnserve.Client(server.target) as client:
        result = client.attend(q, k, v, causal=True, causal_alignment="bottom_right",
                               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    assert result.output.shape == (q.shape[0], H, D) and result.lse.shape == (H, q.shape[0])
    for s in range(len(lengths)):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(1, 0, 2)[None]
        ks = k[cu_k[s]:cu_k[s + 1]].transpose(1, 0, 2)[None]
        vs = v[cu_k[s]:cu_k[s + 1]].transpose(1, 0, 2)[None]
        expected = reference_sdpa(qs, ks, vs, causal=True, causal_alignment="bottom_right")
        np.testing.assert_allclose(result.output[cu_q[s]:cu_q[s + 1]],
                                   expected[0].transpose(1, 0, 2), atol=1e-5)


def test_streams_closed_early_keep_their_connection_past_the_reset_cap():
    # The server shuts down a connection whose client cancels more calls in a second than
    # --max_client_resets_per_second (rapid-reset floods) plus the answers it was sent in that
    # second (at most four times the cap): streams a consumer stops reading after some
    # answers are no flood.
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    running = Server("--max_client_resets_per_second=10", f"--metrics_port={metrics_port}",
                     "--metrics_address=127.0.0.1")
    try:
        q = uniform(1, 1, 2, 8)
        with attnserve.Client(running.target, retry=attnserve.RetryPolicy(max_attempts=1)) \
                as client:
            request = client.attend_request(q, q, q)
            expected = reference_sdpa(q, q, q)
            for _ in range(30):
                more = threading.Event()

                def requests():
                    for _ in range(3):
                        yield request
                    more.wait(30)  # the stream stays open: the consumer's close cancels it

                answers = client.attend_stream(requests(), timeout=30)
                for _ in range(2):
                    _, result = next(answers)
                    np.testing.assert_allclose(result.output, expected, atol=1e-5)
                answers.close()
                more.set()
            client.attend(q, q, q, timeout=30)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as page:
            metrics = page.read().decode()
        closed = re.search(r"^attnserve_reset_connections_closed_total (\S+)$", metrics, re.M)
        assert float(closed[1]) == 0, "the client's connection was shut down as a flood"
    finally:
        running.stop()
