#!/usr/bin/python3
"""NumPy reference and file checks for the attnctl tests.

  attnctl_reference.py inputs DIR
      writes q/k/v (float32, float16, bfloat16 as uint16), masks, a weight-set
      folder and MHA inputs into DIR
  attnctl_reference.py attend --query Q --key K --value V [options] --output O
      checks attnctl's .npy outputs against scaled dot-product attention in
      float64 (the options are attnctl's flags, the same values)
  attnctl_reference.py mha --query_input X [--kv_input Y] --weights_dir W --output O
  attnctl_reference.py png FILE --lq N --lk N --cell C [--query Q --key K
      --value V [--causal] [--head H] [--batch_index B]]
      decodes a PNG with zlib, checks its structure and size, and (given the
      inputs) the colour of every cell against the reference weights
  attnctl_reference.py svg FILE --lq N --lk N --cell C

Exits 0 when every check holds; otherwise prints what differs and exits 1.
"""
import argparse
import os
import struct
import sys
import xml.etree.ElementTree as ElementTree
import zlib

import numpy as np


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns, round to nearest even."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def load_values(path, bf16):
    """The values the server sees for the .npy at `path`, as float64."""
    array = np.load(path)
    if array.dtype == np.uint16:
        if not bf16:
            fail(f"{path} is uint16 but --bf16 was not given")
        return from_bf16_bits(array).astype(np.float64)
    if array.dtype == np.float64:
        return array.astype(np.float32).astype(np.float64)
    if array.dtype == np.bool_:
        return array
    return array.astype(np.float64)


def write_inputs(directory):
    rng = np.random.default_rng(20261130)
    q = rng.uniform(-1, 1, (2, 4, 5, 8)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 2, 7, 8)).astype(np.float32)
    v = rng.uniform(-1, 1, (2, 2, 7, 6)).astype(np.float32)
    for name, array in (("q", q), ("k", k), ("v", v)):
        np.save(f"{directory}/{name}32.npy", array)
        np.save(f"{directory}/{name}16.npy", array.astype(np.float16))
        np.save(f"{directory}/{name}bf.npy", to_bf16_bits(array))
        np.save(f"{directory}/{name}64.npy", array.astype(np.float64))
    # A bool mask [Lq, Lk] and a float mask [B, 1, Lq, Lk] (-inf masks).
    np.save(f"{directory}/mask_bool.npy", rng.uniform(0, 1, (5, 7)) < 0.7)
    float_mask = rng.uniform(-2, 2, (2, 1, 5, 7)).astype(np.float32)
    float_mask[0, 0, 1, :3] = -np.inf
    np.save(f"{directory}/mask_float.npy", float_mask)
    # Grid inputs: [B=2, H=3, L=12, D=4], so that heads differ visibly.
    for name, shape in (("gq", (2, 3, 12, 4)), ("gk", (2, 3, 12, 4)),
                        ("gv", (2, 3, 12, 4))):
        np.save(f"{directory}/{name}.npy",
                rng.uniform(-2, 2, shape).astype(np.float32))
    # A weight set: E = 12, Ekv = 10, H = 4, Hkv = 2, Dk = 3, Dv = 5, with
    # float64 and float16 arrays and two of four biases.
    e, ekv, h, hkv, dk, dv = 12, 10, 4, 2, 3, 5
    folder = f"{directory}/wset"
    os.makedirs(folder, exist_ok=True)
    bound = 1 / np.sqrt(e)
    np.save(f"{folder}/w_q.npy", rng.uniform(-bound, bound, (h * dk, e)).astype(np.float32))
    np.save(f"{folder}/w_k.npy", rng.uniform(-bound, bound, (hkv * dk, ekv)))
    np.save(f"{folder}/w_v.npy", rng.uniform(-bound, bound, (hkv * dv, ekv)).astype(np.float16))
    np.save(f"{folder}/w_o.npy", rng.uniform(-bound, bound, (e, h * dv)).astype(np.float32))
    np.save(f"{folder}/b_q.npy", rng.uniform(-bound, bound, (h * dk,)).astype(np.float32))
    np.save(f"{folder}/b_o.npy", rng.uniform(-bound, bound, (e,)).astype(np.float32))
    with open(f"{folder}/config.txt", "w") as config:
        config.write("# cross-attention test set\nnum_heads=4\nnum_kv_heads=2\n")
    np.save(f"{directory}/x.npy", rng.uniform(-1, 1, (2, 3, e)).astype(np.float32))
    np.save(f"{directory}/y.npy", rng.uniform(-1, 1, (2, 6, ekv)).astype(np.float32))


