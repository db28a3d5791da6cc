#!/usr/bin/python3
"""Generate the PyTorch reference fixture for attnserve's multi-head attention.

Runs torch.nn.MultiheadAttention (batch_first=True) on small deterministic
inputs and writes, for each case, a folder tests/data/torch_mha/<case>/ with
.npy files (little-endian, C order) and a case.txt of key=value lines, in
attnserve's conventions:

  query_input [B, Lq, E], kv_input [B, Lk, Ekv] (only when not self attention),
  w_q [H*Dk, E], w_k [H*Dk, Ekv], w_v [H*Dv, Ekv], w_o [E, H*Dv]
  (torch.nn.Linear layout, y = x W^T + b), b_q, b_k, b_v [H*D], b_o [E]
  (only when has_bias=1), attn_mask [Lq, Lk] bool, True where the query MAY
  attend (opposite of torch's bool attn_mask), key_lengths [B] int64
  (torch key_padding_mask[b, j] = j >= key_lengths[b]), output [B, Lq, E],
  weights [B, Lq, Lk] (head_mean) or [B, H, Lq, Lk] (per_head).

Inputs ~ uniform[-1, 1); projection weights use torch's default init. Torch's
default init sets every bias to zero, which would not exercise bias handling,
so biases (when present) are drawn from uniform[-0.5, 0.5) instead. All saved
float tensors are float32; the expected output/weights are computed in
float64 from exactly those float32 values, then cast to float32.

After writing, every case is reloaded and recomputed independently with
numpy only (float64) and compared against the saved expected values.

Rerun from the repository root (needs Debian's python3-torch and
python3-numpy, i.e. `apt-get install python3-torch python3-numpy`):

    /usr/bin/python3 tests/data/make_torch_mha_fixture.py
"""

import os
import shutil

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_ROOT = os.path.join(HERE, "torch_mha")
TOL = 1e-5

# name, B, Lq, Lk, E, Ekv, H, self_attention, bias, weights mode, extras
CASES = [
    dict(name="self_attention", B=2, Lq=5, Lk=5, E=16, Ekv=16, H=4,
         self_attn=True, bias=True, weights="head_mean",
         description="self attention B=2 L=5 E=16 H=4 with bias, head-averaged weights"),
    dict(name="cross_attention", B=2, Lq=3, Lk=7, E=16, Ekv=12, H=2,
         self_attn=False, bias=True, weights="per_head",
         description="cross attention B=2 Lq=3 Lk=7 E=16 kdim=vdim=12 H=2 with bias, per-head weights"),
    dict(name="key_padding", B=3, Lq=6, Lk=6, E=8, Ekv=8, H=2,
         self_attn=True, bias=True, weights="head_mean",
         key_lengths=[6, 3, 1],
         description="self attention B=3 L=6 E=8 H=2 with bias, key_lengths [6,3,1], head-averaged weights"),
    dict(name="causal_bool_mask", B=1, Lq=7, Lk=7, E=12, Ekv=12, H=3,
         self_attn=True, bias=False, weights="per_head", causal_mask=True,
         description="self attention B=1 L=7 E=12 H=3 no bias, lower-triangular bool attn_mask, per-head weights"),
    dict(name="no_weights", B=1, Lq=9, Lk=9, E=32, Ekv=32, H=8,
         self_attn=True, bias=True, weights="none",
         description="self attention B=1 L=9 E=32 H=8 with bias, need_weights=False"),
]


def f32(t):
    """torch tensor -> contiguous little-endian float32 numpy array."""
    return np.ascontiguousarray(t.detach().cpu().numpy().astype("<f4"))


def save(folder, name, arr):
    np.save(os.path.join(folder, name + ".npy"), np.ascontiguousarray(arr))


