"""attnserve.Client: every RPC of attnserve.v1.AttentionService with NumPy arrays."""
import collections
import collections.abc
import dataclasses
import numbers
import random
import time

import grpc
import numpy as np

from attnserve.tensors import from_tensor, to_tensor, wire_dtype
from attnserve.v1 import attention_pb2 as pb2
from attnserve.v1 import attention_pb2_grpc as pb2_grpc


class AttnserveError(Exception):
    """A call that failed: `code` is its grpc.StatusCode, `message` the server's (or gRPC's)
    message, which names the field at fault and what was expected."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.attempts = 1  # calls made before it was given up
        # The server marked the refusal one the same request meets again (the trailer
        # grpc-retry-pushback-ms: -1): another replica would refuse it too.
        self.permanent = False


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Retries of a call that failed with one of `retry_on`: exponential backoff with jitter
    (each wait drawn from [0.5, 1) of the backoff), never past the call's deadline, and never
    after the server's trailer grpc-retry-pushback-ms: -1, which marks a refusal the same call
    would meet again (a request over one of its limits on a request's own size).
    Weight puts and deletes are retried only with `retry_weight_changes`, session creates and
    forks only with `retry_session_creation` (a create whose answer was lost would leave a
    session nobody knows the id of); every other call is safe to repeat."""
    max_attempts: int = 3
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    backoff_multiplier: float = 2.0
    retry_on: tuple = (grpc.StatusCode.UNAVAILABLE,)
    retry_weight_changes: bool = False
    retry_session_creation: bool = False
    # An mha() naming a weights_version the replica does not hold (FAILED_PRECONDITION):
    # another replica, or this one after its next look at a shared weights_dir, may hold it.
    retry_weights_version: bool = True
    # CANCELLED while the client is open, which a call gets only from the server's side (this
    # client cancels none): gRPC 1.51 cancels a call that reaches a server as its shutdown
    # begins, before attnserve sees it, and a server past its drain's 30 s cancels what runs.
    retry_cancelled_by_server: bool = True

    def __post_init__(self):
        # Checked here, as the C++ ClientOptions are at Connect: a negative or NaN backoff,
        # or a lone StatusCode as retry_on, raised a raw error at the first retry only.
        if (not isinstance(self.max_attempts, numbers.Integral)
                or isinstance(self.max_attempts, bool) or not 1 <= self.max_attempts <= 100):
            raise ValueError(f"max_attempts is {self.max_attempts!r}, expected 1 to 100")
        for name in ("initial_backoff", "max_backoff", "backoff_multiplier"):
            value = getattr(self, name)
            try:
                finite = (isinstance(value, numbers.Real) and not isinstance(value, bool)
                          and bool(np.isfinite(float(value))))
            except OverflowError:  # an int past any float
                finite = False
            if not finite:
                raise ValueError(f"{name} is {value!r}, expected a finite number")
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError(f"initial_backoff is {self.initial_backoff!r} and max_backoff "
                             f"{self.max_backoff!r}, expected 0 < initial_backoff <= "
                             f"max_backoff")
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier is {self.backoff_multiplier!r}, expected "
                             f">= 1")
        codes = None
        if not isinstance(self.retry_on, (grpc.StatusCode, str, bytes)):
            try:
                codes = tuple(self.retry_on)  # once: a generator is read here alone
            except TypeError:
                pass
        if codes is None or not all(isinstance(code, grpc.StatusCode) for code in codes):
            raise ValueError(f"retry_on is {self.retry_on!r}, expected a tuple of "
                             f"grpc.StatusCode, e.g. (grpc.StatusCode.UNAVAILABLE,)")
        object.__setattr__(self, "retry_on", codes)
        for name in ("retry_weight_changes", "retry_session_creation",
                     "retry_weights_version", "retry_cancelled_by_server"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} is {getattr(self, name)!r}, expected True or False")


# The longest token a server's token file holds (gRPC bounds a call's headers at 8 KiB).
_MAX_TOKEN_BYTES = 4096


