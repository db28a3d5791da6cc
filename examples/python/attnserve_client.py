#!/usr/bin/env python3
"""A Python client for attnserve, with a NumPy reference to check it against.

Uses only Debian 12 packages: python3-grpcio, python3-numpy, python3-protobuf. The stubs
(attnserve/v1/attention_pb2.py, attention_pb2_grpc.py) are generated from
proto/attnserve/v1/attention.proto by protoc with grpc_python_plugin; the build puts them in
build/tests/python/stubs. As a library:

    load_stubs("build/tests/python/stubs")
    stub = connect("localhost:50051")
    out = attend(stub, q, k, v, causal=True, key_lengths=[7, 5]).output

A KV-cache session (the server keeps the keys and values; a decode step sends one token's):

    session = Session.create(stub, num_layers=2, num_heads=8, num_kv_heads=2, key_dim=64)
    session.step(layer, k=prompt_k, v=prompt_v)            # prefill: append only
    out = session.step(layer, k=k_t, v=v_t, q=q_t).output  # decode: append, then attend
    child = session.fork(length=16)
    session.delete()

As a program it runs a few checks against a live server and exits non-zero if any fails:

    python3 attnserve_client.py --target localhost:50051 --stubs build/tests/python/stubs
    python3 attnserve_client.py ... --sessions-only   # just the session decode loop
"""
import argparse
import collections
import os
import sys

import grpc
import numpy as np

pb2 = pb2_grpc = None  # attention_pb2 and attention_pb2_grpc, set by load_stubs()
MAX_MESSAGE_BYTES = 64 << 20  # the server's default --max_message_bytes


def load_stubs(stubs_dir=None):
    """Imports the generated modules from stubs_dir (default: $ATTNSERVE_PY_STUBS)."""
    global pb2, pb2_grpc
    stubs_dir = stubs_dir or os.environ.get("ATTNSERVE_PY_STUBS")
    if stubs_dir:
        sys.path.insert(0, os.path.abspath(stubs_dir))
    from attnserve.v1 import attention_pb2, attention_pb2_grpc
    pb2, pb2_grpc = attention_pb2, attention_pb2_grpc


def connect(target):
    """A stub on an insecure channel that allows messages as large as the server does."""
    channel = grpc.insecure_channel(target, options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    return pb2_grpc.AttentionServiceStub(channel)


# ---- NumPy <-> Tensor -----------------------------------------------------------------------
# NumPy has no bfloat16, so a BFLOAT16 tensor travels as a uint16 array of bit patterns: the
# upper half of each float32. These two helpers convert (rounding to nearest, ties to even).

def float32_to_bfloat16_bits(x):
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(x), 0x7FC0, rounded).astype(np.uint16)  # keep NaN a NaN


def bfloat16_bits_to_float32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# NumPy dtype -> (wire dtype name, little-endian NumPy dtype of the packed bytes).
_WIRE = {np.dtype(np.float32): ("FLOAT32", "<f4"), np.dtype(np.float16): ("FLOAT16", "<f2"),
         np.dtype(np.uint16): ("BFLOAT16", "<u2"), np.dtype(np.bool_): ("BOOL", "u1")}


def to_tensor(array):
    """float32 -> FLOAT32, float16 -> FLOAT16, uint16 -> BFLOAT16 bits, bool -> BOOL."""
    array = np.asarray(array)
    if array.dtype not in _WIRE:
        raise TypeError(f"no wire dtype for {array.dtype}: convert to float32 first")
    name, packed = _WIRE[array.dtype]
    return pb2.Tensor(dtype=name, shape=array.shape,
                      data=np.ascontiguousarray(array, dtype=packed).tobytes())


def from_tensor(tensor):
    """The inverse of to_tensor, except that BFLOAT16 comes back widened to float32."""
    name = pb2.DType.Name(tensor.dtype)
    dtype, packed = next((dtype, packed) for dtype, (wire, packed) in _WIRE.items()
                         if wire == name)
    array = np.frombuffer(tensor.data, dtype=packed).astype(dtype)  # a writable native copy
    array = array.reshape(tuple(tensor.shape))
    if name == "BFLOAT16":
        return bfloat16_bits_to_float32(array)
    return array


# ---- The two calls --------------------------------------------------------------------------
Result = collections.namedtuple("Result", "output weights lse timing response")