def sdpa(q, k, v, scale=None, causal=False, alignment="top_left",
         key_lengths=None, mask=None, window_left=-1, window_right=-1, sinks=0,
         alibi=None, softcap=None):
    """Output [B,H,Lq,Dv], weights [B,H,Lq,Lk], lse [B,H,Lq] in float64.

    A row that sees no key gets output 0, weights 0 and lse -inf (attnserve's
    rule, docs/api.md). Query i stands at p = i (top_left) or i + L - Lq: it
    sees keys p - window_left ... p + window_right and the first `sinks`; the
    scores are softcapped, then ALiBi subtracts alibi[h] * |p - j|."""
    b, h, lq, dk = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    k = np.repeat(k, h // hkv, axis=1)
    v = np.repeat(v, h // hkv, axis=1)
    if scale is None:
        scale = 1 / np.sqrt(dk)
    scores = scale * np.einsum("bhid,bhjd->bhij", q, k)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    allowed = np.ones(scores.shape, bool)
    lengths = key_lengths if key_lengths else [lk] * b
    j = np.arange(lk)[None, :]
    i = np.arange(lq)[:, None]
    for batch in range(b):
        allowed[batch] &= (j < lengths[batch])[None]
        offset = 0 if alignment == "top_left" else lengths[batch] - lq
        position = i + offset
        if causal:
            allowed[batch] &= (j <= position)[None]
        window = np.ones((lq, lk), bool)
        if window_left >= 0:
            window &= j >= position - window_left
        if window_right >= 0:
            window &= j <= position + window_right
        allowed[batch] &= (window | (j < sinks))[None]
        if alibi is not None:
            scores[batch] -= (np.asarray(alibi, np.float64)[:, None, None]
                              * np.abs(position - j)[None])
    if mask is not None:
        if mask.dtype == np.bool_:
            allowed &= np.broadcast_to(mask, scores.shape)
        else:
            scores = scores + np.broadcast_to(mask, scores.shape)
            allowed &= np.isfinite(scores)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    seen = np.isfinite(row_max)
    exp = np.where(allowed, np.exp(scores - np.where(seen, row_max, 0)), 0)
    total = exp.sum(axis=-1, keepdims=True)
    weights = np.where(seen, exp / np.where(total > 0, total, 1), 0)
    lse = np.where(seen[..., 0], np.log(np.where(total > 0, total, 1))[..., 0]
                   + np.where(seen, row_max, 0)[..., 0], -np.inf)
    return np.einsum("bhij,bhjd->bhid", weights, v), weights, lse


# (abs, rel) bounds of docs/api.md for precision F32, by output dtype.
TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (1.1e-4, 1e-5 + 2**-8),
              "float16": (1.1e-4, 1e-5 + 2**-11)}
NPY_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}


def check_close(name, path, expected, output_dtype, abs_tol=None, rel_tol=None):
    actual = np.load(path)
    if actual.dtype != NPY_DTYPES[output_dtype]:
        fail(f"{path} has dtype {actual.dtype}, expected {output_dtype}")
    if actual.shape != expected.shape:
        fail(f"{path} has shape {actual.shape}, expected {expected.shape}")
    values = from_bf16_bits(actual) if output_dtype == "bfloat16" else actual
    values = values.astype(np.float64)
    default_abs, default_rel = TOLERANCES[output_dtype]
    abs_tol = default_abs if abs_tol is None else abs_tol
    rel_tol = default_rel if rel_tol is None else rel_tol
    both_inf = np.isinf(expected) & (values == expected)
    error = np.abs(values - expected)
    bad = ~both_inf & ~(error <= abs_tol + rel_tol * np.abs(expected))
    if bad.any():
        where = tuple(np.argwhere(bad)[0])
        fail(f"{name} ({path}) differs at {where}: {values[where]} vs "
             f"reference {expected[where]} ({bad.sum()} elements out of bounds)")
    print(f"ok {name} {path} {actual.dtype} {actual.shape}, max error "
          f"{np.max(np.where(both_inf, 0, error)):.3g}")