def _check_token(token):
    """ValueError, never showing the token, for one no authorization header can carry or no
    server's token file holds: gRPC took it and failed every call with a raw ValueError
    whose message held the secret (an audit found), and one read with its line's end
    matches nothing."""
    if len(token) > _MAX_TOKEN_BYTES:
        raise ValueError(f"token is {len(token)} characters, expected at most "
                         f"{_MAX_TOKEN_BYTES} (it goes in an HTTP header, which gRPC bounds "
                         f"at 8 KiB with the others)")
    for offset, char in enumerate(token):
        if not " " <= char <= "~":
            raise ValueError(f"token holds {ord(char):#04x} at offset {offset}, expected "
                             f"printable ASCII (a token read from a file keeps its line's "
                             f"end: strip it)")
    if token != token.strip(" "):
        raise ValueError("token starts or ends with a space, which no token in a server's "
                         "token file does (its lines are stripped)")


def _over_message_limit(failure):
    """Whether `failure` is gRPC's refusal of a message over a max_message_bytes limit, the
    client's or the server's: the same call meets it again (retried until 2026-12-07 when
    RESOURCE_EXHAUSTED was in retry_on, an audit found; the C++ Client never did)."""
    return failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and str(failure.message).startswith(
        ("Received message larger than max", "Sent message larger than max"))


def _server_says_never_retry(error):
    """Whether the server asked for no retry of the failed call (gRFC A6: a negative
    grpc-retry-pushback-ms trailer): it refused it for one of its limits on a request's own
    size (max_elements, max_request_memory_bytes, ...), which the same call would meet again."""
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return any(key == "grpc-retry-pushback-ms" and str(value).startswith("-")
               for key, value in (trailers or ()))


# The server's times for a call (ServerTiming), in microseconds: waiting for an executor,
# computing, and from the parsed request to the response handed to gRPC.
Timing = collections.namedtuple("Timing", "queue_us compute_us server_us")
# An Attend's output [B, H, Lq, Dv], lse [B, H, Lq] or None, weights or None.
AttendResult = collections.namedtuple("AttendResult", "output lse weights timing")
# A MultiHeadAttention's output [B, Lq, E]; weights_version: the registered set's version used.
MhaResult = collections.namedtuple("MhaResult",
                                   "output lse weights weights_version timing")
PutWeightsResult = collections.namedtuple("PutWeightsResult", "version bytes")

_ALIGNMENTS = {"top_left": "TOP_LEFT", "bottom_right": "BOTTOM_RIGHT"}
_RETURN_WEIGHTS = {None: "NONE", "none": "NONE", "per_head": "PER_HEAD",
                   "head_mean": "HEAD_MEAN"}
_PRECISIONS = {None: "F32", "f32": "F32", "bf16": "BF16"}
# grpc.StatusCode by its number (ErrorStatus.code on an AttendStream answer).
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}

