#!/usr/bin/env python3
"""The attnserve Python package (`import attnserve`) against a NumPy reference.

Uses only Debian 12 packages: python3-grpcio, python3-numpy, python3-protobuf, and the
attnserve package (python/ in the source tree; `cmake --install build --component python`
installs it, the build assembles it in build/python). As a library:

    import attnserve
    client = attnserve.Client("localhost:50051")
    out = client.attend(q, k, v, causal=True, key_lengths=[7, 5]).output

A KV-cache session (the server keeps the keys and values; a decode step sends one token's):

    session = client.create_session(num_layers=2, num_heads=8, num_kv_heads=2, key_dim=64)
    session.step(layer, key=prompt_k, value=prompt_v)                  # prefill: append only
    out = session.step(layer, key=k_t, value=v_t, query=q_t).output    # decode
    child = session.fork(length=16)
    session.delete()

As a program it runs a few checks against a live server and exits non-zero if any fails:

    python3 attnserve_client.py --target localhost:50051 [--package build/python]
    python3 attnserve_client.py ... --sessions-only   # just the session decode loop
"""
import argparse
import os
import sys

import grpc
import numpy as np

attnserve = None  # the package, imported by main() (--package may say where from)


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
            shift = lengths[b] - Lq if causal_alignment.upper() == "BOTTOM_RIGHT" else 0
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


def reference_mha(query_input, weights, heads, kv_input=None, **options):
    """heads: num_heads and optionally num_kv_heads."""
    w = {key: np.asarray(value, dtype=np.float64) for key, value in weights.items()}
    H = heads["num_heads"]
    Hkv = heads.get("num_kv_heads") or H
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
    return weights, dict(num_heads=H, num_kv_heads=Hkv)


def run_checks(client, rng):
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
    yield compare("attend_f32_gqa_causal_key_lengths", client.attend(q, k, v, **options).output,
                  reference_sdpa(q, k, v, **options), 1e-4)

    # 2. FLOAT16 in, FLOAT16 out, TOP_LEFT causal and a BOOL [Lq, Lk] mask broadcast over B, H.
    q, k, v = uniform(1, 2, 6, 8, dtype=np.float16), uniform(1, 2, 7, 8, dtype=np.float16), \
        uniform(1, 2, 7, 8, dtype=np.float16)
    options = dict(causal=True, attn_mask=rng.uniform(size=(6, 7)) < 0.8)
    yield compare("attend_f16", client.attend(q, k, v, **options).output,
                  reference_sdpa(q, k, v, **options), 1.1e-4, 1e-5 + 2**-11, np.float16)

    # 3. BFLOAT16 in (as bit patterns), FLOAT32 out, a float mask of shape [H, 1, Lk].
    q, k, v = (attnserve.float32_to_bfloat16_bits(uniform(2, 3, 4, 8)) for _ in range(3))
    options = dict(attn_mask=uniform(3, 1, 4) * 2)
    out = client.attend(q, k, v, output_dtype="FLOAT32", **options).output
    widened = [attnserve.bfloat16_bits_to_float32(x) for x in (q, k, v)]
    yield compare("attend_bf16_float_mask", out, reference_sdpa(*widened, **options), 1e-5, 1e-5)

    # 4. MultiHeadAttention with inline weights: self-attention, then cross-attention.
    weights, heads = random_weights(rng, E=16, Ekv=16, H=4, Hkv=2, Dk=4, Dv=6)
    x = uniform(2, 5, 16)
    out = client.mha(x, weights=weights, causal=True, **heads).output
    yield compare("mha_self_inline", out, reference_mha(x, weights, heads, causal=True), 1e-4)
    weights, heads = random_weights(rng, E=16, Ekv=12, H=2, Hkv=2, Dk=8, Dv=8)
    kv = uniform(2, 7, 12)
    out = client.mha(x, kv, weights=weights, key_lengths=[7, 3], **heads).output
    yield compare("mha_cross_inline", out,
                  reference_mha(x, weights, heads, kv, key_lengths=[7, 3]), 1e-4)

    # 5. MultiHeadAttention with the server's built-in "demo" weights (E = 64).
    result = client.mha(uniform(2, 5, 64), weights_name="demo")
    ok = result.output.shape == (2, 5, 64) and bool(np.all(np.isfinite(result.output)))
    yield ("mha_demo_weights", ok, f"shape {list(result.output.shape)} "
           f"weights_version={result.weights_version}")

    # 6. A malformed request: key's Dk (16) differs from query's (8).
    try:
        client.attend(uniform(1, 1, 2, 8), uniform(1, 1, 3, 16), uniform(1, 1, 3, 8))
        yield "invalid_argument", False, "the call succeeded"
    except attnserve.AttnserveError as error:
        ok = (error.code == grpc.StatusCode.INVALID_ARGUMENT
              and "key.shape[3] (Dk)" in error.message)
        yield "invalid_argument", ok, str(error)