def _options(attn_mask=None, **options):
    """AttentionOptions from keyword arguments named as its fields; enums may be strings
    (causal_alignment="BOTTOM_RIGHT", output_dtype="FLOAT16"), attn_mask a NumPy array."""
    message = pb2.AttentionOptions(**options)
    if attn_mask is not None:
        message.attn_mask.CopyFrom(to_tensor(attn_mask))
    return message


def _result(response):
    def optional(field):
        return from_tensor(getattr(response, field)) if response.HasField(field) else None
    return Result(from_tensor(response.output), optional("weights"), optional("lse"),
                  response.timing, response)


def attend(stub, q, k, v, timeout=30, **options):
    """SDPA: q [B, H, Lq, Dk], k [B, Hkv, Lk, Dk], v [B, Hkv, Lk, Dv] -> [B, H, Lq, Dv]."""
    request = pb2.AttendRequest(query=to_tensor(q), key=to_tensor(k), value=to_tensor(v),
                                options=_options(**options))
    return _result(stub.Attend(request, timeout=timeout))


def multi_head_attention(stub, query_input, kv_input=None, weights=None, weights_name=None,
                         timeout=30, **options):
    """nn.MultiheadAttention (batch first): query_input [B, Lq, E], kv_input [B, Lk, Ekv] or
    None for self-attention. weights: a dict with w_q, w_k, w_v, w_o, optional b_q..b_o
    (NumPy arrays, torch Linear layout) and num_heads, num_kv_heads; or a registered name."""
    request = pb2.MultiHeadAttentionRequest(query_input=to_tensor(query_input),
                                            options=_options(**options))
    if kv_input is not None:
        request.kv_input.CopyFrom(to_tensor(kv_input))
    if weights_name is not None:
        request.weights_name = weights_name
    else:
        request.weights.CopyFrom(pb2.ProjectionWeights(**{
            key: value if key.startswith("num_") else to_tensor(value)
            for key, value in weights.items()}))
    return _result(stub.MultiHeadAttention(request, timeout=timeout))


# ---- KV-cache sessions -----------------------------------------------------------------------
StepResult = collections.namedtuple("StepResult", "output lse length")


class Session:
    """A KV-cache session on the server, seen from a decode loop.

    The server holds each layer's keys and values; this object keeps each layer's length and
    sends it as every step's expected_length. The server appends nothing to a layer holding
    another length (FAILED_PRECONDITION), so resending a step whose answer was lost cannot
    append it twice; the C++ library (attnserve/client/session.h) turns that refusal back into
    the step's result, this example only raises it. One writer per session.
    """

    def __init__(self, stub, info):
        self.stub, self.info = stub, info
        self.id = info.session_id
        self.lengths = list(info.lengths) or [0] * info.num_layers

    @classmethod
    def create(cls, stub, num_layers, num_heads, key_dim, num_kv_heads=0, value_dim=0,
               dtype="FLOAT32", max_tokens=0, ttl_seconds=0, timeout=30):
        request = pb2.CreateSessionRequest(
            num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
            key_dim=key_dim, value_dim=value_dim, dtype=dtype, max_tokens=max_tokens,
            ttl_seconds=ttl_seconds)
        return cls(stub, stub.CreateSession(request, timeout=timeout).session)

    def step(self, layer, k=None, v=None, q=None, timeout=30, **options):
        """Appends k [Hkv, T, Dk] and v [Hkv, T, Dv] to `layer` (both or neither), then, with
        q [H, Tq, Dk], attends over the whole cache, causal and bottom-right aligned. options:
        StepOptions fields (scale, precision, return_lse, output_dtype). Raises grpc.RpcError
        for a failed call, RuntimeError carrying the code and message for a failed step."""
        step = pb2.SessionStep(session_id=self.id, layer=layer,
                               expected_length=self.lengths[layer],
                               options=pb2.StepOptions(**options))
        if k is not None:
            step.key.CopyFrom(to_tensor(k))
            step.value.CopyFrom(to_tensor(v))
        if q is not None:
            step.query.CopyFrom(to_tensor(q))
        result = self.stub.Step(pb2.StepRequest(steps=[step]), timeout=timeout).results[0]
        if result.HasField("error") and result.error.code != 0:
            raise RuntimeError(f"step failed with code {result.error.code}: "
                               f"{result.error.message}")
        self.lengths[layer] = result.length
        return StepResult(from_tensor(result.output) if result.HasField("output") else None,
                          from_tensor(result.lse) if result.HasField("lse") else None,
                          result.length)

    def fork(self, length=None, ttl_seconds=0, timeout=30):
        """A new session sharing this one's first `length` tokens of every layer (all if None)."""
        request = pb2.ForkSessionRequest(session_id=self.id, ttl_seconds=ttl_seconds)
        if length is not None:
            request.length = length
        return Session(self.stub, self.stub.ForkSession(request, timeout=timeout).session)

    def truncate(self, length, timeout=30):
        request = pb2.TruncateSessionRequest(session_id=self.id, length=length)
        self.info = self.stub.TruncateSession(request, timeout=timeout).session
        self.lengths = list(self.info.lengths)

    def delete(self, timeout=30):
        self.stub.DeleteSession(pb2.DeleteSessionRequest(session_id=self.id), timeout=timeout)