def make_case(idx, c):
    folder = os.path.join(OUT_ROOT, c["name"])
    os.makedirs(folder)
    torch.manual_seed(1000 + idx)
    B, Lq, Lk, E, Ekv, H = c["B"], c["Lq"], c["Lk"], c["E"], c["Ekv"], c["H"]
    if c["self_attn"]:
        assert Lq == Lk and E == Ekv

    kdim = None if Ekv == E else Ekv
    mha = torch.nn.MultiheadAttention(E, H, dropout=0.0, bias=c["bias"],
                                      batch_first=True, kdim=kdim, vdim=kdim)
    # Left in training mode on purpose: with dropout=0.0 this is the same
    # maths, and it keeps torch on the reference (non "fast path") code path
    # F.multi_head_attention_forward.

    # Projection weights in nn.Linear layout.
    if mha._qkv_same_embed_dim:
        w = mha.in_proj_weight
        w_q, w_k, w_v = f32(w[0:E]), f32(w[E:2 * E]), f32(w[2 * E:3 * E])
    else:
        w_q, w_k, w_v = (f32(mha.q_proj_weight), f32(mha.k_proj_weight),
                         f32(mha.v_proj_weight))
    w_o = f32(mha.out_proj.weight)
    tensors = dict(w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o)
    if c["bias"]:
        # torch's default init zeroes the biases; use non-zero ones.
        tensors["b_q"] = f32(torch.rand(E) - 0.5)
        tensors["b_k"] = f32(torch.rand(E) - 0.5)
        tensors["b_v"] = f32(torch.rand(E) - 0.5)
        tensors["b_o"] = f32(torch.rand(E) - 0.5)

    q_in = f32(torch.rand(B, Lq, E) * 2 - 1)
    tensors["query_input"] = q_in
    if not c["self_attn"]:
        tensors["kv_input"] = f32(torch.rand(B, Lk, Ekv) * 2 - 1)

    attn_mask_np = None  # attnserve polarity
    if c.get("causal_mask"):
        attn_mask_np = np.tril(np.ones((Lq, Lk), dtype=bool))
        tensors["attn_mask"] = attn_mask_np
    key_lengths = None
    if "key_lengths" in c:
        key_lengths = np.asarray(c["key_lengths"], dtype="<i8")
        tensors["key_lengths"] = key_lengths

    for name, arr in tensors.items():
        save(folder, name, arr)

    # Re-read the saved values and load them into a float64 module.
    loaded = {n: np.load(os.path.join(folder, n + ".npy")) for n in tensors}
    mha = mha.double()
    d = lambda n: torch.from_numpy(loaded[n].astype(np.float64))
    with torch.no_grad():
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight.copy_(torch.cat([d("w_q"), d("w_k"), d("w_v")], 0))
        else:
            mha.q_proj_weight.copy_(d("w_q"))
            mha.k_proj_weight.copy_(d("w_k"))
            mha.v_proj_weight.copy_(d("w_v"))
        mha.out_proj.weight.copy_(d("w_o"))
        if c["bias"]:
            mha.in_proj_bias.copy_(torch.cat([d("b_q"), d("b_k"), d("b_v")], 0))
            mha.out_proj.bias.copy_(d("b_o"))

        q = d("query_input")
        kv = q if c["self_attn"] else d("kv_input")
        kwargs = {}
        if attn_mask_np is not None:
            # torch bool attn_mask: True = NOT allowed.
            kwargs["attn_mask"] = torch.from_numpy(~loaded["attn_mask"])
        if key_lengths is not None:
            kl = torch.from_numpy(loaded["key_lengths"])
            kwargs["key_padding_mask"] = torch.arange(Lk)[None, :] >= kl[:, None]
        need = c["weights"] != "none"
        out, weights = mha(q, kv, kv, need_weights=need,
                           average_attn_weights=(c["weights"] == "head_mean"),
                           **kwargs)

    save(folder, "output", f32(out))
    if need:
        save(folder, "weights", f32(weights))

    lines = [
        ("num_heads", H), ("embed_dim", E), ("kv_embed_dim", Ekv),
        ("batch", B), ("query_len", Lq), ("key_len", Lk),
        ("self_attention", int(c["self_attn"])), ("has_bias", int(c["bias"])),
        ("causal", 0), ("weights", c["weights"]),
        ("description", c["description"]),
    ]
    with open(os.path.join(folder, "case.txt"), "w") as f:
        for k, v in lines:
            f.write("%s=%s\n" % (k, v))


# ---------------------------------------------------------------------------
# Independent numpy-only check (float64), reading only what was written.

def read_case_txt(folder):
    meta = {}
    with open(os.path.join(folder, "case.txt")) as f:
        for line in f:
            k, v = line.rstrip("\n").split("=", 1)
            meta[k] = v
    return meta


