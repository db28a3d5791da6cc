"""Exact attention over keys and values split along Lk, across replicas.

Shard s covers keys [s·Lk/n, (s+1)·Lk/n) and goes to clients[s % len(clients)], every shard at
once. Each answers its output o_s and lse_s over its own keys; the merge is exact (in float64):

    lse = log Σ_s exp(lse_s),   o = Σ_s exp(lse_s − lse) · o_s

Every option carries over: key_lengths are cut per shard, a mask along Lk, and causality
becomes a per-shard mask of global key positions. A row that sees no key in any shard gets
output 0 and lse −inf, as from one call. Attention weights cannot be returned (each shard
sees only its keys), nor can the options that depend on each key's position in the whole
sequence: a window (window_left or window_right set and not -1; 0 is a window), sinks, ALiBi
slopes or packed sequences (ValueError).
"""
import concurrent.futures
import time

import grpc
import numpy as np

from attnserve.client import (AttendResult, AttnserveError, Timing, _answered, _integer,
                              _seconds, attention_options)
from attnserve.tensors import bfloat16_bits_to_float32
from attnserve.v1 import attention_pb2 as pb2


def _shard_bounds(length, shards):
    return [(s * length // shards, (s + 1) * length // shards) for s in range(shards)]


def _causal_visible(lq, begin, end, offsets):
    """[B or 1, 1, Lq, end - begin] bool: which of the shard's keys each query row sees,
    query i seeing global key j iff j <= i + offset (offset per batch item: 0 top-left,
    L_b − Lq bottom-right)."""
    rows = np.arange(lq)[:, None]
    keys = np.arange(begin, end)[None, :]
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 1, 1, 1)
    return keys[None, None] <= rows[None, None] + offsets


def sharded_attend(clients, query, key, value, shards, *, causal=False,
                   causal_alignment="top_left", key_lengths=None, attn_mask=None,
                   return_lse=False, return_weights=None, timeout=None, input_dtype=None,
                   **options):
    """attend() of query [B, H, Lq, Dk] over key/value [B, Hkv, Lk, D] in `shards` pieces
    (1 to Lk) on `clients` (attnserve.Client, at least one), merged exactly. Returns an
    AttendResult whose timing is the slowest shard's; raises the first failing shard's
    AttnserveError, ValueError for arguments that cannot be sharded."""
    # Every option checked (ValueError) as one call would check it, before anything is cut.
    checked = attention_options(causal=causal, causal_alignment=causal_alignment,
                                key_lengths=key_lengths, attn_mask=attn_mask,
                                return_lse=return_lse, return_weights=return_weights,
                                **options)
    if checked.return_weights != pb2.AttentionOptions.NONE:
        raise ValueError("return_weights cannot be sharded: each shard sees only its keys")
    # A window of 0 is a window (only -1 or None is unbounded); 0 sinks are none.
    positional = [name for name, given in (
        ("window_left", checked.HasField("window_left") and checked.window_left != -1),
        ("window_right", checked.HasField("window_right") and checked.window_right != -1),
        ("num_sink_tokens", checked.num_sink_tokens != 0),
        ("alibi_slopes", checked.HasField("alibi_slopes")),
        ("cu_seqlens_q", len(checked.cu_seqlens_q) > 0),
        ("cu_seqlens_k", len(checked.cu_seqlens_k) > 0)) if given]
    if positional:
        raise ValueError(f"{', '.join(positional)} cannot be sharded: they depend on each "
                         "key's position in the whole sequence, which a shard does not see")
    if not clients:
        raise ValueError("sharded_attend needs at least one client")
    query, key, value = np.asarray(query), np.asarray(key), np.asarray(value)
    if key.ndim != 4 or query.ndim != 4 or value.ndim != 4:
        raise ValueError(f"query, key and value must be [B, H, L, D], got shapes "
                         f"{list(query.shape)}, {list(key.shape)} and {list(value.shape)}")
    # Key and value are cut along Lk together, and the mask and key_lengths per shard: what
    # one call would refuse must be refused here, not cut to fit (until 2026-12-07 a longer
    # value or mask was cut silently and a key length past Lk, or negative, clipped).
    for d in range(3):
        if value.shape[d] != key.shape[d]:
            raise ValueError(f"value.shape[{d}] is {value.shape[d]}, expected "
                             f"{key.shape[d]} (key.shape[{d}])")
    lq, lk = query.shape[2], key.shape[2]
    full = (query.shape[0], query.shape[1], lq, lk)
    shards = _integer(shards, "shards")
    if not 1 <= shards <= lk:
        raise ValueError(f"shards is {shards}, expected 1 to Lk = {lk}")
    causal = checked.causal
    bottom_right = checked.causal_alignment == pb2.AttentionOptions.BOTTOM_RIGHT
    key_lengths = None if key_lengths is None else list(checked.key_lengths)
    if key_lengths is not None:
        if len(key_lengths) != full[0]:
            raise ValueError(f"key_lengths holds {len(key_lengths)} lengths, expected B = "
                             f"{full[0]}")
        for b, length in enumerate(key_lengths):
            if not 0 <= length <= lk:
                raise ValueError(f"key_lengths[{b}] is {length}, expected 0 to {lk} (Lk)")
    mask = None if attn_mask is None else np.asarray(attn_mask)
    if mask is not None:
        if (not 1 <= mask.ndim <= 4
                or any(dim not in (1, whole) for dim, whole in
                       zip(mask.shape, full[4 - mask.ndim:]))):
            raise ValueError(f"attn_mask's shape is {list(mask.shape)}, expected rank 1 to "
                             f"4, each dimension 1 or [B, H, Lq, Lk] = {list(full)} (aligned "
                             f"right)")
        if mask.dtype == np.uint16:  # bfloat16 bits: their values, to combine with causality
            mask = bfloat16_bits_to_float32(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # rank 4, broadcastable

    requests = []
    for begin, end in _shard_bounds(lk, shards):
        shard_mask = None if mask is None else (
            mask[..., begin:end] if mask.shape[-1] != 1 else mask)
        if causal:
            if bottom_right:
                lengths = key_lengths if key_lengths is not None else [lk]
                offsets = np.asarray(lengths, dtype=np.int64) - lq
            else:
                offsets = [0]
            visible = _causal_visible(lq, begin, end, offsets)
            if shard_mask is None:
                shard_mask = visible
            elif shard_mask.dtype == np.bool_:
                shard_mask = np.logical_and(shard_mask, visible)
            else:
                shard_mask = np.where(visible, shard_mask.astype(np.float32),
                                      np.float32(-np.inf))
        shard_lengths = None if key_lengths is None else [
            int(np.clip(length - begin, 0, end - begin)) for length in key_lengths]
        requests.append(clients[0].attend_request(
            query, key[:, :, begin:end], value[:, :, begin:end], input_dtype=input_dtype,
            key_lengths=shard_lengths, attn_mask=shard_mask, return_lse=True,
            **options))

    # Four calls in flight a client at most (shards may number up to Lk), all within one
    # deadline; the first error raises, and the shards not yet sent are dropped.
    deadline = time.monotonic() + (clients[0]._timeout if timeout is None
                                   else _seconds(timeout, "timeout"))

    def attend(s, request):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AttnserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"Attend: the deadline passed before shard {s} was sent")
        return clients[s % len(clients)].call("Attend", request, left)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(shards, 4 * len(clients)))
    try:
        futures = [pool.submit(attend, s, request) for s, request in enumerate(requests)]
        responses = [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

    parts = [_answered(r, "output") for r in responses]
    lse_parts = [_answered(r, "lse") for r in responses]
    if (any(p.shape != parts[0].shape for p in parts)
            or any(p.shape != parts[0].shape[:-1] for p in lse_parts)):
        raise AttnserveError(grpc.StatusCode.INTERNAL,
                             f"the shards answered outputs of shapes "
                             f"{[list(p.shape) for p in parts]} and lse of shapes "
                             f"{[list(p.shape) for p in lse_parts]}, expected one [..., Dv] "
                             f"and its [...]")
    outputs = np.stack([p.astype(np.float64) for p in parts])
    lses = np.stack([p.astype(np.float64) for p in lse_parts])
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.logaddexp.reduce(lses, axis=0)
        shares = np.where(np.isneginf(lses), 0.0, np.exp(lses - lse[None]))
    output = np.einsum("s...,s...d->...d", shares, outputs)
    output = np.where(np.isneginf(lse)[..., None], 0.0, output)
    timing = Timing(max(r.timing.queue_us for r in responses),
                    max(r.timing.compute_us for r in responses),
                    max(r.timing.server_us for r in responses))
    out_dtype = parts[0].dtype
    return AttendResult(output.astype(out_dtype),
                        lse.astype(np.float32) if checked.return_lse else None, None, timing)