# ---- NumPy reference, in float64 ------------------------------------------------------------

def reference_sdpa(q, k, v, scale=None, causal=False, causal_alignment="TOP_LEFT",
                   key_lengths=None, attn_mask=None):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    group = H // k.shape[1]  # GQA: query head h reads kv head h // group
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ k.swapaxes(-1, -2)  # [B, H, Lq, Lk]
    lengths = np.full(B, Lk) if key_lengths is None else np.asarray(key_lengths)
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    allowed = np.ones(scores.shape, dtype=bool)
    for b in range(B):
        allowed[b] &= j < lengths[b]
        if causal:  # BOTTOM_RIGHT aligns the last query with the item's last valid key
            shift = lengths[b] - Lq if causal_alignment == "BOTTOM_RIGHT" else 0
            allowed[b] &= j <= i + shift
    if attn_mask is not None and attn_mask.dtype == np.bool_:
        allowed &= attn_mask  # broadcast from the right
    elif attn_mask is not None:
        scores = scores + np.asarray(attn_mask, dtype=np.float64)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(row_max), row_max, 0))
    total = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)  # a row seeing nothing: 0
    return p @ v


def reference_mha(query_input, weights, kv_input=None, **options):
    w = {key: np.asarray(value, dtype=np.float64) for key, value in weights.items()
         if not key.startswith("num_")}
    H = weights["num_heads"]
    Hkv = weights.get("num_kv_heads") or H
    x = np.asarray(query_input, dtype=np.float64)
    kv = x if kv_input is None else np.asarray(kv_input, dtype=np.float64)

    def project(inputs, name, heads):  # y = x Wᵀ + b, then [B, L, heads·D] -> [B, heads, L, D]
        y = inputs @ w["w_" + name].T + w.get("b_" + name, 0.0)
        return y.reshape(y.shape[0], y.shape[1], heads, -1).transpose(0, 2, 1, 3)

    heads = reference_sdpa(project(x, "q", H), project(kv, "k", Hkv), project(kv, "v", Hkv),
                           **options)
    concat = heads.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1)
    return concat @ w["w_o"].T + w.get("b_o", 0.0)


# ---- Checks run by main() -------------------------------------------------------------------

def random_weights(rng, E, Ekv, H, Hkv, Dk, Dv):
    shapes = dict(w_q=(H * Dk, E), w_k=(Hkv * Dk, Ekv), w_v=(Hkv * Dv, Ekv), w_o=(E, H * Dv),
                  b_q=(H * Dk,), b_k=(Hkv * Dk,), b_v=(Hkv * Dv,), b_o=(E,))
    weights = {key: rng.uniform(-0.5, 0.5, shape).astype(np.float32)
               for key, shape in shapes.items()}
    return dict(weights, num_heads=H, num_kv_heads=Hkv)