def numpy_mha(folder):
    meta = read_case_txt(folder)
    H = int(meta["num_heads"])
    E = int(meta["embed_dim"])
    Ekv = int(meta["kv_embed_dim"])
    B, Lq, Lk = int(meta["batch"]), int(meta["query_len"]), int(meta["key_len"])
    ld = lambda n: np.load(os.path.join(folder, n + ".npy"))
    exists = lambda n: os.path.exists(os.path.join(folder, n + ".npy"))

    x = ld("query_input").astype(np.float64)
    assert x.dtype == np.float64 and ld("query_input").dtype == np.dtype("<f4")
    kv = x if meta["self_attention"] == "1" else ld("kv_input").astype(np.float64)
    assert x.shape == (B, Lq, E) and kv.shape == (B, Lk, Ekv)
    w = {n: ld(n).astype(np.float64) for n in ("w_q", "w_k", "w_v", "w_o")}
    D = E // H
    assert w["w_q"].shape == (H * D, E) and w["w_k"].shape == (H * D, Ekv)
    assert w["w_v"].shape == (H * D, Ekv) and w["w_o"].shape == (E, H * D)
    if meta["has_bias"] == "1":
        b = {n: ld(n).astype(np.float64) for n in ("b_q", "b_k", "b_v", "b_o")}
        for n in ("b_q", "b_k", "b_v"):
            assert b[n].shape == (H * D,)
        assert b["b_o"].shape == (E,)
    else:
        assert not exists("b_q") and not exists("b_o")
        b = {"b_q": 0.0, "b_k": 0.0, "b_v": 0.0, "b_o": 0.0}

    q = x @ w["w_q"].T + b["b_q"]           # [B, Lq, H*D]
    k = kv @ w["w_k"].T + b["b_k"]          # [B, Lk, H*D]
    v = kv @ w["w_v"].T + b["b_v"]
    split = lambda t, L: t.reshape(B, L, H, D).transpose(0, 2, 1, 3)
    q, k, v = split(q, Lq), split(k, Lk), split(v, Lk)  # [B, H, L, D]
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)         # [B, H, Lq, Lk]

    allowed = np.ones((B, Lq, Lk), dtype=bool)
    if exists("attn_mask"):
        m = ld("attn_mask")
        assert m.dtype == np.bool_ and m.shape == (Lq, Lk)
        allowed &= m[None]
    if exists("key_lengths"):
        kl = ld("key_lengths")
        assert kl.dtype == np.dtype("<i8") and kl.shape == (B,)
        allowed &= (np.arange(Lk)[None, :] < kl[:, None])[:, None, :]
    s = np.where(allowed[:, None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)

    o = (p @ v).transpose(0, 2, 1, 3).reshape(B, Lq, H * D)
    out = o @ w["w_o"].T + b["b_o"]
    if meta["weights"] == "head_mean":
        weights = p.mean(axis=1)
    elif meta["weights"] == "per_head":
        weights = p
    else:
        weights = None
    return meta, out, weights


def verify(folder):
    meta, out, weights = numpy_mha(folder)
    saved_out = np.load(os.path.join(folder, "output.npy"))
    assert saved_out.dtype == np.dtype("<f4") and saved_out.flags.c_contiguous
    assert saved_out.shape == out.shape, (saved_out.shape, out.shape)
    d_out = float(np.abs(saved_out.astype(np.float64) - out).max())
    d_w = None
    wpath = os.path.join(folder, "weights.npy")
    if weights is None:
        assert not os.path.exists(wpath)
    else:
        saved_w = np.load(wpath)
        assert saved_w.dtype == np.dtype("<f4")
        assert saved_w.shape == weights.shape, (saved_w.shape, weights.shape)
        d_w = float(np.abs(saved_w.astype(np.float64) - weights).max())
        assert d_w < TOL, (folder, d_w)
    assert d_out < TOL, (folder, d_out)
    return d_out, d_w


def main():
    if os.path.isdir(OUT_ROOT):
        # Keep the hand-written README; regenerate the case folders.
        for c in CASES:
            shutil.rmtree(os.path.join(OUT_ROOT, c["name"]), ignore_errors=True)
    os.makedirs(OUT_ROOT, exist_ok=True)
    for i, c in enumerate(CASES):
        make_case(i, c)
    for c in CASES:
        d_out, d_w = verify(os.path.join(OUT_ROOT, c["name"]))
        print("%-17s max|out diff| = %.3e  max|weights diff| = %s"
              % (c["name"], d_out, "n/a" if d_w is None else "%.3e" % d_w))
    print("torch %s, numpy %s: all cases verified (tol %g)"
          % (torch.__version__, np.__version__, TOL))


if __name__ == "__main__":
    main()