def check_attend(args):
    q = load_values(args.query, args.bf16)
    k = load_values(args.key, args.bf16)
    v = load_values(args.value, args.bf16)
    mask = load_values(args.mask, args.bf16) if args.mask else None
    lengths = [int(x) for x in args.key_lengths.split(",")] if args.key_lengths else None
    output, weights, lse = sdpa(q, k, v, args.scale, args.causal, args.alignment,
                                lengths, mask)
    check_close("output", args.output, output, args.output_dtype)
    if args.weights:
        expected = weights.mean(axis=1) if args.weights_kind == "head_mean" else weights
        check_close("weights", args.weights, expected, args.output_dtype)
    if args.lse:
        check_close("lse", args.lse, lse, "float32", 1e-4, 1e-5)


def check_mha(args):
    x = load_values(args.query_input, False)
    y = load_values(args.kv_input, False) if args.kv_input else x
    folder = args.weights_dir
    config = dict(line.strip().split("=") for line in open(f"{folder}/config.txt")
                  if "=" in line and not line.startswith("#"))
    h = int(config["num_heads"])
    hkv = int(config.get("num_kv_heads", h))

    def array(name, rows):
        try:
            return load_values(f"{folder}/{name}.npy", False)
        except FileNotFoundError:
            return np.zeros(rows)

    w_q, w_k, w_v, w_o = (load_values(f"{folder}/{n}.npy", False)
                          for n in ("w_q", "w_k", "w_v", "w_o"))
    b_q, b_k, b_v, b_o = (array(n, w.shape[0]) for n, w in
                          (("b_q", w_q), ("b_k", w_k), ("b_v", w_v), ("b_o", w_o)))
    dk, dv = w_q.shape[0] // h, w_v.shape[0] // hkv

    def heads(t, count, dim):  # [B, L, count*dim] -> [B, count, L, dim]
        return t.reshape(t.shape[0], t.shape[1], count, dim).transpose(0, 2, 1, 3)

    output, _, _ = sdpa(heads(x @ w_q.T + b_q, h, dk), heads(y @ w_k.T + b_k, hkv, dk),
                        heads(y @ w_v.T + b_v, hkv, dv))
    merged = output.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], h * dv)
    check_close("mha output", args.output, merged @ w_o.T + b_o, "float32", 2e-5, 1e-4)


# The heatmap layout of client/attnctl/heatmap.h, and its colours.
VIRIDIS = [(68, 1, 84), (71, 45, 123), (59, 82, 139), (44, 114, 142), (33, 145, 140),
           (40, 174, 128), (94, 201, 98), (173, 220, 48), (253, 231, 37)]
INK = (51, 51, 51)


def layout(lq, lk, cell):
    def label_width(index):
        return len(str(index)) * 4 - 1
    left = 2 + label_width(lq - 1) + 2
    top = 2 + 5 + 2
    width = left + lk * cell + 2 + max(0, label_width(lk - 1) - cell)
    height = top + lq * cell + 2 + max(0, 5 - cell)
    return left, top, width, height


def viridis(fraction):
    position = min(max(fraction, 0.0), 1.0) * 8
    segment = min(7, int(position))
    t = position - segment
    return tuple(int(np.floor(a + (b - a) * t + 0.5))
                 for a, b in zip(VIRIDIS[segment], VIRIDIS[segment + 1]))


def decode_png(path):
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail(f"{path}: bad PNG signature {data[:8]!r}")
    chunks, at = [], 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        if zlib.crc32(kind + body) != crc:
            fail(f"{path}: chunk {kind!r} has CRC {crc:#x}, expected "
                 f"{zlib.crc32(kind + body):#x}")
        chunks.append((kind, body))
        at += 12 + length
    kinds = [kind for kind, _ in chunks]
    if kinds[0] != b"IHDR" or kinds[-1] != b"IEND" or b"IDAT" not in kinds:
        fail(f"{path}: chunks {kinds}, expected IHDR, IDAT..., IEND")
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1])
    if (depth, colour, compression, filtering, interlace) != (8, 2, 0, 0, 0):
        fail(f"{path}: IHDR {depth, colour, compression, filtering, interlace}, "
             "expected 8-bit RGB, no interlace")
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    if len(raw) != height * (1 + 3 * width):
        fail(f"{path}: {len(raw)} bytes of image data, expected "
             f"{height} x (1 + 3 x {width}) = {height * (1 + 3 * width)}")
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    if rows[:, 0].any():
        fail(f"{path}: a scanline uses a filter, expected type 0 everywhere")
    return rows[:, 1:].reshape(height, width, 3)