def run_checks(stub, rng):
    """Yields (name, passed, detail) for each check."""
    def uniform(*shape, dtype=np.float32):
        return rng.uniform(-1, 1, shape).astype(dtype)

    def compare(name, actual, expected, abs_tol, rel_tol=0.0, dtype=np.float32):
        """Every element within abs_tol + rel_tol·|expected| (docs/api.md's tolerances)."""
        err = np.abs(actual.astype(np.float64) - expected)
        ok = (actual.dtype == dtype and actual.shape == expected.shape
              and bool(np.all(err <= abs_tol + rel_tol * np.abs(expected))))
        return name, ok, f"{actual.dtype} {list(actual.shape)} max_abs_err={err.max():.2e}"

    # 1. FLOAT32, GQA (4 query heads on 2 kv heads), BOTTOM_RIGHT causal, padded keys.
    q, k, v = uniform(2, 4, 5, 16), uniform(2, 2, 9, 16), uniform(2, 2, 9, 8)
    options = dict(causal=True, causal_alignment="BOTTOM_RIGHT", key_lengths=[9, 6], scale=0.3)
    yield compare("attend_f32_gqa_causal_key_lengths", attend(stub, q, k, v, **options).output,
                  reference_sdpa(q, k, v, **options), 1e-4)

    # 2. FLOAT16 in, FLOAT16 out, TOP_LEFT causal and a BOOL [Lq, Lk] mask broadcast over B, H.
    q, k, v = uniform(1, 2, 6, 8, dtype=np.float16), uniform(1, 2, 7, 8, dtype=np.float16), \
        uniform(1, 2, 7, 8, dtype=np.float16)
    options = dict(causal=True, attn_mask=rng.uniform(size=(6, 7)) < 0.8)
    yield compare("attend_f16", attend(stub, q, k, v, **options).output,
                  reference_sdpa(q, k, v, **options), 1.1e-4, 1e-5 + 2**-11, np.float16)

    # 3. BFLOAT16 in (as bit patterns), FLOAT32 out, a float mask of shape [H, 1, Lk].
    q, k, v = (float32_to_bfloat16_bits(uniform(2, 3, 4, 8)) for _ in range(3))
    options = dict(attn_mask=uniform(3, 1, 4) * 2)
    out = attend(stub, q, k, v, output_dtype="FLOAT32", **options).output
    widened = [bfloat16_bits_to_float32(x) for x in (q, k, v)]
    yield compare("attend_bf16_float_mask", out, reference_sdpa(*widened, **options), 1e-5, 1e-5)

    # 4. MultiHeadAttention with inline weights: self-attention, then cross-attention.
    weights = random_weights(rng, E=16, Ekv=16, H=4, Hkv=2, Dk=4, Dv=6)
    x = uniform(2, 5, 16)
    out = multi_head_attention(stub, x, weights=weights, causal=True).output
    yield compare("mha_self_inline", out, reference_mha(x, weights, causal=True), 1e-4)
    weights = random_weights(rng, E=16, Ekv=12, H=2, Hkv=2, Dk=8, Dv=8)
    kv = uniform(2, 7, 12)
    out = multi_head_attention(stub, x, kv, weights=weights, key_lengths=[7, 3]).output
    yield compare("mha_cross_inline", out, reference_mha(x, weights, kv, key_lengths=[7, 3]),
                  1e-4)

    # 5. MultiHeadAttention with the server's built-in "demo" weights (E = 64).
    result = multi_head_attention(stub, uniform(2, 5, 64), weights_name="demo")
    ok = result.output.shape == (2, 5, 64) and bool(np.all(np.isfinite(result.output)))
    yield ("mha_demo_weights", ok, f"shape {list(result.output.shape)} "
           f"weights_version={result.response.weights_version}")

    # 6. A malformed request: key's Dk (16) differs from query's (8).
    try:
        attend(stub, uniform(1, 1, 2, 8), uniform(1, 1, 3, 16), uniform(1, 1, 3, 8))
        yield "invalid_argument", False, "the call succeeded"
    except grpc.RpcError as error:
        ok = (error.code() == grpc.StatusCode.INVALID_ARGUMENT
              and "key.shape[3] (Dk)" in error.details())
        yield "invalid_argument", ok, f"{error.code().name}: {error.details()}"


