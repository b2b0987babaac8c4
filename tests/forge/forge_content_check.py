#!/usr/bin/env python3
"""Recompute forged tensor bytes from docs/FORGE.md alone and compare with expert-forge's files.

An independent implementation of the content function (version 1), reading the files with
llama.cpp's `gguf` package: if the spec and the C++ drift apart, this fails. For every tensor of
each model it checks the first, second and last block and a sample of others.

Usage: forge_content_check.py --forge BIN --workdir DIR
"""
import argparse
import math
import os
import random
import struct
import subprocess
import sys

import numpy as np
from gguf import GGUFReader

M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


def mix64(x):
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def fnv1a64(name):
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


class BlockRng:
    def __init__(self, key, block):
        self.s = mix64(key + block * G)

    def next(self):
        self.s = (self.s + 0xA0761D6478BD642F) & M64
        t = self.s * (self.s ^ 0xE7037ED1A0B428DB)
        return ((t >> 64) ^ t) & M64

    def words(self, n):
        return b"".join(struct.pack("<Q", self.next()) for _ in range(n))


f32 = np.float32


def f16_bits(x):
    return int(np.array([x], dtype=np.float32).astype(np.float16).view(np.uint16)[0])


def bf16_bits(x):
    u = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def jitter(w):
    return f32(0.75) + f32(w & 0xFFFF) * f32(0.5 / 65536)


def scale(base, w):
    d = f16_bits(f32(base) * jitter(w))
    return d if d != 0 else 1


def value_range(name, ne0):
    if name.endswith("norm.weight"):
        return f32(1.0), f32(1.0 / 16)
    hc = "hc_" in name
    if hc and name.endswith("scale.weight"):
        return f32(1.0), f32(1.0 / 16)
    if hc or name.endswith(("compressor_ape.weight", "attn_sinks.weight", "exp_probs_b.bias")):
        return f32(0.0), f32(1.0 / 128)
    return f32(0.0), f32(math.sqrt(3.0 / max(ne0, 1)))


def hash_row(key, row, k, n):
    """deepseek4's ffn_gate_tid2eid: row `row` is k distinct experts of n."""
    rng = BlockRng(key, row)
    out = []
    while len(out) < k:
        e = ((rng.next() >> 32) * n) >> 32
        if e not in out:
            out.append(e)
    return struct.pack(f"<{k}i", *out)


PLAIN = {"F32": 4, "F16": 2, "BF16": 2}
QUANT = {"Q8_0": 34, "Q4_0": 18, "Q4_K": 144, "Q6_K": 210, "MXFP4": 17}