def check_png(args):
    pixels = decode_png(args.file)
    left, top, width, height = layout(args.lq, args.lk, args.cell)
    if pixels.shape[:2] != (height, width):
        fail(f"{args.file} is {pixels.shape[1]}x{pixels.shape[0]}, expected "
             f"{width}x{height} for {args.lq}x{args.lk} cells of {args.cell} px")
    # Row label 0 (a '0' glyph, top row 111) sits left of the first row.
    label_y = top + max(0, (args.cell - 5) // 2)
    if any(tuple(pixels[label_y, left - 5 + dx]) != INK for dx in range(3)):
        fail(f"{args.file}: no '0' label left of row 0")
    if args.query:
        alibi = [float(x) for x in args.alibi.split(",")] if args.alibi else None
        _, weights, _ = sdpa(load_values(args.query, False), load_values(args.key, False),
                             load_values(args.value, False), causal=args.causal,
                             alignment=args.alignment, window_left=args.window_left,
                             window_right=args.window_right, sinks=args.sinks,
                             alibi=alibi, softcap=args.softcap)
        grid = weights[args.batch_index]
        grid = grid.mean(axis=0) if args.head is None else grid[args.head]
        peak = grid.max()
        for row in range(args.lq):
            for column in range(args.lk):
                expected = np.array(viridis(grid[row, column] / peak))
                y, x = top + row * args.cell, left + column * args.cell
                block = pixels[y:y + args.cell, x:x + args.cell].astype(int)
                if np.abs(block - expected).max() > 1:
                    fail(f"{args.file}: cell (query {row}, key {column}) has colour "
                         f"{tuple(block[0, 0])}, expected {tuple(expected)} for "
                         f"weight {grid[row, column]:.6f} of max {peak:.6f}")
    print(f"ok {args.file}: {width}x{height} RGB, CRCs and zlib stream valid")


def check_svg(args):
    root = ElementTree.parse(args.file).getroot()
    left, top, width, height = layout(args.lq, args.lk, args.cell)
    if (root.get("width"), root.get("height")) != (str(width), str(height)):
        fail(f"{args.file}: size {root.get('width')}x{root.get('height')}, "
             f"expected {width}x{height}")
    namespace = "{http://www.w3.org/2000/svg}"
    cells = [r for r in root.iter(namespace + "rect") if r.find(namespace + "title") is not None]
    if len(cells) != args.lq * args.lk:
        fail(f"{args.file}: {len(cells)} cells, expected {args.lq * args.lk}")
    labels = [t.text for t in root.iter(namespace + "text")]
    if labels.count("0") != 2:
        fail(f"{args.file}: labels {labels}, expected a 0 on each axis")
    print(f"ok {args.file}: {width}x{height}, {len(cells)} cells, {len(labels)} labels")


def main():
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("inputs").add_argument("directory")
    attend = commands.add_parser("attend")
    for name in ("query", "key", "value", "output"):
        attend.add_argument(f"--{name}", required=True)
    attend.add_argument("--bf16", action="store_true")
    attend.add_argument("--scale", type=float)
    attend.add_argument("--causal", action="store_true")
    attend.add_argument("--alignment", default="top_left")
    attend.add_argument("--key_lengths")
    attend.add_argument("--mask")
    attend.add_argument("--output_dtype", default="float32", choices=TOLERANCES)
    attend.add_argument("--weights")
    attend.add_argument("--weights_kind", default="per_head")
    attend.add_argument("--lse")
    mha = commands.add_parser("mha")
    for name in ("query_input", "weights_dir", "output"):
        mha.add_argument(f"--{name}", required=True)
    mha.add_argument("--kv_input")
    for kind in ("png", "svg"):
        picture = commands.add_parser(kind)
        picture.add_argument("file")
        for name in ("lq", "lk", "cell"):
            picture.add_argument(f"--{name}", type=int, required=True)
        for name in ("query", "key", "value"):
            picture.add_argument(f"--{name}")
        picture.add_argument("--causal", action="store_true")
        picture.add_argument("--alignment", default="top_left")
        picture.add_argument("--window_left", type=int, default=-1)
        picture.add_argument("--window_right", type=int, default=-1)
        picture.add_argument("--sinks", type=int, default=0)
        picture.add_argument("--alibi")
        picture.add_argument("--softcap", type=float)
        picture.add_argument("--head", type=int)
        picture.add_argument("--batch_index", type=int, default=0)
    args = parser.parse_args()
    {"inputs": lambda a: write_inputs(a.directory), "attend": check_attend,
     "mha": check_mha, "png": check_png, "svg": check_svg}[args.command](args)


if __name__ == "__main__":
    main()
