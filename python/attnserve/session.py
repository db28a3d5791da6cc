"""attnserve.Session: a KV-cache session held by the server, from a decode loop's side."""
import collections
import contextlib
import hashlib
import threading
import time

import grpc

from attnserve.client import (_PRECISIONS, _STATUS_CODES, AttnserveError, _choice,
                              _data_dtype, _flag, _integer, _optional, _real, _seconds,
                              _timing)
from attnserve.tensors import to_tensor, wire_dtype
from attnserve.v1 import attention_pb2 as pb2

# A step's output [H, Tq, Dv] (None without a query), lse [H, Tq] (with return_lse), the
# layer's length after it, whether the output was recomputed after a lost answer, and the
# server's Timing of the call.
StepResult = collections.namedtuple("StepResult", "output lse length recovered timing")

_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
# How a ReplicaGoneError's message ends (a ShardedSession's shard leaves it out: it does not
# rebuild).
_REBUILD_ADVICE = "; create the session again elsewhere (rebuild(), or a rebuild_hook)"


class ReplicaGoneError(AttnserveError):
    """A pinned session's replica is gone, and the session with it (code ABORTED): it is
    unreachable through the retries, or restarted. `address` is where it was."""

    def __init__(self, message, address):
        super().__init__(grpc.StatusCode.ABORTED, message)
        self.address = address


# Codes of a call that may have done its work without its answer arriving.
_NO_ANSWER = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


# How long a pinned session's replica that stopped answering is waited for before it is told
# gone: more than gRPC's reconnect backoff (at most 0.5 s, client.py).
_GONE_PROBE_SECONDS = 1.0

# The most steps whose answers were lost a layer remembers (the oldest are forgotten).
_MOST_UNANSWERED = 16


def _digest(step):
    """What a step appends, as a digest of its key and value (their dtypes, shapes and bytes)."""
    return hashlib.sha256(step.key.SerializeToString(deterministic=True)
                          + step.value.SerializeToString(deterministic=True)).digest()


def _code(number):
    """The grpc.StatusCode of an ErrorStatus.code; UNKNOWN for a number that is none."""
    return _STATUS_CODES.get(number, grpc.StatusCode.UNKNOWN)


# The most layers, heads or dimensions a session a server describes may have (the server's
# own limits are far below): a broken server's num_layers of 2**40 would otherwise size
# this client's lists by it.
_MOST_PER_DIMENSION = 1 << 16


def _checked_info(info, expected_id=None):
    """`info`, a SessionInfo a server answered, or AttnserveError INTERNAL naming what in it
    no session can have, or an id other than `expected_id` (when given)."""
    dims = (info.num_layers, info.num_heads, info.num_kv_heads, info.key_dim, info.value_dim)
    if (not all(1 <= d <= _MOST_PER_DIMENSION for d in dims)
            or len(info.lengths) not in (0, info.num_layers)):
        raise AttnserveError(
            grpc.StatusCode.INTERNAL,
            f"the server described session {info.session_id} with num_layers "
            f"{info.num_layers}, {len(info.lengths)} lengths, heads {info.num_heads}/"
            f"{info.num_kv_heads} and dims {info.key_dim}/{info.value_dim}, expected each 1 "
            f"to {_MOST_PER_DIMENSION} and a length per layer")
    if expected_id and info.session_id != expected_id:
        raise AttnserveError(grpc.StatusCode.INTERNAL,
                             f"the server answered a call on session {expected_id} with "
                             f"session {info.session_id}")
    return info


def _one_result(response):
    """The only StepResult of a one-step Step's response."""
    if len(response.results) != 1:
        raise AttnserveError(grpc.StatusCode.INTERNAL,
                             f"the server answered {len(response.results)} results for 1 "
                             f"step")
    return response.results[0]


def _step_options(scale=None, precision=None, return_lse=False, output_dtype=None):
    options = pb2.StepOptions(return_lse=_flag(return_lse, "return_lse"),
                              precision=_choice(_PRECISIONS, precision, "precision"))
    if scale is not None:
        options.scale = _real(scale, "scale")
    if output_dtype is not None:
        options.output_dtype = pb2.DType.Value(
            wire_dtype(_data_dtype(output_dtype, "output_dtype")))
    return options


