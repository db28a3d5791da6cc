"""Sessions over replicas: one channel per address a target resolves to, sessions placed by
rendezvous hashing and pinned to their replica, rebuilt when it is gone, and one session
sharded over several (the C++ library's attnserve::Replicas and ShardedSession).

    replicas = attnserve.Replicas("dns:///attnserve-headless.prod.svc:50051")
    session = replicas.create_session(num_layers=32, num_heads=32, num_kv_heads=8, key_dim=128)
    session.rebuild_hook = lambda fresh, lengths, timeout: prefill(fresh, lengths, timeout)
    session.step(0, key=k, value=v, query=q)          # goes to the session's replica only

A session's replica that is gone (unreachable through the retries, or restarted: another
incarnation answers at its address) makes a step raise ReplicaGoneError (code ABORTED), or,
with a rebuild hook, recreates the session on the next replica and sends the step again.
"""
import concurrent.futures
import os
import socket
import threading

import grpc
import numpy as np

from attnserve.client import AttnserveError, Client, _data_dtype, _integer, _seconds
from attnserve.session import (_REBUILD_ADVICE, ReplicaGoneError, _deadline, _holding,
                               _layer, _left, _step_options)
from attnserve.tensors import (_DEFAULT_WIRE, bfloat16_bits_to_float32, check_array,
                               float32_to_bfloat16_bits)

_MASK = (1 << 64) - 1
# The codes on which creating a session moves on from a replica: unreachable or draining,
# shutting down, or no answer within its share of the time.
_PASSED_OVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED)


def rendezvous_weight(address, key):
    """FNV-1a (64 bits) of address + "/" + key, then SplitMix64's finaliser: the same number
    as the C++ library's RendezvousWeight, so that every client ranks replicas alike."""
    h = 0xCBF29CE484222325
    for byte in f"{address}/{key}".encode():
        h = ((h ^ byte) * 0x100000001B3) & _MASK
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _MASK
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


def random_session_id():
    """32 lowercase hex digits from the operating system's random source."""
    return os.urandom(16).hex()


def _split_host_port(address):
    if address.startswith("["):
        host, _, port = address[1:].partition("]:")
    else:
        host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r}: expected host:port or [host]:port")
    return host, port


def resolve(target):
    """The sorted addresses ("a.b.c.d:port", "[v6]:port") a target names: ipv4:/ipv6: lists,
    unix: paths, or dns:///host:port and host:port, resolved here."""
    if target.startswith(("ipv4:", "ipv6:")):
        addresses = target[5:].split(",")
        for address in addresses:
            _split_host_port(address)
    elif target.startswith("unix:"):
        addresses = [target]
    else:
        name = target[len("dns:///"):] if target.startswith("dns:///") else (
            target[len("dns:"):] if target.startswith("dns:") else target)
        host, port = _split_host_port(name)
        addresses = []
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:  # Its own message names neither host nor target.
            raise socket.gaierror(error.errno, f"target {target!r}: {host} does not "
                                  f"resolve: {error.strerror}") from error
        for family, _, _, _, sockaddr in found:
            ip = sockaddr[0]
            addresses.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    addresses = sorted(set(addresses))
    if not addresses:
        raise ValueError(f"target {target!r} resolved to no address")
    return addresses


def _resolve_within(target, timeout):
    """resolve(target) within `timeout` seconds, on a thread of its own that a lookup past
    them leaves to finish alone; TimeoutError past them."""
    result = {}

    def lookup():
        try:
            result["addresses"] = resolve(target)
        except Exception as error:  # noqa: BLE001 -- raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=lookup, name="attnserve-resolve", daemon=True)
    thread.start()
    thread.join(max(timeout, 0.0))
    if thread.is_alive():
        raise TimeoutError(f"resolving {target!r} took past the call's deadline")
    if "error" in result:
        raise result["error"]
    return result["addresses"]


def _channel_target(address):
    if address.startswith("unix:"):
        return address
    return ("ipv6:" if address.startswith("[") else "ipv4:") + address