def block(type_name, key, i, c, a):
    rng = BlockRng(key, i)
    qa = f32(abs(c) + a)
    if type_name in PLAIN:
        out = bytearray()
        words = [rng.next() for _ in range(8)]
        for j in range(32):
            u = (words[j // 4] >> (16 * (j % 4))) & 0xFFFF
            r = f32(2 * u + 1 - 65536) * f32(1.0 / 65536)
            v = f32(c + f32(a * r))
            if type_name == "F32":
                out += struct.pack("<f", v)
            elif type_name == "F16":
                out += struct.pack("<H", f16_bits(v))
            else:
                out += struct.pack("<H", bf16_bits(v))
        return bytes(out)
    w0 = rng.next()
    if type_name == "Q8_0":
        qs = bytes(0x81 if b == 0x80 else b for b in rng.words(4))
        return struct.pack("<H", scale(qa / f32(127), w0)) + qs
    if type_name == "Q4_0":
        qs = bytes(b | (0x08 if (b & 0x0F) == 0 else 0) | (0x80 if (b >> 4) == 0 else 0)
                   for b in rng.words(2))
        return struct.pack("<H", scale(qa / f32(7), w0)) + qs
    if type_name == "Q4_K":
        d = scale(qa / f32(472.5), w0)
        dmin = f16_bits(f32(np.array([d], dtype=np.uint16).view(np.float16)[0]) * f32(8)) or 1
        sc = [32 + ((w0 >> (16 + 5 * j)) & 31) for j in range(8)]
        m = [(s * 15 + 8) >> 4 for s in sc]
        q = [0] * 12
        for j in range(4):
            q[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
            q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6)
            q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4)
        return struct.pack("<HH", d, dmin) + bytes(q) + rng.words(16)
    if type_name == "Q6_K":
        d = scale(qa / f32(127 * 32), w0)
        qlh = rng.words(24)
        scales = bytes(64 + (b & 63) for b in rng.words(2))
        return qlh + scales + struct.pack("<H", d)
    if type_name == "MXFP4":
        v = f32(qa / f32(12)) * jitter(w0)
        e = min(max(((int(np.array([v], dtype=np.float32).view(np.uint32)[0]) >> 23) & 0xFF) + 1,
                    2), 254)
        return bytes([e]) + rng.words(2)
    raise ValueError(type_name)


def check_model(path, seed_expected):
    r = GGUFReader(path)
    seed = int(r.fields["expertd.forge.seed"].contents())
    assert seed == seed_expected, (seed, seed_expected)
    assert int(r.fields["expertd.forge.version"].contents()) == 1
    arch = r.fields["general.architecture"].contents()
    experts = int(r.fields[f"{arch}.expert_count"].contents())
    rnd = random.Random(1)
    blocks_checked = 0
    for t in r.tensors:
        tn = t.tensor_type.name
        raw = bytes(np.asarray(t.data).view(np.uint8).reshape(-1))
        ne0 = int(t.shape[0])
        c, a = value_range(t.name, ne0)
        key = mix64(mix64(seed + G) ^ fnv1a64(t.name))
        if tn == "I32":
            assert t.name.endswith(".ffn_gate_tid2eid.weight"), t.name
            rows = len(raw) // (4 * ne0)
            for i in sorted({0, rows - 1, *(rnd.randrange(rows) for _ in range(12))}):
                if hash_row(key, i, ne0, experts) != raw[i * 4 * ne0:(i + 1) * 4 * ne0]:
                    sys.exit(f"FAIL {path}: {t.name} row {i}: spec and file differ")
                blocks_checked += 1
            continue
        bb = 32 * PLAIN[tn] if tn in PLAIN else QUANT[tn]
        n = (len(raw) + bb - 1) // bb
        for i in sorted({0, 1 % n, n - 1, *(rnd.randrange(n) for _ in range(12))}):
            want = block(tn, key, i, c, a)
            got = raw[i * bb:(i + 1) * bb]
            if want[: len(got)] != got:
                sys.exit(f"FAIL {path}: {t.name} ({tn}) block {i}: spec and file differ")
            blocks_checked += 1
    return len(r.tensors), blocks_checked


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forge", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    small = ["--layers", "2", "--experts", "4", "--embd", "256", "--ff", "256", "--heads", "4",
             "--kv-heads", "2", "--head-dim", "64", "--vocab", "300"]
    cases = [("q8_0", "f16"), ("q4_0", "bf16"), ("q4_k", "f32"), ("q6_k", "q8_0"),
             ("f16", "q4_k"), ("bf16", "q6_k"), ("f32", "q4_0"), ("mxfp4", "mxfp4")]
    for i, (experts, dense) in enumerate(cases):
        out = os.path.join(args.workdir, f"spec{i}.gguf")
        seed = 1000 + i
        subprocess.run([args.forge, *small, "--expert-type", experts, "--dense-type", dense,
                        "--seed", str(seed), "--force", "-o", out], check=True,
                       capture_output=True)
        tensors, blocks = check_model(out, seed)
        print(f"ok: {experts} experts, {dense} dense: {tensors} tensors, {blocks} blocks match "
              "the spec")
        os.remove(out)
    ds4 = ["--arch", "deepseek4", "--layers", "4", "--nextn", "1", "--experts", "8", "--top-k",
           "3", "--embd", "256", "--ff", "256", "--heads", "4", "--head-dim", "128",
           "--q-lora-rank", "64", "--o-lora-rank", "64", "--o-groups", "2", "--index-heads", "4",
           "--index-head-dim", "64", "--rope-dim", "32", "--compress-ratios", "0,4,128,4,0",
           "--vocab", "300"]
    out = os.path.join(args.workdir, "spec_ds4.gguf")
    subprocess.run([args.forge, *ds4, "--expert-type", "q4_k", "--seed", "77", "--force", "-o",
                    out], check=True, capture_output=True)
    tensors, blocks = check_model(out, 77)
    print(f"ok: deepseek4, q4_k experts, q8_0 dense: {tensors} tensors, {blocks} blocks and "
          "hash rows match the spec")
    os.remove(out)
    print("forge content matches docs/FORGE.md")


if __name__ == "__main__":
    main()