@contextlib.contextmanager
def _holding(lock, timeout, default, what):
    """Holds `lock` for one call on `what`, waiting for it within `timeout` (None: the
    client's `default`); yields the timeout left after the wait, for the call: one deadline
    bounds both (until 2026-12-07 a call given None waited up to the default, then had the
    whole default again, an audit found)."""
    wait = default if timeout is None else _seconds(timeout, "timeout")
    began = time.monotonic()
    if not lock.acquire(timeout=max(wait, 0)):
        raise AttnserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"{what} was busy with another thread's call for the whole "
                             f"timeout of {wait} s")
    try:
        yield max(wait - (time.monotonic() - began), 0)
    finally:
        lock.release()


def _delete_within(session, deadline):
    """Deletes `session` (a rebuild's that did not become the lost one) so that its pages go
    now, not at its TTL, within what is left of `deadline` and at most a second (a second of
    its own ran a step past its timeout when the hook failed on it); says what came of it."""
    left = min(_left(deadline), 1.0)
    if left <= 0:
        return "no time was left to delete it: it goes at its TTL"
    try:
        session.delete(timeout=left)
        return "deleted it"
    except AttnserveError as error:
        return f"deleting it failed ({error.message}): it goes at its TTL"


def _left(deadline):
    """The seconds left until `deadline` (time.monotonic()), or None for none."""
    return None if deadline is None else max(deadline - time.monotonic(), 0)


def _deadline(timeout):
    return None if timeout is None else time.monotonic() + timeout


def _layer(layer, num_layers):
    """`layer` checked against a session of `num_layers` layers -> int."""
    number = _integer(layer, "layer")
    if not 0 <= number < num_layers:
        raise ValueError(f"layer is {layer!r}, expected 0 to {num_layers - 1} (the session "
                         f"has {num_layers} layers)")
    return number


