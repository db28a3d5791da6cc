"""attnserve: a Python client for attnserve, multi-head attention as a gRPC service.

    import attnserve
    with attnserve.Client("localhost:50051") as client:
        out = client.attend(q, k, v, causal=True).output           # NumPy in, NumPy out
        mha = client.mha(x, weights_name="llama-l0").output
        session = client.create_session(num_layers=32, num_heads=32, num_kv_heads=8,
                                        key_dim=128)
        session.step(0, key=prompt_k, value=prompt_v)               # prefill
        step = session.step(0, key=k_t, value=v_t, query=q_t)       # decode one token
        merged = attnserve.sharded_attend([client, other], q, k, v, shards=4)
    replicas = attnserve.Replicas("dns:///attnserve-headless.prod.svc:50051")  # many pods
    session = replicas.create_session(num_layers=32, num_heads=32, key_dim=128)  # pinned

Errors are attnserve.AttnserveError, carrying the gRPC code and the server's message.
bfloat16 travels from float32 values (input_dtype="bfloat16") or uint16 bit patterns, and
comes back widened to float32 (attnserve.tensors).
"""
import os

# gRPC notices that a connection attempt succeeded only when something polls its socket;
# calls that fail fast leave nothing polling between them but gRPC's backup poller, every 5 s
# by default, so a replica restarted at its address stayed unreachable 4-16 s after it
# listened. It polls every 100 ms instead (a poll that finds nothing costs microseconds),
# unless the environment says otherwise; gRPC reads this when it starts, at the process's
# first channel, so it applies when attnserve is imported before any channel is made.
os.environ.setdefault("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100")

# pylint: disable=wrong-import-position
from attnserve.client import (AttendResult, AttnserveError, Client, MhaResult,
                              PutWeightsResult, RetryPolicy, Timing, attention_options)
from attnserve.replicas import (Replicas, ShardedSession, random_session_id,
                                rendezvous_weight)
from attnserve.session import ReplicaGoneError, Session, StepResult
from attnserve.sharded import sharded_attend
from attnserve.tensors import (DtypeError, bfloat16_bits_to_float32,
                               float32_to_bfloat16_bits, from_tensor, to_tensor)

__all__ = ["AttendResult", "AttnserveError", "Client", "DtypeError", "MhaResult",
           "PutWeightsResult", "ReplicaGoneError", "Replicas", "RetryPolicy", "Session",
           "ShardedSession",
           "StepResult", "Timing", "attention_options", "bfloat16_bits_to_float32",
           "float32_to_bfloat16_bits", "from_tensor", "random_session_id",
           "rendezvous_weight", "sharded_attend", "to_tensor"]