_COMPRESSION = {None: grpc.Compression.NoCompression, "none": grpc.Compression.NoCompression,
                "gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}


def _choice(table, value, name):
    key = value.lower() if isinstance(value, str) else value
    try:
        known = key in table
    except TypeError:  # unhashable
        known = False
    if not known:
        expected = ", ".join(str(k) for k in table if k is not None)
        raise ValueError(f"{name} is {value!r}, expected one of {expected}")
    return table[key]


# Checks of arguments before anything is sent: each raises ValueError naming the argument and
# what it expects (the server would refuse the value, or protobuf raise a TypeError, or a
# value would be silently changed, as int() truncates 4.7).

def _flag(value, name):
    """True or False (a NumPy bool too) -> bool."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} is {value!r}, expected True or False")


def _integer(value, name):
    """A Python or NumPy integer, or a float of integral value, within int64 -> int."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        if isinstance(value, numbers.Integral) or float(value).is_integer():
            number = int(value)
            if -(1 << 63) <= number < (1 << 63):
                return number
    raise ValueError(f"{name} is {value!r}, expected an integer")


def _text(value, name):
    """A str (a weight set's name, a session id), for the server to check its form."""
    if isinstance(value, str):
        return value
    raise ValueError(f"{name} is {value!r}, expected a str")


def _integers(values, name):
    """A sequence (list, tuple, 1-D array) of integers -> a list of int."""
    if isinstance(values, np.ndarray):
        sequence = values.ndim == 1
    else:
        sequence = (isinstance(values, collections.abc.Iterable)
                    and not isinstance(values, (str, bytes)))
    if not sequence:
        raise ValueError(f"{name} is {values!r}, expected a sequence of integers")
    return [_integer(value, f"{name}[{i}]") for i, value in enumerate(values)]


# The farthest deadline a call is given: gRPC's deadline overflows past about 4e9 s, and a
# lock's wait past threading.TIMEOUT_MAX; 1e8 s (three years) waits as long as any longer one.
_MAX_SECONDS = 1e8
# The largest C int, gRPC's limit for a channel's message sizes.
_MAX_INT32 = (1 << 31) - 1


def _seconds(value, name):
    """A finite number of seconds (a deadline's distance), as float, at most _MAX_SECONDS."""
    if (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and np.isfinite(float(value))):
        return min(float(value), _MAX_SECONDS)
    raise ValueError(f"{name} is {value!r}, expected a finite number of seconds")


def _flat(values):
    """An array or nested lists of numbers, of any rank, row-major, as one dimension;
    anything else as it is (for _integers to refuse, naming it)."""
    if isinstance(values, (list, tuple)) and values and isinstance(values[0], (list, tuple)):
        try:
            values = np.asarray(values)
        except ValueError:  # ragged
            return values
    if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
        return values.ravel()
    return values


def _real(value, name):
    """A Python or NumPy number (not a bool) -> float."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    raise ValueError(f"{name} is {value!r}, expected a number")


def _reals(values, name):
    """A sequence (list, tuple, 1-D array) of numbers -> a float32 array."""
    try:
        array = np.asarray(values)
    except ValueError:  # ragged
        array = None
    if array is None or array.ndim != 1 or array.dtype.kind not in "fiu":
        raise ValueError(f"{name} is {values!r}, expected a sequence of numbers")
    return array.astype(np.float32)


_DATA_DTYPES = ("float32", "bfloat16", "float16")


def _data_dtype(value, name):
    """None, or "float32", "bfloat16", "float16" (any case): what data travels, is stored
    and is answered as (bool is only for masks) -> the lower-case name or None."""
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in _DATA_DTYPES:
        raise ValueError(f"{name} is {value!r}, expected float32, bfloat16 or float16")
    return value.lower()


def _mask_tensor(mask):
    try:
        return to_tensor(mask, what="attn_mask")
    except ValueError:
        raise ValueError(f"attn_mask is a NumPy {np.asarray(mask).dtype} array, expected bool "
                         f"(True = may attend) or float (added to the scores): float32, "
                         f"float16, float64, or uint16 bfloat16 bits") from None


def attention_options(*, causal=False, causal_alignment="top_left", scale=None,
                      key_lengths=None, attn_mask=None, return_lse=False,
                      return_weights=None, precision=None, output_dtype=None,
                      window_left=None, window_right=None, num_sink_tokens=0,
                      alibi_slopes=None, softcap=None, cu_seqlens_q=None,
                      cu_seqlens_k=None, query_positions=None, key_positions=None):
    """AttentionOptions from Python values. attn_mask: a NumPy array, bool (True = may
    attend) or float (added to the scores), broadcastable to [B, H, Lq, Lk].
    window_left / window_right (None or -1: unbounded), num_sink_tokens, alibi_slopes
    (one per query head) and softcap as docs/api.md defines them; cu_seqlens_q and
    cu_seqlens_k: packed sequences, with [total, H, D] tensors. query_positions and
    key_positions: the tokens' positions for a weight set with RoPE (mha() only), B * Lq and
    B * Lk integers (row-major [B, L]; None: 0 to L - 1). A value of the wrong kind
    (a flag not True or False, a length or window not an integer, output_dtype not float32,
    bfloat16 or float16, a mask neither bool nor float) is a ValueError naming it."""
    options = pb2.AttentionOptions(
        causal=_flag(causal, "causal"),
        causal_alignment=_choice(_ALIGNMENTS, causal_alignment, "causal_alignment"),
        return_lse=_flag(return_lse, "return_lse"),
        return_weights=_choice(_RETURN_WEIGHTS, return_weights, "return_weights"),
        precision=_choice(_PRECISIONS, precision, "precision"))
    if scale is not None:
        options.scale = _real(scale, "scale")
    if key_lengths is not None:
        options.key_lengths.extend(_integers(key_lengths, "key_lengths"))
    if attn_mask is not None:
        options.attn_mask.CopyFrom(_mask_tensor(attn_mask))
    if output_dtype is not None:
        options.output_dtype = pb2.DType.Value(
            wire_dtype(_data_dtype(output_dtype, "output_dtype")))
    if window_left is not None:
        options.window_left = _integer(window_left, "window_left")
    if window_right is not None:
        options.window_right = _integer(window_right, "window_right")
    if num_sink_tokens is not None:
        options.num_sink_tokens = _integer(num_sink_tokens, "num_sink_tokens")
    if alibi_slopes is not None:
        options.alibi_slopes.CopyFrom(to_tensor(_reals(alibi_slopes, "alibi_slopes")))
    if softcap is not None:
        options.softcap = _real(softcap, "softcap")
    if cu_seqlens_q is not None:
        options.cu_seqlens_q.extend(_integers(cu_seqlens_q, "cu_seqlens_q"))
    if cu_seqlens_k is not None:
        options.cu_seqlens_k.extend(_integers(cu_seqlens_k, "cu_seqlens_k"))
    if query_positions is not None:
        options.query_positions.extend(_integers(_flat(query_positions), "query_positions"))
    if key_positions is not None:
        options.key_positions.extend(_integers(_flat(key_positions), "key_positions"))
    return options


def _timing(response):
    timing = response.timing
    return Timing(timing.queue_us, timing.compute_us, timing.server_us)


def _answered(response, field):
    """The float array of `response`'s tensor `field`, or AttnserveError INTERNAL naming it
    when the server's tensor cannot be one (another dtype, a shape its bytes do not fill)."""
    tensor = getattr(response, field)
    try:
        array = from_tensor(tensor)
    except ValueError as error:
        raise AttnserveError(grpc.StatusCode.INTERNAL,
                             f"the server answered a {field} that cannot be read: "
                             f"{error}") from None
    if array.dtype == np.bool_:
        raise AttnserveError(grpc.StatusCode.INTERNAL,
                             f"the server answered a BOOL {field}, expected float values")
    return array


def _optional(response, field):
    return _answered(response, field) if response.HasField(field) else None


def _attend_result(response):
    """An AttendResponse as the AttendResult attend() and attend_stream() give."""
    return AttendResult(_answered(response, "output"), _optional(response, "lse"),
                        _optional(response, "weights"), _timing(response))


class Client:
    """A channel to one attnserve target ("localhost:50051",
    "dns:///attnserve-headless.ml.svc:50051"), thread-safe.

    tls: True for TLS with gRPC's default roots, or give root_certificates (PEM bytes) and,
    for mutual TLS, certificate_chain and private_key; server_name_override when the target is
    an address. token: sent as "authorization: Bearer <token>" on every call. compression:
    "gzip" or "deflate" compresses every request (the server needs
    --accept_compressed_requests). timeout: each call's default deadline, in seconds.
    """

    def __init__(self, target, *, tls=False, root_certificates=None, certificate_chain=None,
                 private_key=None, server_name_override=None, token=None,
                 retry=RetryPolicy(), compression=None, timeout=30.0,
                 max_message_bytes=64 << 20, wait_for_ready=False):
        # gRPC takes a C int here: a larger one raised OverflowError naming nothing.
        max_message_bytes = _integer(max_message_bytes, "max_message_bytes")
        if not 1 <= max_message_bytes <= _MAX_INT32:
            raise ValueError(f"max_message_bytes is {max_message_bytes}, expected 1 to "
                             f"{_MAX_INT32}")
        if not isinstance(retry, RetryPolicy):
            raise ValueError(f"retry is {retry!r}, expected an attnserve.RetryPolicy "
                             f"(RetryPolicy(max_attempts=1) retries nothing)")
        if token is not None and not isinstance(token, str):
            # bytes would be sent as "Bearer b'...'".
            raise ValueError(f"token is of type {type(token).__name__}, expected a str")
        if token is not None:
            _check_token(token)
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.lb_policy_name", "round_robin"),
                   ("grpc.keepalive_time_ms", 30000),
                   ("grpc.keepalive_timeout_ms", 10000),
                   # A replica restarted at its address is reached within about half a
                   # second of listening, as with the C++ Client (client.cc says why, and
                   # attnserve/__init__.py sets gRPC's backup poller as it does):
                   # attempts 100 ms apart at first, then at most 500 ms.
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 1000),
                   ("grpc.max_reconnect_backoff_ms", 500)]
        if server_name_override:
            options.append(("grpc.ssl_target_name_override", server_name_override))
        if (private_key or server_name_override) and not (
                tls or root_certificates or certificate_chain):
            # Not a plaintext channel, on which a token would travel in clear.
            raise ValueError(
                f"{'private_key' if private_key else 'server_name_override'} is set without "
                f"tls, root_certificates or certificate_chain: expected TLS options "
                f"(certificate_chain with private_key for mutual TLS)")
        if bool(certificate_chain) != bool(private_key) and (
                tls or root_certificates or certificate_chain):
            # gRPC asserts on half a key pair: the whole process ended (SIGABRT).
            raise ValueError(
                f"{'certificate_chain' if certificate_chain else 'private_key'} is set without "
                f"{'private_key' if certificate_chain else 'certificate_chain'}: expected both "
                f"(mutual TLS) or neither")
        if tls or root_certificates or certificate_chain:
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                       certificate_chain)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb2_grpc.AttentionServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._compression = _choice(_COMPRESSION, compression, "compression")
        self._retry = retry
        self._timeout = _seconds(timeout, "timeout")
        self._closed = False
        self._wait_for_ready = wait_for_ready
        self.target = target

    def close(self):
        """Closes the channel: calls in flight end CANCELLED, later ones fail CANCELLED with
        "the client is closed"."""
        self._closed = True
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.close()

    # ---- calls ------------------------------------------------------------------------------

    def call(self, method, request, timeout=None, retryable=True, also_retry_on=()):
        """Calls `method` (a name of AttentionService's, "Attend") with `request`, retried per
        the RetryPolicy (and on the codes of `also_retry_on`) within `timeout` in all. Raises
        AttnserveError."""
        return self.call_counting(method, request, timeout, retryable, also_retry_on)[0]

    def call_when_reachable(self, method, request, timeout):
        """One attempt of `method` that waits up to `timeout` for the channel to reach the
        server (gRPC's wait_for_ready) rather than failing UNAVAILABLE at once: whether a
        server that stopped answering does so again soon. Raises AttnserveError."""
        if self._closed:
            raise AttnserveError(grpc.StatusCode.CANCELLED, f"{method}: the client is closed")
        try:
            return getattr(self._stub, method)(
                request, timeout=_seconds(timeout, "timeout"), metadata=self._metadata,
                compression=self._compression, wait_for_ready=True)
        except ValueError:  # gRPC's for a channel closed meanwhile
            raise AttnserveError(grpc.StatusCode.CANCELLED,
                                 f"{method}: the client is closed") from None
        except grpc.RpcError as error:
            raise AttnserveError(error.code(), error.details()) from None

    def call_counting(self, method, request, timeout=None, retryable=True,
                      also_retry_on=()):
        """call(), returning (response, the number of attempts it took). An AttnserveError
        it raises carries `attempts` too."""
        deadline = time.monotonic() + (self._timeout if timeout is None
                                       else _seconds(timeout, "timeout"))
        rpc = getattr(self._stub, method)
        backoff = self._retry.initial_backoff
        attempt = 1
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                failure = AttnserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"{method}: the deadline passed before an answer")
                failure.attempts = attempt
                raise failure
            try:
                if self._closed:
                    raise ValueError("closed")
                return rpc(request, timeout=left, metadata=self._metadata,
                           compression=self._compression,
                           wait_for_ready=self._wait_for_ready), attempt
            except ValueError:  # gRPC's for a closed channel
                if not self._closed:
                    raise
                failure = AttnserveError(grpc.StatusCode.CANCELLED,
                                         f"{method}: the client is closed")
                failure.attempts = attempt
                raise failure from None
            except grpc.RpcError as error:
                failure = AttnserveError(error.code(), error.details())
                failure.attempts = attempt
                failure.permanent = _server_says_never_retry(error)
                cancelled_by_server = (failure.code == grpc.StatusCode.CANCELLED
                                       and self._retry.retry_cancelled_by_server
                                       and not self._closed)
                if (not retryable or attempt >= self._retry.max_attempts
                        or _server_says_never_retry(error) or _over_message_limit(failure)
                        or (failure.code not in self._retry.retry_on
                            and failure.code not in also_retry_on
                            and not cancelled_by_server)):
                    raise failure from None
                wait = backoff * random.uniform(0.5, 1.0)
                if time.monotonic() + wait >= deadline:
                    raise failure from None
                time.sleep(wait)
                backoff = min(backoff * self._retry.backoff_multiplier,
                              self._retry.max_backoff)
                attempt += 1

    def attend_request(self, query, key, value, *, input_dtype=None, **options):
        """The AttendRequest attend() sends (for AttendStream or sharding)."""
        input_dtype = _data_dtype(input_dtype, "input_dtype")
        return pb2.AttendRequest(query=to_tensor(query, input_dtype, "query"),
                                 key=to_tensor(key, input_dtype, "key"),
                                 value=to_tensor(value, input_dtype, "value"),
                                 options=attention_options(**options))

    def attend(self, query, key, value, *, input_dtype=None, timeout=None, **options):
        """Scaled dot-product attention: query [B, H, Lq, Dk], key [B, Hkv, Lk, Dk], value
        [B, Hkv, Lk, Dv] -> AttendResult with output [B, H, Lq, Dv].

        input_dtype ("float32", "bfloat16", "float16") converts the three before sending.
        options: causal, causal_alignment ("top_left", "bottom_right"), scale, key_lengths,
        attn_mask, return_lse, return_weights ("per_head", "head_mean"), precision ("f32",
        "bf16"), output_dtype, window_left, window_right, num_sink_tokens, alibi_slopes,
        softcap.
        """
        request = self.attend_request(query, key, value, input_dtype=input_dtype, **options)
        response = self.call("Attend", request, timeout)
        return _attend_result(response)

    def attend_stream(self, requests, timeout=None):
        """AttendStream: sends the AttendRequests of the iterable `requests` (attend_request()
        builds them; it is read as the stream's flow control allows, so it may be a generator
        that waits for answers) on one stream, and yields an (index, answer) pair per request,
        in the order sent: answer is an AttendResult, or, for a request the server refused or
        failed, an AttnserveError (yielded, not raised: the stream goes on). The stream is
        not retried. Raises AttnserveError if the stream itself fails (its deadline, `timeout`
        for the whole stream, passes; the server drains; the client is closed), TypeError if
        `requests` yields something other than an AttendRequest, and whatever `requests`
        itself raises (the stream is cancelled then, answers not yet read lost)."""
        deadline = self._timeout if timeout is None else _seconds(timeout, "timeout")
        refused = []

        def checked():
            # gRPC reads this on a thread of its own, where an exception would be lost:
            # it is kept, the call cancelled, and the caller gets it instead.
            try:
                for index, request in enumerate(requests):
                    if not isinstance(request, pb2.AttendRequest):
                        raise TypeError(
                            f"requests[{index}] is a {type(request).__name__}, expected an "
                            "AttendRequest (Client.attend_request builds one)")
                    yield request
            except Exception as error:  # pylint: disable=broad-except
                refused.append(error)
                call.cancel()

        try:
            call = self._stub.AttendStream(checked(), timeout=deadline,
                                           metadata=self._metadata,
                                           compression=self._compression,
                                           wait_for_ready=self._wait_for_ready)
        except ValueError:  # gRPC's for a closed channel
            if not self._closed:
                raise
            raise AttnserveError(grpc.StatusCode.CANCELLED,
                                 "AttendStream: the client is closed") from None
        try:
            for answer in call:
                if answer.HasField("error"):
                    yield answer.index, AttnserveError(
                        _STATUS_CODES.get(answer.error.code, grpc.StatusCode.UNKNOWN),
                        answer.error.message)
                else:
                    yield answer.index, _attend_result(answer.response)
        except grpc.RpcError as error:
            if refused:
                raise refused[0] from None
            code = error.code()
            message = error.details()
            if self._closed and code == grpc.StatusCode.CANCELLED:
                message = "AttendStream: the client is closed"
            raise AttnserveError(code, message) from None
        finally:
            call.cancel()  # a consumer that stops early ends the stream
        if refused:
            raise refused[0]

    def mha(self, query_input, kv_input=None, *, weights_name=None, weights_version=0,
            weights=None, num_heads=None, num_kv_heads=0, rope_theta=None, rotary_dim=0,
            rope_interleaved=False, input_dtype=None, timeout=None, **options):
        """nn.MultiheadAttention, batch first: query_input [B, Lq, E], kv_input [B, Lk, Ekv]
        or None (self-attention) -> MhaResult with output [B, Lq, E].

        The projections: a registered set (weights_name, and weights_version to insist on
        one), or inline `weights`, a dict of w_q, w_k, w_v, w_o and optional b_q, b_k, b_v,
        b_o arrays in torch.nn.Linear layout, with num_heads (and num_kv_heads), and
        rope_theta (None: no RoPE), rotary_dim (0: the head) and rope_interleaved for a
        Llama-style layer. query_positions and key_positions (options) place the tokens of
        a set with RoPE.
        """
        input_dtype = _data_dtype(input_dtype, "input_dtype")
        request = pb2.MultiHeadAttentionRequest(
            query_input=to_tensor(query_input, input_dtype, "query_input"),
            options=attention_options(**options))
        if kv_input is not None:
            request.kv_input.CopyFrom(to_tensor(kv_input, input_dtype, "kv_input"))
        if (weights_name is None) == (weights is None):
            raise ValueError("give weights_name or weights, not both or neither")
        if weights_name is not None and (rope_theta is not None or rotary_dim
                                         or rope_interleaved):
            raise ValueError("rope_theta, rotary_dim and rope_interleaved are for inline "
                             "weights: a registered set has its own")
        if weights_name is not None:
            request.weights_name = weights_name
            request.weights_version = _integer(weights_version, "weights_version")
        else:
            request.weights.CopyFrom(_projection_weights(
                weights, num_heads, num_kv_heads,
                _rope(rope_theta, rotary_dim, rope_interleaved)))
        pinned = request.weights_version != 0 and self._retry.retry_weights_version
        response = self.call("MultiHeadAttention", request, timeout,
                             also_retry_on=(grpc.StatusCode.FAILED_PRECONDITION,)
                             if pinned else ())
        return MhaResult(_answered(response, "output"), _optional(response, "lse"),
                         _optional(response, "weights"), response.weights_version,
                         _timing(response))

    def put_weights(self, name, weights, *, num_heads, num_kv_heads=0, rope_theta=None,
                    rotary_dim=0, rope_interleaved=False, timeout=None):
        """Registers `weights` (as mha() takes them inline, RoPE included) under `name` ->
        PutWeightsResult (the new version, the bytes the server holds for them)."""
        request = pb2.PutWeightsRequest(
            name=_text(name, "name"), weights=_projection_weights(
                weights, num_heads, num_kv_heads,
                _rope(rope_theta, rotary_dim, rope_interleaved)))
        response = self.call("PutWeights", request, timeout,
                             retryable=self._retry.retry_weight_changes)
        return PutWeightsResult(response.version, response.bytes)

    def list_weights(self, timeout=None):
        """The registered weight sets: WeightsInfo messages (name, version, bytes, num_heads,
        num_kv_heads, embed_dim, kv_embed_dim, key_dim, value_dim, has_bias), by name: every
        page the server answers (at most 4,096 sets each), all within `timeout`."""
        # Names only increase from page to page.
        return self._walk_pages("ListWeights", pb2.ListWeightsRequest, "weights", timeout,
                                lambda old, new: new > old, 1 << 24)

    def delete_weights(self, name, timeout=None):
        self.call("DeleteWeights", pb2.DeleteWeightsRequest(name=_text(name, "name")), timeout,
                  retryable=self._retry.retry_weight_changes)

    # ---- KV-cache sessions ------------------------------------------------------------------

    def create_session(self, *, num_layers, num_heads, key_dim, num_kv_heads=0, value_dim=0,
                       dtype="float32", max_tokens=0, ttl_seconds=0, scale=None,
                       session_id=None, timeout=None, window_left=None, num_sink_tokens=0,
                       alibi_slopes=None, softcap=None, evict_outside_window=False,
                       rope_theta=None, rotary_dim=0, rope_interleaved=False):
        """A new KV-cache session (attnserve.Session); dtype: how the server stores keys and
        values ("float32", "bfloat16", "float16"); session_id: the caller's own (32 lowercase
        hex digits from a CSPRNG), else the server draws one. window_left, num_sink_tokens,
        alibi_slopes and softcap: the attention every step computes; evict_outside_window:
        free the pages between the sinks and the window (StreamingLLM). rope_theta (None:
        no RoPE), rotary_dim (0: the head), rope_interleaved: the server rotates each
        step's keys and queries at their positions."""
        from attnserve.session import Session
        if dtype is None:
            raise ValueError("dtype is None, expected float32, bfloat16 or float16")
        request = pb2.CreateSessionRequest(
            num_layers=_integer(num_layers, "num_layers"),
            num_heads=_integer(num_heads, "num_heads"),
            num_kv_heads=_integer(num_kv_heads, "num_kv_heads"),
            key_dim=_integer(key_dim, "key_dim"), value_dim=_integer(value_dim, "value_dim"),
            dtype=wire_dtype(_data_dtype(dtype, "dtype")),
            max_tokens=_integer(max_tokens, "max_tokens"),
            ttl_seconds=_integer(ttl_seconds, "ttl_seconds"),
            session_id="" if session_id is None else _text(session_id, "session_id"))
        if scale is not None:
            request.defaults.scale = _real(scale, "scale")
        if window_left is not None:
            request.defaults.window_left = _integer(window_left, "window_left")
        if num_sink_tokens is not None:
            request.defaults.num_sink_tokens = _integer(num_sink_tokens, "num_sink_tokens")
        if alibi_slopes is not None:
            request.defaults.alibi_slopes.extend(
                float(s) for s in _reals(alibi_slopes, "alibi_slopes"))
        if softcap is not None:
            request.defaults.softcap = _real(softcap, "softcap")
        request.defaults.evict_outside_window = _flag(evict_outside_window,
                                                      "evict_outside_window")
        if rope_theta is not None:
            request.defaults.rope.theta = _real(rope_theta, "rope_theta")
            request.defaults.rope.rotary_dim = _integer(rotary_dim, "rotary_dim")
            request.defaults.rope.interleaved = _flag(rope_interleaved, "rope_interleaved")
        response = self.call("CreateSession", request, timeout,
                             retryable=self._retry.retry_session_creation)
        return Session(self, response.session, response.replica,
                       expected_id=request.session_id)

    def session(self, session_id, timeout=None):
        """A Session for an existing id, with the lengths the server holds."""
        from attnserve.session import Session
        request = pb2.GetSessionRequest(session_id=_text(session_id, "session_id"))
        response = self.call("GetSession", request, timeout)
        return Session(self, response.session, response.replica, expected_id=session_id)

    def get_session(self, session_id, timeout=None):
        """The server's SessionInfo of `session_id`."""
        request = pb2.GetSessionRequest(session_id=_text(session_id, "session_id"))
        return self.call("GetSession", request, timeout).session

    def list_sessions(self, timeout=None):
        """This caller's sessions (SessionInfo messages), by creation time: every page the
        server answers (as many as fit in a message each), all within `timeout`."""
        # Session tokens are "time-id", not ordered: each only differs from the last.
        return self._walk_pages("ListSessions", pb2.ListSessionsRequest, "sessions", timeout,
                                lambda old, new: new != old, 1 << 20)

    def _walk_pages(self, method, request_type, field, timeout, moves_on, most):
        """The `field` entries of every page of the paged `method`, all within one deadline
        `timeout` away. A next token for which moves_on(this page's token, it) is false, or
        more than `most` entries, is a broken server's, not followed further."""
        deadline = time.monotonic() + (self._timeout if timeout is None
                                       else _seconds(timeout, "timeout"))
        found, request = [], request_type()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AttnserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"{method}: the deadline passed before the last page")
            page = self.call(method, request, left)
            entries = getattr(page, field)
            found.extend(entries)
            if not page.next_page_token or not entries:
                return found
            if not moves_on(request.page_token, page.next_page_token) or len(found) > most:
                raise AttnserveError(grpc.StatusCode.INTERNAL,
                                     f"{method}: the server's pages do not end")
            request = request_type(page_token=page.next_page_token)