def run_session_checks(client, rng):
    """A decode loop over a KV-cache session: create, prefill in chunks, decode token by token,
    fork, delete; every output against reference_sdpa over the tokens sent. Yields as
    run_checks."""
    H, Hkv, Dk, Dv, layers = 4, 2, 8, 8, 2

    def uniform(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float32)

    def expected(q, k, v):  # [H, Tq, Dk] over [Hkv, L, D]: bottom-right causal, as a step
        return reference_sdpa(q[None], k[None], v[None], causal=True,
                              causal_alignment="BOTTOM_RIGHT")[0]

    session = client.create_session(num_layers=layers, num_heads=H, num_kv_heads=Hkv,
                                    key_dim=Dk, value_dim=Dv)
    keys = [np.zeros((Hkv, 0, Dk), np.float32) for _ in range(layers)]
    values = [np.zeros((Hkv, 0, Dv), np.float32) for _ in range(layers)]
    worst = 0.0
    # Prefill 20 tokens in chunks of 8, 8 and 4, the last chunk with its queries (causal).
    for layer in range(layers):
        for chunk in (8, 8, 4):
            k, v = uniform(Hkv, chunk, Dk), uniform(Hkv, chunk, Dv)
            q = uniform(H, chunk, Dk) if chunk == 4 else None
            result = session.step(layer, key=k, value=v, query=q)
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
            result = session.step(layer, key=k, value=v, query=q, return_lse=True)
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
    out = child.step(0, key=k, value=v, query=q).output
    err = np.abs(out - expected(q, np.concatenate([keys[0][:, :12], k], axis=1),
                                np.concatenate([values[0][:, :12], v], axis=1))).max()
    yield ("session_fork", err < 1e-4 and child.lengths == [13, 12]
           and child.info.forked_from == session.id,
           f"child lengths {child.lengths} max_abs_err={err:.2e}")

    # A step that expects another length is refused and appends nothing.
    session.lengths[0] -= 1
    try:
        session.step(0, key=k, value=v)
        yield "session_expected_length", False, "the stale step succeeded"
    except attnserve.AttnserveError as error:
        session.lengths[0] += 1
        held = client.get_session(session.id).lengths
        yield ("session_expected_length",
               error.code == grpc.StatusCode.FAILED_PRECONDITION and list(held) == [25, 25],
               f"{error}; lengths {list(held)}")

    session.delete()
    child.delete()
    try:
        client.get_session(session.id)
        yield "session_delete", False, "the deleted session is still there"
    except attnserve.AttnserveError as error:
        yield "session_delete", error.code == grpc.StatusCode.NOT_FOUND, str(error)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="attnserve's HOST:PORT")
    parser.add_argument("--package", default=os.environ.get("ATTNSERVE_PY_PACKAGE"),
                        help="folder holding the attnserve package (build/python); "
                             "default: the installed one")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sessions-only", action="store_true",
                        help="run only the KV-cache session decode loop")
    args = parser.parse_args()
    global attnserve
    if args.package:
        sys.path.insert(0, os.path.abspath(args.package))
    import attnserve as package
    attnserve = package
    client = attnserve.Client(args.target)
    failures = 0
    rng = np.random.default_rng(args.seed)
    checks = [] if args.sessions_only else [run_checks(client, rng)]
    checks.append(run_session_checks(client, rng))
    for name, ok, detail in (check for group in checks for check in group):
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        failures += not ok
    print(f"{failures} of the checks failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
