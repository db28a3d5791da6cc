#!/usr/bin/python3
"""Generate the PyTorch reference fixture for attnserve's RoPE and ALiBi.

Each case is computed by an implementation written here in torch, in float64,
the way the model families define it, not the way attnserve computes it:

  llama_rope_gqa       a Llama attention layer: q, k, v projections without
                       bias, RoPE by Hugging Face's rotate_half (GPT-NeoX
                       pairs, cos/sin tables repeated over both halves),
                       grouped-query heads by repeat_interleave, a causal
                       mask, the output projection.
  gptj_rope_positions  GPT-J's RoPE: interleaved pairs over the first 4 of 8
                       features a head (rotate_every_two), at explicit
                       positions per batch item (a cache continuing), not
                       causal.
  bloom_alibi          BLOOM's ALiBi on an Attend: slopes 2^(-8(h+1)/H), the
                       bias slope * j added along the keys (BLOOM's form,
                       which under a causal mask gives the softmax of
                       -slope * (i - j)), causal.

For each case a folder tests/data/torch_variants/<case>/ gets .npy inputs
(float32, little-endian), the expected output.npy (float64 results cast to
float32) and a case.txt of key=value lines.

Rerun from the repository root (needs Debian's python3-torch):

    /usr/bin/python3 tests/data/make_torch_variants_fixture.py
"""

import os
import shutil

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_ROOT = os.path.join(HERE, "torch_variants")


def f32(t):
    return np.ascontiguousarray(t.detach().cpu().numpy().astype("<f4"))


def save(folder, name, arr):
    np.save(os.path.join(folder, name + ".npy"), np.ascontiguousarray(arr))


def write_case(name, tensors, config):
    folder = os.path.join(OUT_ROOT, name)
    os.makedirs(folder)
    for key, value in tensors.items():
        save(folder, key, value)
    with open(os.path.join(folder, "case.txt"), "w") as f:
        for key, value in config.items():
            f.write(f"{key}={value}\n")


def linear(out_features, in_features):
    bound = 1 / np.sqrt(in_features)
    return (torch.rand(out_features, in_features, dtype=torch.float32) * 2 - 1) * bound


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def attention(q, k, v, mask=None, bias=None):
    """q [B, H, Lq, D], k and v [B, H, Lk, D], float64."""
    scores = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def llama_rope_gqa():
    torch.manual_seed(2201)
    B, L, E, H, Hkv, D, theta = 1, 7, 32, 4, 2, 8, 10000.0
    w_q, w_k, w_v, w_o = linear(H * D, E), linear(Hkv * D, E), linear(Hkv * D, E), linear(E, H * D)
    x = torch.rand(B, L, E) * 2 - 1
    x64 = x.double()
    q = (x64 @ w_q.double().T).view(B, L, H, D).transpose(1, 2)
    k = (x64 @ w_k.double().T).view(B, L, Hkv, D).transpose(1, 2)
    v = (x64 @ w_v.double().T).view(B, L, Hkv, D).transpose(1, 2)
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.arange(L, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    context = attention(q, k, v, mask=causal).transpose(1, 2).reshape(B, L, H * D)
    out = context @ w_o.double().T
    write_case("llama_rope_gqa",
               dict(query_input=f32(x), w_q=f32(w_q), w_k=f32(w_k), w_v=f32(w_v),
                    w_o=f32(w_o), output=f32(out)),
               dict(kind="mha", num_heads=H, num_kv_heads=Hkv, rope_theta=theta,
                    rotary_dim=0, interleaved=0, causal=1,
                    description="Llama layer, GQA 4/2, RoPE half-split, causal"))


def gptj_rope_positions():
    torch.manual_seed(2202)
    B, L, E, H, D, R, theta = 2, 5, 16, 2, 8, 4, 10000.0
    w_q, w_k, w_v, w_o = linear(H * D, E), linear(H * D, E), linear(H * D, E), linear(E, H * D)
    x = torch.rand(B, L, E) * 2 - 1
    positions = torch.tensor([[40, 41, 42, 43, 44], [7, 9, 11, 13, 15]], dtype=torch.int64)
    x64 = x.double()
    q = (x64 @ w_q.double().T).view(B, L, H, D).transpose(1, 2)
    k = (x64 @ w_k.double().T).view(B, L, H, D).transpose(1, 2)
    v = (x64 @ w_v.double().T).view(B, L, H, D).transpose(1, 2)
    inv_freq = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    angles = positions.double()[..., None] * inv_freq  # [B, L, R/2]
    cos = angles.cos().repeat_interleave(2, dim=-1)[:, None]  # [B, 1, L, R]
    sin = angles.sin().repeat_interleave(2, dim=-1)[:, None]

    def rope(t):
        rot, rest = t[..., :R], t[..., R:]
        return torch.cat((rot * cos + rotate_every_two(rot) * sin, rest), dim=-1)

    context = attention(rope(q), rope(k), v).transpose(1, 2).reshape(B, L, H * D)
    out = context @ w_o.double().T
    write_case("gptj_rope_positions",
               dict(query_input=f32(x), w_q=f32(w_q), w_k=f32(w_k), w_v=f32(w_v),
                    w_o=f32(w_o), positions=np.ascontiguousarray(positions.numpy().astype("<i8")),
                    output=f32(out)),
               dict(kind="mha", num_heads=H, num_kv_heads=H, rope_theta=theta,
                    rotary_dim=R, interleaved=1, causal=0,
                    description="GPT-J RoPE, interleaved, 4 of 8 features, explicit positions"))


def bloom_alibi():
    torch.manual_seed(2203)
    B, H, L, D = 2, 4, 6, 8
    q, k, v = (torch.rand(B, H, L, D) * 2 - 1 for _ in range(3))
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], dtype=torch.float32)
    bias = slopes.double()[None, :, None, None] * torch.arange(L, dtype=torch.float64)[None, None, None, :]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    out = attention(q.double(), k.double(), v.double(), mask=causal, bias=bias)
    write_case("bloom_alibi",
               dict(query=f32(q), key=f32(k), value=f32(v), alibi_slopes=f32(slopes),
                    output=f32(out)),
               dict(kind="attend", causal=1,
                    description="BLOOM ALiBi (slope * j along the keys), causal"))


def main():
    if os.path.exists(OUT_ROOT):
        shutil.rmtree(OUT_ROOT)
    os.makedirs(OUT_ROOT)
    llama_rope_gqa()
    gptj_rope_positions()
    bloom_alibi()
    print("wrote", sorted(os.listdir(OUT_ROOT)))


if __name__ == "__main__":
    main()