def _rope(theta, rotary_dim, interleaved):
    """A RotaryEmbedding, or None without `theta` (and then without the rest, which mean
    nothing without it)."""
    if theta is None:
        if rotary_dim or interleaved:
            raise ValueError("rotary_dim and rope_interleaved need rope_theta (the base, "
                             "e.g. 10000)")
        return None
    return pb2.RotaryEmbedding(theta=_real(theta, "rope_theta"),
                               rotary_dim=_integer(rotary_dim, "rotary_dim"),
                               interleaved=_flag(interleaved, "rope_interleaved"))


def _projection_weights(weights, num_heads, num_kv_heads, rope=None):
    if num_heads is None:
        raise ValueError("inline weights need num_heads")
    unknown = set(weights) - {"w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"}
    if unknown:
        raise ValueError(f"unknown weights {sorted(unknown)}: expected w_q, w_k, w_v, w_o "
                         f"and optional b_q, b_k, b_v, b_o")
    message = pb2.ProjectionWeights(num_heads=_integer(num_heads, "num_heads"),
                                    num_kv_heads=_integer(num_kv_heads, "num_kv_heads"))
    for name, array in weights.items():
        getattr(message, name).CopyFrom(to_tensor(array, what=f"weights[{name!r}]"))
    if rope is not None:
        message.rope.CopyFrom(rope)
    return message