def run_session_checks(stub, rng):
    """A decode loop over a KV-cache session: create, prefill in chunks, decode token by token,
    fork, delete; every output against reference_sdpa over the tokens sent. Yields as
    run_checks."""
    H, Hkv, Dk, Dv, layers = 4, 2, 8, 8, 2

    def uniform(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float32)

    def expected(q, k, v):  # [H, Tq, Dk] over [Hkv, L, D]: bottom-right causal, as a step
        return reference_sdpa(q[None], k[None], v[None], causal=True,
                              causal_alignment="BOTTOM_RIGHT")[0]

    session = Session.create(stub, num_layers=layers, num_heads=H, num_kv_heads=Hkv,
                             key_dim=Dk, value_dim=Dv)
    keys = [np.zeros((Hkv, 0, Dk), np.float32) for _ in range(layers)]
    values = [np.zeros((Hkv, 0, Dv), np.float32) for _ in range(layers)]
    worst = 0.0
    # Prefill 20 tokens in chunks of 8, 8 and 4, the last chunk with its queries (causal).
    for layer in range(layers):
        for chunk in (8, 8, 4):
            k, v = uniform(Hkv, chunk, Dk), uniform(Hkv, chunk, Dv)
            q = uniform(H, chunk, Dk) if chunk == 4 else None
            result = session.step(layer, k=k, v=v, q=q)
            keys[layer] = np.concatenate([keys[layer], k], axis=1)
            values[layer] = np.concatenate([values[layer], v], axis=1)
            if q is not None:
                worst = max(worst, np.abs(result.output - expected(q, keys[layer],
                                                                   values[layer])).max())
    # Decode: one token a step on every layer, with lse.
    ok_lse = True
    for _ in range(5):
        for layer in range(layers):
            k, v, q = uniform(Hkv, 1, Dk), uniform(Hkv, 1, Dv), uniform(H, 1, Dk)
            result = session.step(layer, k=k, v=v, q=q, return_lse=True)
            keys[layer] = np.concatenate([keys[layer], k], axis=1)
            values[layer] = np.concatenate([values[layer], v], axis=1)
            worst = max(worst, np.abs(result.output - expected(q, keys[layer],
                                                               values[layer])).max())
            ok_lse = ok_lse and result.lse is not None and result.lse.shape == (H, 1)
    yield ("session_decode", worst < 1e-4 and ok_lse and session.lengths == [25, 25],
           f"lengths {session.lengths} max_abs_err={worst:.2e}")

    # A fork shares the first 12 tokens; its own token goes only to it.
    child = session.fork(length=12)
    k, v, q = uniform(Hkv, 1, Dk), uniform(Hkv, 1, Dv), uniform(H, 1, Dk)
    out = child.step(0, k=k, v=v, q=q).output
    err = np.abs(out - expected(q, np.concatenate([keys[0][:, :12], k], axis=1),
                                np.concatenate([values[0][:, :12], v], axis=1))).max()
    yield ("session_fork", err < 1e-4 and child.lengths == [13, 12]
           and child.info.forked_from == session.id,
           f"child lengths {child.lengths} max_abs_err={err:.2e}")

    # A step that expects another length is refused and appends nothing.
    session.lengths[0] -= 1
    try:
        session.step(0, k=k, v=v)
        yield "session_expected_length", False, "the stale step succeeded"
    except RuntimeError as error:
        session.lengths[0] += 1
        held = stub.GetSession(pb2.GetSessionRequest(session_id=session.id)).session.lengths
        yield ("session_expected_length", "code 9" in str(error) and list(held) == [25, 25],
               f"{error}; lengths {list(held)}")

    session.delete()
    child.delete()
    try:
        stub.GetSession(pb2.GetSessionRequest(session_id=session.id))
        yield "session_delete", False, "the deleted session is still there"
    except grpc.RpcError as error:
        yield ("session_delete", error.code() == grpc.StatusCode.NOT_FOUND,
               f"{error.code().name}: {error.details()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="attnserve's HOST:PORT")
    parser.add_argument("--stubs", default=os.environ.get("ATTNSERVE_PY_STUBS"),
                        help="folder holding attnserve/v1/attention_pb2*.py")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sessions-only", action="store_true",
                        help="run only the KV-cache session decode loop")
    args = parser.parse_args()
    load_stubs(args.stubs)
    stub = connect(args.target)
    failures = 0
    rng = np.random.default_rng(args.seed)
    checks = [] if args.sessions_only else [run_checks(stub, rng)]
    checks.append(run_session_checks(stub, rng))
    for name, ok, detail in (check for group in checks for check in group):
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        failures += not ok
    print(f"{failures} of the checks failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
