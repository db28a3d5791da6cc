"""attnserve.Session: a KV-cache session held by the server, from a decode loop's side."""
import collections

import grpc

from attnserve.client import _PRECISIONS, AttnserveError, _choice, _optional, _timing
from attnserve.tensors import to_tensor, wire_dtype
from attnserve.v1 import attention_pb2 as pb2

# A step's output [H, Tq, Dv] (None without a query), lse [H, Tq] (with return_lse), the
# layer's length after it, whether the output was recomputed after a lost answer, and the
# server's Timing of the call.
StepResult = collections.namedtuple("StepResult", "output lse length recovered timing")

_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]


def _code(number):
    return next(code for code in grpc.StatusCode if code.value[0] == number)


def _step_options(scale=None, precision=None, return_lse=False, output_dtype=None):
    options = pb2.StepOptions(return_lse=return_lse,
                              precision=_choice(_PRECISIONS, precision, "precision"))
    if scale is not None:
        options.scale = scale
    if output_dtype is not None:
        options.output_dtype = pb2.DType.Value(wire_dtype(output_dtype))
    return options


class Session:
    """A session's layers, each with the length this object believes it holds.

    Every step sends that length as its expected_length, and the server appends nothing to a
    layer that holds another (FAILED_PRECONDITION), so a retried step cannot append twice:
    steps are retried like any idempotent call. When a step may have landed before (it was
    sent more than once, or the last call on that layer failed without an answer) and is
    refused, the session asks the server for the layer's length: E + T (T the step's tokens)
    means it had landed, so the length is recorded and, if the step had a query, the query is
    sent again alone over the same E + T tokens, which gives the lost output
    (StepResult.recovered). Any other length means another writer: AttnserveError
    FAILED_PRECONDITION naming both (sync() takes the server's lengths). One writer per
    session.
    """

    def __init__(self, client, info):
        self._client = client
        self.info = info
        self.id = info.session_id
        self.lengths = list(info.lengths) or [0] * info.num_layers
        self._uncertain = [False] * len(self.lengths)

    def step(self, layer, key=None, value=None, query=None, *, input_dtype=None,
             timeout=None, **options):
        """Appends key [Hkv, T, Dk] and value [Hkv, T, Dv] to `layer` (both or neither), then,
        with query [H, Tq, Dk], attends over the layer's whole cache, causal and aligned
        bottom-right (query row i sees keys j <= i + L - Tq). options: scale, precision
        ("f32", "bf16"), return_lse, output_dtype. Returns a StepResult; raises
        AttnserveError."""
        if (key is None) != (value is None):
            raise ValueError("give key and value together, or neither")
        expected = self.lengths[layer]
        step = pb2.SessionStep(session_id=self.id, layer=layer, expected_length=expected,
                               options=_step_options(**options))
        tokens = 0
        if key is not None:
            step.key.CopyFrom(to_tensor(key, input_dtype))
            step.value.CopyFrom(to_tensor(value, input_dtype))
            tokens = int(step.key.shape[1]) if len(step.key.shape) == 3 else 0
        if query is not None:
            step.query.CopyFrom(to_tensor(query, input_dtype))
        try:
            response, attempts = self._client.call_counting(
                "Step", pb2.StepRequest(steps=[step]), timeout)
        except AttnserveError:
            self._uncertain[layer] = True
            raise
        result = response.results[0]
        if result.HasField("error") and result.error.code != 0:
            error = AttnserveError(_code(result.error.code), result.error.message)
            if (result.error.code == _FAILED_PRECONDITION
                    and (attempts > 1 or self._uncertain[layer])):
                return self._recover(layer, step, tokens, error, timeout)
            raise error
        self._uncertain[layer] = False
        self.lengths[layer] = result.length
        return StepResult(_optional(result, "output"), _optional(result, "lse"),
                          result.length, False, _timing(response))

    def _recover(self, layer, step, tokens, refusal, timeout):
        expected = step.expected_length
        held = self._client.get_session(self.id, timeout).lengths[layer]
        if held == expected:
            self._uncertain[layer] = False
            raise refusal
        if held != expected + tokens:
            raise AttnserveError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"layer {layer} of session {self.id} holds {held} tokens, expected "
                f"{expected} before this step or {expected + tokens} after it: another "
                f"writer changed the session (sync() takes the server's lengths)")
        self.lengths[layer] = held
        self._uncertain[layer] = False
        if not step.HasField("query"):
            return StepResult(None, None, held, True, None)
        again = pb2.SessionStep(session_id=self.id, layer=layer, expected_length=held,
                                options=step.options)
        again.query.CopyFrom(step.query)
        response = self._client.call("Step", pb2.StepRequest(steps=[again]), timeout)
        result = response.results[0]
        if result.HasField("error") and result.error.code != 0:
            raise AttnserveError(_code(result.error.code), result.error.message)
        return StepResult(_optional(result, "output"), _optional(result, "lse"),
                          result.length, True, _timing(response))

    def fork(self, length=None, ttl_seconds=0, timeout=None):
        """A new session sharing this one's first `length` tokens of every layer (all when
        None); retried only with RetryPolicy.retry_session_creation."""
        request = pb2.ForkSessionRequest(session_id=self.id, ttl_seconds=ttl_seconds)
        if length is not None:
            request.length = length
        response = self._client.call(
            "ForkSession", request, timeout,
            retryable=self._client._retry.retry_session_creation)
        return Session(self._client, response.session)

    def truncate(self, length, timeout=None):
        """Keeps every layer's first `length` tokens."""
        request = pb2.TruncateSessionRequest(session_id=self.id, length=length)
        self._adopt(self._client.call("TruncateSession", request, timeout).session)

    def sync(self, timeout=None):
        """Takes the server's lengths (after a step given up, or another writer)."""
        self._adopt(self._client.get_session(self.id, timeout))

    def delete(self, timeout=None):
        """Deletes the session; NOT_FOUND after a retried call counts as done."""
        request = pb2.DeleteSessionRequest(session_id=self.id)
        try:
            self._client.call_counting("DeleteSession", request, timeout)
        except AttnserveError as error:
            if error.code != grpc.StatusCode.NOT_FOUND or error.attempts < 2:
                raise

    def _adopt(self, info):
        self.info = info
        self.lengths = list(info.lengths)
        self._uncertain = [False] * len(self.lengths)