class Replicas:
    """One attnserve.Client per address of `target`; client_options go to each Client.
    Thread-safe, as the C++ Replicas is: one may be shared by every thread of a process."""

    def __init__(self, target, **client_options):
        self.target = target
        self._options = client_options
        self._lock = threading.Lock()  # guards _clients, addresses and _closed
        self._clients = {}
        self._closed = False
        self.addresses = []
        self.refresh()

    def refresh(self, timeout=None):
        """Resolves the target again: new addresses get Clients; addresses that left get no
        new sessions (their Clients stay, for the sessions pinned to them). After close(),
        nothing. With `timeout` (seconds), a resolution not answered by then raises
        TimeoutError and changes nothing: getaddrinfo has no deadline of its own, and a
        resolver that does not answer holds it for 10 s or more."""
        if timeout is None:
            addresses = resolve(self.target)  # outside the lock: DNS may take a while
        else:
            addresses = _resolve_within(self.target, timeout)
        with self._lock:
            if self._closed:
                return
            for address in addresses:
                if address not in self._clients:
                    self._clients[address] = Client(_channel_target(address), **self._options)
            self.addresses = addresses

    def client(self, address):
        with self._lock:
            return self._clients.get(address)

    def rank(self, key):
        """The addresses by descending rendezvous weight for `key`."""
        return sorted(self.addresses, key=lambda a: rendezvous_weight(a, key), reverse=True)

    def close(self):
        """Closes every Client, once; sessions pinned to them fail CANCELLED after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients = list(self._clients.values())
        for client in clients:
            client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.close()

    def create_session(self, *, avoid=(), timeout=None, session_id=None, **session_options):
        """A session (Client.create_session's options) on the first replica in rendezvous
        order for its id that takes it, skipping `avoid` and those answering UNAVAILABLE
        (draining or unreachable; the target is resolved again before giving up), CANCELLED
        (shutting down), RESOURCE_EXHAUSTED (full, but not a refusal of the request itself,
        which every replica would make) or nothing within their share of `timeout` (an equal
        part of what is left for each replica left to ask, at least 2 s: a hung one does not
        take it all). Pinned. RESOURCE_EXHAUSTED if every replica asked was full, else
        UNAVAILABLE, naming each refusal."""
        if self._closed:
            raise AttnserveError(grpc.StatusCode.CANCELLED,
                                 f"CreateSession: the Replicas of {self.target} is closed")
        session_id = session_id or random_session_id()
        # Shared between the replicas: without one, the clients' default.
        deadline = _deadline(_seconds(timeout, "timeout") if timeout is not None
                             else self._options.get("timeout", 30.0))
        asked, refusals, all_full = set(avoid), [], True
        for round_ in range(2):
            if round_:
                try:
                    self.refresh(timeout=_left(deadline))
                except OSError:  # No answer in time, or none: the replicas known stand.
                    break
            ranked = [address for address in self.rank(session_id) if address not in asked]
            for left, address in zip(range(len(ranked), 0, -1), ranked):
                asked.add(address)
                try:
                    # Each replica left gets an equal share of the time left (the last all
                    # of it), at least 2 s (or what is left) however many there are: one
                    # that hangs does not take the whole deadline from the next.
                    share = max(_left(deadline) / left, min(_left(deadline), 2.0))
                    session = self.client(address).create_session(
                        session_id=session_id, timeout=share, **session_options)
                except AttnserveError as error:
                    # A replica shutting down cancels the calls it holds: its sessions go
                    # with it, so the next replica is asked, as for one unreachable, or one
                    # that did not answer within its share, or one full (its session caps or
                    # KV cache; until 2026-12-07 the first full replica ended the create),
                    # but not for a refusal of the request itself, which every replica would
                    # make.
                    share_passed = (error.code == grpc.StatusCode.DEADLINE_EXCEEDED
                                    and _left(deadline) > 0)
                    full = (error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                            and not error.permanent)
                    if error.code not in (grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.CANCELLED) \
                            and not share_passed and not full:
                        raise
                    all_full = all_full and full
                    refusals.append(f"{address}: {error.message}")
                    continue
                session._pin(self, address, session_options)
                return session
        # Every replica full: the caller's backpressure, as one replica's was.
        raise AttnserveError(grpc.StatusCode.RESOURCE_EXHAUSTED if refusals and all_full
                             else grpc.StatusCode.UNAVAILABLE,
                             f"no replica of {self.target} took session {session_id}: "
                             + ("; ".join(refusals) or "no replica to ask besides those avoided"))


def _of_shard(error, shard, told=""):
    """`error` named by its shard, without a Session's advice to rebuild it (a sharded
    session is not rebuilt), `told` after it; a ReplicaGoneError stays one."""
    message = f"shard {shard}: {error.message.removesuffix(_REBUILD_ADVICE)}{told}"
    named = (ReplicaGoneError(message, error.address) if isinstance(error, ReplicaGoneError)
             else AttnserveError(error.code, message))
    named.attempts = error.attempts
    return named


class ShardedSession:
    """One session over several replicas: shard s, an ordinary pinned Session, holds tokens
    [s·C, (s+1)·C) of every layer (C = shard_tokens), on a replica of its own while there is
    one. A step with a query attends on every shard holding the layer's tokens at once (the
    last appends and attends, the others attend alone) and merges outputs and lse exactly
    (float64). A query of more than one row is refused once the layer spans several shards.
    A window, sinks, ALiBi slopes or RoPE are refused (ValueError): each shard's positions
    start at 0, so what depends on a key's position in the whole sequence would be wrong.
    One may be shared by threads: its calls run one at a time."""

    def __init__(self, replicas, shard_tokens, *, timeout=None, **session_options):
        shard_tokens = _integer(shard_tokens, "shard_tokens")
        max_tokens = session_options.get("max_tokens")
        if max_tokens is not None and _integer(max_tokens, "max_tokens") <= 0:
            max_tokens = None  # the servers' limit, as for a Session
        if shard_tokens < 1 or (max_tokens is not None and shard_tokens > max_tokens):
            limit = ("the servers' limit" if max_tokens is None
                     else f"{max_tokens} (max_tokens)")
            raise ValueError(f"shard_tokens is {shard_tokens}, expected 1 to {limit}")
        if session_options.get("session_id") is not None:
            # One id for every shard would collide on a replica holding two of them.
            raise ValueError("session_id cannot be given for a sharded session: each shard "
                             "draws its own")
        unset = {"window_left": -1, "num_sink_tokens": 0}  # and None for all four
        positional = [name for name in ("window_left", "num_sink_tokens", "alibi_slopes",
                                        "rope_theta")
                      if session_options.get(name) is not None
                      and not (name in unset and session_options[name] == unset[name])]
        if positional:
            raise ValueError(f"{', '.join(positional)} cannot be sharded: they depend on each "
                             "key's position in the whole sequence, and a shard's positions "
                             "start at 0")
        self._replicas = replicas
        self._options = dict(session_options, max_tokens=shard_tokens)
        self.shard_tokens = shard_tokens
        self.shards = [replicas.create_session(timeout=timeout, **self._options)]
        self.lengths = [0] * len(self.shards[0].lengths)
        # The shards lost with their replicas, and their tokens with them.
        self._lost = set()
        # Held through each step and delete: threads sharing one run them one at a time.
        self._lock = threading.RLock()

    def _alone(self, timeout):
        return _holding(self._lock, timeout, self._default_timeout(), "the sharded session")

    def _default_timeout(self):
        return self.shards[0]._client._timeout

    def _ensure(self, index, deadline):
        while len(self.shards) <= index:
            holding = {shard.address for shard in self.shards}
            spares = {a for a in self._replicas.addresses if a not in holding}
            try:
                if not spares:
                    shard = self._replicas.create_session(timeout=_left(deadline),
                                                          **self._options)
                else:
                    try:
                        # Half of what is left (at least 2 s, or what is left) for the
                        # spares: a hung one does not take the holders' turn too.
                        left = _left(deadline)  # None: the clients' default
                        share = None if left is None else max(left / 2, min(left, 2.0))
                        shard = self._replicas.create_session(avoid=holding, timeout=share,
                                                              **self._options)
                    except AttnserveError as error:
                        # The spares may all be down, draining or hung (a rolling update):
                        # then a replica holding a shard.
                        if error.code not in _PASSED_OVER or _left(deadline) == 0:
                            raise
                        shard = self._replicas.create_session(
                            avoid=spares, timeout=_left(deadline), **self._options)
            except AttnserveError as error:
                failed = AttnserveError(error.code,
                                        f"creating shard {len(self.shards)}: {error.message}")
                failed.attempts = error.attempts
                raise failed from None
            self.shards.append(shard)

    def step(self, layer, key=None, value=None, query=None, *, timeout=None, return_lse=False,
             **options):
        """As Session.step, over all the shards; returns (output, lse or None, length).
        `timeout` bounds the whole step. After a failure, lengths is what the shards hold,
        and the error says what of the step stands: its first N tokens (send the rest, not
        the whole step again), or its whole append with the query unanswered (send the query
        again alone). A shard whose replica is gone took its tokens with it: the sharded
        session is not rebuilt, and a step on a layer whose shards no longer hold what
        lengths says is refused FAILED_PRECONDITION."""
        with self._alone(timeout) as timeout:
            deadline = _deadline(self._default_timeout() if timeout is None else timeout)

            def left():
                return _left(deadline)

            if (key is None) != (value is None):
                raise ValueError("give key and value together, or neither")
            layer = _layer(layer, len(self.lengths))
            checked = dict(options)  # before any shard is sent a step
            _data_dtype(checked.pop("input_dtype", None), "input_dtype")
            _step_options(return_lse=return_lse, **checked)
            self._check_inputs(key, value, query, options.get("input_dtype"))
            # Arrays from here: the pieces are slices (a nested list raised TypeError half
            # way until 2026-12-07).
            if key is not None:
                key, value = np.asarray(key), np.asarray(value)
            start = self.lengths[layer]
            tokens = 0 if key is None else np.asarray(key).shape[1]
            end = start + tokens
            self._check_shards(layer, end)
            used = 0 if end == 0 else (end - 1) // self.shard_tokens + 1
            if query is not None and used > 1 and np.asarray(query).shape[1] != 1:
                raise ValueError(f"query holds {np.asarray(query).shape[1]} rows; a step over a "
                                 f"layer that spans {used} shards takes one")
            if used:
                self._ensure(used - 1, deadline)
            last_key = last_value = None
            at = start
            while at < end:
                shard = at // self.shard_tokens
                to = min(end, (shard + 1) * self.shard_tokens)
                k, v = key[:, at - start:to - start], value[:, at - start:to - start]
                if to == end:
                    last_key, last_value = k, v
                    break
                try:
                    self.shards[shard].step(layer, key=k, value=v, timeout=left(),
                                            input_dtype=options.get("input_dtype"))
                except AttnserveError as error:
                    raise self._failed(error, shard, layer, start, end, query is not None) \
                        from None
                self.lengths[layer] = at = to
            if query is None:
                if last_key is not None:
                    try:
                        self.shards[used - 1].step(layer, key=last_key, value=last_value,
                                                   timeout=left(),
                                                   input_dtype=options.get("input_dtype"))
                    except AttnserveError as error:
                        raise self._failed(error, used - 1, layer, start, end, False) from None
                    self.lengths[layer] = end
                return None, None, self.lengths[layer]
            if not used:
                try:
                    result = self.shards[0].step(layer, query=query, timeout=left(),
                                                 return_lse=return_lse, **options)
                except AttnserveError as error:
                    raise self._failed(error, 0, layer, start, end, True) from None
                return result.output, result.lse, result.length
            # The shards answer float32 for the merge, which then answers as one session
            # would: in output_dtype, else as the query travelled (until 2026-12-07 always
            # float32, but for a layer without keys).
            answered = _data_dtype(options.get("output_dtype"), "output_dtype") or \
                _data_dtype(options.get("input_dtype"), "input_dtype") or \
                _DEFAULT_WIRE.get(np.asarray(query).dtype, "FLOAT32").lower()
            options = dict(options, output_dtype="float32")
            step_left = left()
            with concurrent.futures.ThreadPoolExecutor(max_workers=used) as pool:
                futures = [pool.submit(self.shards[s].step, layer, query=query,
                                       timeout=step_left, return_lse=True, **options)
                           for s in range(used - 1)]
                futures.append(pool.submit(self.shards[used - 1].step, layer, key=last_key,
                                           value=last_value, query=query, timeout=step_left,
                                           return_lse=True, **options))
            # What stands, whatever failed: the earlier shards are full, and the last one's
            # Session knows whether its append landed. A step retried after a failure then
            # never appends twice.
            for s, future in enumerate(futures):
                failed = future.exception()
                if failed is None:
                    continue
                if isinstance(failed, AttnserveError):
                    raise self._failed(failed, s, layer, start, end, True) from None
                self.lengths[layer] = sum(shard.lengths[layer] for shard in self.shards)
                raise failed
            self.lengths[layer] = end
            parts = [future.result() for future in futures]
            outputs = np.stack([np.asarray(p.output, dtype=np.float64) for p in parts])
            lses = np.stack([np.asarray(p.lse, dtype=np.float64) for p in parts])
            with np.errstate(invalid="ignore", over="ignore"):
                lse = np.logaddexp.reduce(lses, axis=0)
                shares = np.where(np.isneginf(lses), 0.0, np.exp(lses - lse[None]))
            output = np.einsum("s...,s...d->...d", shares, outputs)
            output = np.where(np.isneginf(lse)[..., None], 0.0, output).astype(np.float32)
            if answered == "float16":
                output = output.astype(np.float16)
            elif answered == "bfloat16":  # bfloat16 values, widened as a session answers them
                output = bfloat16_bits_to_float32(float32_to_bfloat16_bits(output))
            return output, lse.astype(np.float32) if return_lse else None, end

    def _check_shards(self, layer, end):
        """FAILED_PRECONDITION unless every shard holds what lengths says of `layer` (the
        shards before the last full, the rest empty) and none that the layer's tokens up to
        `end` lie in was lost with its replica."""
        length = self.lengths[layer]
        for s in sorted(self._lost):
            if max(length, end) > s * self.shard_tokens:
                shard = self.shards[s]
                raise AttnserveError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"shard {s} (session {shard.id} at {shard.address}) was lost with its "
                    f"replica, and with it layer {layer}'s tokens from "
                    f"{s * self.shard_tokens}: a sharded session cannot get them back; "
                    f"delete() it and create a new one")
        for s, shard in enumerate(self.shards):
            want = min(max(length - s * self.shard_tokens, 0), self.shard_tokens)
            if shard.lengths[layer] != want:
                raise AttnserveError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"shard {s} (session {shard.id} at {shard.address}) holds "
                    f"{shard.lengths[layer]} tokens of layer {layer}, expected {want} of its "
                    f"{length}: its session was lost (or rebuilt empty), and a sharded session "
                    f"cannot get the tokens back; delete() it and create a new one")

    def _failed(self, error, shard, layer, start, end, has_query):
        """`error`, from shard `shard` during a step of `layer` from `start` to `end` tokens,
        after which lengths is what the shards hold; its message says what of the step
        stands."""
        stands = sum(s.lengths[layer] for s in self.shards)
        self.lengths[layer] = stands
        if isinstance(error, ReplicaGoneError):
            self._lost.add(shard)
            told = ("; the tokens the shard held went with its replica, and a sharded session "
                    "is not rebuilt: delete() it and create a new one")
        elif end > start and stands == end and has_query:
            told = f"; the step's append stands (lengths is {end}): send the query again alone"
        elif start < stands < end:
            told = (f"; the step's first {stands - start} tokens stand (lengths is {stands}): "
                    f"send the rest, not the whole step again")
        else:
            told = ""
        return _of_shard(error, shard, told)

    def _check_inputs(self, key, value, query, input_dtype):
        """Refuses (ValueError) what a shard would refuse, before any shard is sent a piece: a
        step refused half way would leave its first pieces appended."""
        heads = self._options["num_heads"]
        kv_heads = self._options.get("num_kv_heads") or heads
        key_dim = self._options["key_dim"]
        value_dim = self._options.get("value_dim") or key_dim
        for name, array, rows, dim in (("key", key, kv_heads, key_dim),
                                       ("value", value, kv_heads, value_dim),
                                       ("query", query, heads, key_dim)):
            if array is None:
                continue
            array = check_array(array, input_dtype, name)
            if (array.ndim != 3 or array.shape[0] != rows or array.shape[1] < 1
                    or array.shape[2] != dim):
                raise ValueError(f"{name} is an array of shape {list(array.shape)}, expected "
                                 f"[{rows}, T, {dim}] (the session's)")
        if key is not None and np.asarray(key).shape[1] != np.asarray(value).shape[1]:
            raise ValueError(f"key holds {np.asarray(key).shape[1]} tokens and value "
                             f"{np.asarray(value).shape[1]}, expected the same")

    def delete(self, timeout=None):
        """Deletes every shard not yet deleted, all at once (a shard whose replica is gone or
        hangs does not keep the others alive); raises the first error after trying them
        all."""
        with self._alone(timeout) as timeout:
            left = [shard for shard in self.shards if not shard.deleted]
            if not left:
                return
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(left)) as pool:
                futures = [pool.submit(shard.delete, timeout) for shard in left]
            for shard, future in zip(left, futures):
                error = future.exception()
                if error is None:
                    continue
                if not isinstance(error, AttnserveError):
                    raise error
                raise _of_shard(error, self.shards.index(shard)) from None