class Session:
    """A session's layers, each with the length this object believes it holds.

    Every step sends that length as its expected_length, and the server appends nothing to a
    layer that holds another (FAILED_PRECONDITION), so a retried step cannot append twice:
    steps are retried like any idempotent call. When a step may have landed before (it was
    sent more than once, or an earlier call on that layer that appended tokens failed without
    an answer) and is refused, the session asks the server for the layer's length. E + T (T
    the step's tokens) means it had landed if this call sent it more than once or the lost
    call appended the very same key and value: the length is recorded and, if the step had a
    query, the query is sent again alone over the same E + T tokens, which gives the lost
    output (StepResult.recovered). A length the lost call's own step explains (another key and
    value, or this one a query alone) means that step landed, not this one: the length is
    recorded and AttnserveError FAILED_PRECONDITION says so (send this step again if it
    follows that one). Until 2026-12-07 a different step of the same T was taken for the one
    that landed, and its query answered over the lost step's keys, as recovered. Any other
    length means another writer: FAILED_PRECONDITION naming both (sync() takes the server's
    lengths). One writer per
    session: no other process, or other Session object of the same id. One Session object may
    be shared by threads: its calls run one at a time, each waiting (within its timeout) for
    the one before, so a step waits out another thread's rebuild and goes to the rebuilt
    session.
    """

    def __init__(self, client, info, replica=None, expected_id=None):
        self._client = client
        self.info = _checked_info(info, expected_id)
        self.id = info.session_id
        self.lengths = list(info.lengths) or [0] * info.num_layers
        # Per layer, (expected_length, tokens, digest) of each appending step whose call
        # failed without an answer since its length was last known: any may have landed.
        self._unanswered = [[] for _ in self.lengths]
        self.deleted = False  # set by delete()
        # A delete() failed without an answer: it may have deleted the session, so a later
        # one's NOT_FOUND counts as done.
        self._delete_sent = False
        # Held through each call: a rebuild swaps the id, lengths and replica at once.
        self._lock = threading.RLock()
        # The process that holds it (ReplicaIdentity: name, incarnation), and where it is
        # pinned when attnserve.Replicas placed it.
        self.replica = replica if replica is not None else pb2.ReplicaIdentity()
        self.address = None
        self._replicas = None
        self._create_options = None
        self._rebuilding = False
        # fn(session, lengths, timeout): restores a rebuilt session's tokens (the caller's own
        # prefill) up to lengths[layer], stepping `session` (the new one, which this one
        # becomes when the hook returns; from any threads); with it, a step that finds the
        # replica gone rebuilds the session on the next replica and is sent again.
        self.rebuild_hook = None

    def _alone(self, timeout):
        return _holding(self._lock, timeout, self._client._timeout, f"session {self.id}")

    def _pin(self, replicas, address, create_options):
        self._replicas, self.address, self._create_options = replicas, address, create_options

    def step(self, layer, key=None, value=None, query=None, *, input_dtype=None,
             timeout=None, **options):
        """Appends key [Hkv, T, Dk] and value [Hkv, T, Dv] to `layer` (both or neither), then,
        with query [H, Tq, Dk], attends over the layer's whole cache, causal and aligned
        bottom-right (query row i sees keys j <= i + L - Tq). options: scale, precision
        ("f32", "bf16"), return_lse, output_dtype. Returns a StepResult; raises
        AttnserveError (ReplicaGoneError when a pinned session's replica is gone and there is
        no rebuild hook)."""
        with self._alone(timeout) as timeout:
            # One deadline for the step, its rebuild and its second sending (each once had
            # the whole timeout: three times it in all, an audit found).
            deadline = self._deadline(timeout)
            try:
                return self._step(layer, key, value, query, input_dtype, deadline, options)
            except ReplicaGoneError as error:
                if self.rebuild_hook is None or self._rebuilding:
                    raise
                gone = error
            try:
                self.rebuild(_left(deadline))
            except AttnserveError as error:
                # Still the replica-gone error, the rebuild's own failure told: the caller
                # may rebuild again.
                raise ReplicaGoneError(f"{gone.message}; rebuilding it failed: {error.message}",
                                       gone.address) from error
            return self._step(layer, key, value, query, input_dtype, deadline, options)

    def _deadline(self, timeout):
        """The time.monotonic() a call given `timeout` (None: the client's default) ends by."""
        return time.monotonic() + (self._client._timeout if timeout is None else timeout)

    def _gone_or(self, error, restarted=False, deadline=None):
        """`error` as a ReplicaGoneError when it says a pinned session's replica is gone:
        `restarted` (the caller's reading of it: a restarted replica's refusal of the
        incarnation the call carried), or UNAVAILABLE past the retries and then no answer to
        a GetSession that waits up to a second (at most half of what is left of `deadline`)
        for the replica to be reached again, or a draining replica's UNAVAILABLE. The retries span a fraction of a second, less than gRPC's reconnect
        backoff: until 2026-12-07 a blip of 0.6 s told a live session gone (and a rebuild
        hook made it anew elsewhere), an audit found. A replica that answers leaves `error`
        as it is, saying so."""
        if self._replicas is None:
            return error
        unreachable = error.code == grpc.StatusCode.UNAVAILABLE
        if not (unreachable or restarted):
            return error
        # A draining replica's own refusal (of a new session or fork; of any call once its
        # grace is over) says it goes, sessions and all: no probe.
        draining = "is draining" in error.message or "shutting down" in error.message
        if unreachable and not restarted and not draining:
            # At most half the time left: a rebuild hook needs the rest.
            wait = _GONE_PROBE_SECONDS if deadline is None else min(_GONE_PROBE_SECONDS,
                                                                    _left(deadline) / 2)
            if wait <= 0:
                return error  # No time to tell a blip from a death: not told gone.
            try:
                self._client.call_when_reachable(
                    "GetSession", pb2.GetSessionRequest(
                        session_id=self.id, replica_incarnation=self.replica.incarnation),
                    wait)
            except AttnserveError as probed:
                # GetSession fails FAILED_PRECONDITION only for the incarnation.
                restarted = probed.code == grpc.StatusCode.FAILED_PRECONDITION
                unreachable = not restarted
                if probed.code not in (grpc.StatusCode.UNAVAILABLE,
                                       grpc.StatusCode.DEADLINE_EXCEEDED,
                                       grpc.StatusCode.FAILED_PRECONDITION):
                    return error  # It answered: the replica is there.
            else:
                answered = AttnserveError(
                    error.code, f"{error.message} (the replica at {self.address} answered "
                    f"again at once and holds session {self.id}: send the call again)")
                answered.attempts = error.attempts
                return answered
        gone = ReplicaGoneError(
            f"session {self.id}'s replica {self.replica.name} (incarnation "
            f"{self.replica.incarnation}) at {self.address} is gone, and the session with "
            f"it: {'it is unreachable or draining' if unreachable else 'it restarted'} "
            f"({error.message}){_REBUILD_ADVICE}",
            self.address)
        gone.attempts = error.attempts  # Not 1: the calls the replica did not answer.
        return gone

    def _refused_for_incarnation(self, error, deadline):
        """Whether `error`, a ForkSession's or TruncateSession's that carried the incarnation,
        is a restarted replica's refusal of it. Those answer FAILED_PRECONDITION for evicted
        tokens too: a GetSession carrying the incarnation, which fails so for nothing else,
        tells them apart."""
        if (error.code != grpc.StatusCode.FAILED_PRECONDITION or not self.replica.incarnation
                or self._replicas is None):
            return False
        try:
            self._get(_left(deadline))
        except AttnserveError as probe:
            return probe.code == grpc.StatusCode.FAILED_PRECONDITION
        return False

    def _get(self, timeout):
        """GetSession of this session, carrying its incarnation."""
        request = pb2.GetSessionRequest(session_id=self.id,
                                        replica_incarnation=self.replica.incarnation)
        return self._client.call("GetSession", request, timeout).session

    def rebuild(self, timeout=None):
        """Creates the session anew (same shape, a new id) on the next replica in rendezvous
        order other than its own (its own if no other takes it: a replica that restarted is
        there, empty), then runs rebuild_hook, if any, to restore the lengths it
        had (FAILED_PRECONDITION if it leaves others). Only for a session Replicas placed.
        The hook is given the new session as a Session of its own, which it may step from
        any thread; this one becomes it when the hook has restored every layer, and until then
        other threads' calls on this one wait. If the hook raises or leaves other lengths, the
        new session is deleted (within what is left of `timeout`, else left to its TTL) and
        this one stays the lost one, to rebuild again."""
        with self._alone(timeout) as timeout:
            if self._replicas is None:
                raise AttnserveError(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"session {self.id} was not placed by attnserve.Replicas, "
                                     f"which alone can rebuild it on another replica")
            lengths = list(self.lengths)
            deadline = self._deadline(timeout)
            try:
                fresh = self._replicas.create_session(avoid={self.address},
                                                      timeout=_left(deadline),
                                                      **self._create_options)
            except AttnserveError as error:
                # No other replica took it: its own, which may have restarted (another
                # incarnation at the address, there and empty). Until 2026-12-07 it was never
                # asked, and a single replica's sessions could not be rebuilt.
                if error.code != grpc.StatusCode.UNAVAILABLE or _left(deadline) <= 0:
                    raise
                others = set(self._replicas.addresses) - {self.address}
                try:
                    fresh = self._replicas.create_session(avoid=others,
                                                          timeout=_left(deadline),
                                                          **self._create_options)
                except AttnserveError:
                    raise error from None
            if self.rebuild_hook is None:
                self._become(fresh)
                return
            self._rebuilding = True
            try:
                self.rebuild_hook(fresh, lengths, _left(deadline))
            except AttnserveError as error:
                # Said as the C++ Session says it.
                raise AttnserveError(
                    error.code, f"{error.message} ({_delete_within(fresh, deadline)}; this "
                    f"session is still the lost one, to rebuild again)") from error
            except BaseException:
                _delete_within(fresh, deadline)
                raise
            finally:
                self._rebuilding = False
            if fresh.lengths != lengths:
                # A session missing tokens never becomes this one (its steps would attend
                # without them, as a success).
                deleted = _delete_within(fresh, deadline)
                raise AttnserveError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the rebuild hook left session {fresh.id} at lengths {fresh.lengths}; the "
                    f"lost session held {lengths} ({deleted}; this session is still the lost "
                    f"one, to rebuild again)")
            self._become(fresh)

    def _become(self, fresh):
        """Takes `fresh`'s server session as this one's."""
        with fresh._lock:
            self._client, self.info, self.id = fresh._client, fresh.info, fresh.id
            self.lengths = list(fresh.lengths)
            self._unanswered = [list(lost) for lost in fresh._unanswered]
            self.replica, self.address = fresh.replica, fresh.address
            self.deleted = fresh.deleted
            self._delete_sent = fresh._delete_sent

    def _step(self, layer, key, value, query, input_dtype, deadline, options):
        if (key is None) != (value is None):
            raise ValueError("give key and value together, or neither")
        layer = _layer(layer, len(self.lengths))
        input_dtype = _data_dtype(input_dtype, "input_dtype")
        expected = self.lengths[layer]
        step = pb2.SessionStep(session_id=self.id, layer=layer, expected_length=expected,
                               options=_step_options(**options))
        tokens = 0
        if key is not None:
            step.key.CopyFrom(to_tensor(key, input_dtype, "key"))
            step.value.CopyFrom(to_tensor(value, input_dtype, "value"))
            tokens = int(step.key.shape[1]) if len(step.key.shape) == 3 else 0
        if query is not None:
            step.query.CopyFrom(to_tensor(query, input_dtype, "query"))
        try:
            response, attempts = self._client.call_counting(
                "Step", pb2.StepRequest(steps=[step],
                                        replica_incarnation=self.replica.incarnation),
                _left(deadline))
        except AttnserveError as error:
            if tokens:  # A step that appends nothing cannot have changed the layer.
                lost = self._unanswered[layer]
                lost.append((expected, tokens, _digest(step)))
                del lost[:-_MOST_UNANSWERED]
            # A Step call carrying an incarnation fails FAILED_PRECONDITION as a whole only
            # for that (a step's own refusals are in its result).
            raise self._gone_or(error, bool(self.replica.incarnation) and
                                error.code == grpc.StatusCode.FAILED_PRECONDITION,
                                deadline) from None
        result = _one_result(response)
        if result.HasField("error") and result.error.code != 0:
            error = AttnserveError(_code(result.error.code), result.error.message)
            if (result.error.code == _FAILED_PRECONDITION
                    and (attempts > 1 or self._unanswered[layer])):
                return self._recover(layer, step, tokens, attempts, error, deadline)
            raise error
        self._unanswered[layer] = []
        self.lengths[layer] = result.length
        return StepResult(_optional(result, "output"), _optional(result, "lse"),
                          result.length, False, _timing(response))

    def _recover(self, layer, step, tokens, attempts, refusal, deadline):
        expected = step.expected_length
        try:
            lengths = _checked_info(self._get(_left(deadline)), self.id).lengths
        except AttnserveError as error:
            raise self._gone_or(error, error.code == grpc.StatusCode.FAILED_PRECONDITION,
                                deadline) from None
        if len(lengths) != len(self.lengths):
            raise AttnserveError(grpc.StatusCode.INTERNAL,
                                 f"the server described session {self.id} with "
                                 f"{len(lengths)} layers' lengths; it has "
                                 f"{len(self.lengths)} layers")
        held = lengths[layer]
        lost = self._unanswered[layer]
        if held == expected:
            self._unanswered[layer] = []
            raise refusal
        # What may have landed: this step, sent more than once or by the lost call with the
        # same key and value; or a lost call's other step ending where the layer ends.
        this = (expected, tokens, _digest(step)) if tokens else None  # hashed once
        mine = tokens and expected + tokens == held and (attempts > 1 or this in lost)
        theirs = [(e, t) for e, t, d in lost if e + t == held and (e, t, d) != this]
        if theirs:
            self.lengths[layer] = held
            self._unanswered[layer] = []
            e, t = theirs[-1]
            if mine:
                raise AttnserveError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"layer {layer} of session {self.id} holds {held} tokens: either this "
                    f"step (sent more than once) or an earlier one of {t} tokens sent at "
                    f"length {e} and given up without its answer landed, and which cannot be "
                    f"told; this session now expects {held} (truncate({expected}) and send "
                    f"the one you want again)")
            raise AttnserveError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"an earlier step on layer {layer} of session {self.id} ({t} tokens sent at "
                f"length {e}), given up without its answer, had landed: the layer holds "
                f"{held} tokens, and this session now expects that; this step was not "
                f"appended (send it again if it follows that one)")
        if not mine:
            raise AttnserveError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"layer {layer} of session {self.id} holds {held} tokens, expected "
                f"{expected} before this step or {expected + tokens} after it: another "
                f"writer changed the session (sync() takes the server's lengths)")
        self.lengths[layer] = held
        self._unanswered[layer] = []
        if not step.HasField("query"):
            return StepResult(None, None, held, True, None)
        again = pb2.SessionStep(session_id=self.id, layer=layer, expected_length=held,
                                options=step.options)
        again.query.CopyFrom(step.query)

        def landed(code, message):
            # Said whatever failed, and never as the replica gone: a step sent again whole,
            # or a rebuild, would append its tokens, which landed, a second time (the
            # C++ Session says the same).
            return AttnserveError(
                code, f"the step had landed on an earlier attempt (its tokens are kept: "
                f"layer {layer} holds {held}), but recomputing its lost output failed: "
                f"{message}; send the query again alone")

        try:
            response = self._client.call(
                "Step", pb2.StepRequest(steps=[again],
                                        replica_incarnation=self.replica.incarnation),
                _left(deadline))
        except AttnserveError as error:
            raise landed(error.code, error.message) from None
        result = _one_result(response)
        if result.HasField("error") and result.error.code != 0:
            raise landed(_code(result.error.code), result.error.message)
        return StepResult(_optional(result, "output"), _optional(result, "lse"),
                          result.length, True, _timing(response))

    def fork(self, length=None, ttl_seconds=0, timeout=None):
        """A new session sharing this one's first `length` tokens of every layer (all when
        None); retried only with RetryPolicy.retry_session_creation."""
        with self._alone(timeout) as timeout:
            deadline = _deadline(self._client._timeout if timeout is None else timeout)
            request = pb2.ForkSessionRequest(session_id=self.id,
                                             ttl_seconds=_integer(ttl_seconds, "ttl_seconds"),
                                             replica_incarnation=self.replica.incarnation)
            if length is not None:
                request.length = _integer(length, "length")
            try:
                response = self._client.call(
                    "ForkSession", request, timeout,
                    retryable=self._client._retry.retry_session_creation)
            except AttnserveError as error:
                raise self._gone_or(error, self._refused_for_incarnation(error, deadline),
                                    deadline) from None
            child = Session(self._client, response.session, response.replica)
            child._pin(self._replicas, self.address, self._create_options)
            return child

    def truncate(self, length, timeout=None):
        """Keeps every layer's first `length` tokens."""
        with self._alone(timeout) as timeout:
            deadline = _deadline(self._client._timeout if timeout is None else timeout)
            request = pb2.TruncateSessionRequest(session_id=self.id,
                                                 length=_integer(length, "length"),
                                                 replica_incarnation=self.replica.incarnation)
            try:
                info = self._client.call("TruncateSession", request, timeout).session
            except AttnserveError as error:
                raise self._gone_or(error, self._refused_for_incarnation(error, deadline),
                                    deadline) from None
            self._adopt(info)

    def sync(self, timeout=None):
        """Takes the server's lengths (after a step given up, or another writer)."""
        with self._alone(timeout) as timeout:
            deadline = _deadline(timeout)
            try:
                info = self._get(timeout)
            except AttnserveError as error:
                # GetSession fails FAILED_PRECONDITION only for the incarnation.
                raise self._gone_or(error, error.code == grpc.StatusCode.FAILED_PRECONDITION,
                                    deadline) from None
            self._adopt(info)

    def delete(self, timeout=None):
        """Deletes the session; NOT_FOUND counts as done after an attempt whose answer was
        lost (a retry of this call, or an earlier delete() that failed), and so does a pinned
        session's replica that restarted (its sessions went with the process)."""
        with self._alone(timeout) as timeout:
            deadline = _deadline(timeout)
            request = pb2.DeleteSessionRequest(session_id=self.id,
                                               replica_incarnation=self.replica.incarnation)
            try:
                self._client.call_counting("DeleteSession", request, timeout)
            except AttnserveError as error:
                maybe_deleted = error.attempts >= 2 or self._delete_sent
                # DeleteSession fails FAILED_PRECONDITION only for the incarnation: the
                # replica restarted, and the session went with the process that held it.
                restarted = (error.code == grpc.StatusCode.FAILED_PRECONDITION
                             and self._replicas is not None)
                if (error.code != grpc.StatusCode.NOT_FOUND or not maybe_deleted) \
                        and not restarted:
                    # Only a failure without the server's answer may hide a deletion.
                    self._delete_sent = self._delete_sent or error.code in _NO_ANSWER
                    raise self._gone_or(
                        error, error.code == grpc.StatusCode.FAILED_PRECONDITION,
                        deadline) from None
            self.deleted = True

    def _adopt(self, info):
        self.info = _checked_info(info, self.id)
        self.lengths = list(info.lengths)
        self._unanswered = [[] for _ in self.lengths]
