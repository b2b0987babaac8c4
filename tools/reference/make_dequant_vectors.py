#!/usr/bin/env python3
"""Writes the dequantisation test vectors: for each ggml type the engine reads, a few blocks of
quantised bytes (TYPE.raw) and what llama.cpp's own `gguf` package dequantises them to (TYPE.f32,
raw little-endian float32), with vectors.json describing them. Needs only gguf and numpy.

Types gguf-py can quantise (f16, bf16, q8_0) start from random floats; the k-quants (q4_k, q6_k),
which it can only dequantise, start from random bytes with every f16 scale set to a finite value,
so every bit pattern of the packed scales and quants is exercised. mxfp4 has both: blocks gguf-py
quantises from random floats of many magnitudes, and random blocks whose e8m0 exponents include
the extremes (0 and 1, which ggml maps to subnormal scales, 127, 128, 254, and 255, which ggml
maps to 2^127 rather than NaN, so large quants overflow to infinity).
"""

import argparse
import hashlib
import importlib.metadata
import json
import pathlib
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T

SEED = 7


def f16_bytes(values):
    return np.asarray(values, dtype="<f2").view(np.uint8)


def make(rng):
    out = {}
    # f32 and f16: random values plus the edge cases (signed zero, f16 subnormals, the largest f16,
    # infinities) a converter gets wrong first.
    edges = [0.0, -0.0, 6.0e-8, -6.0e-8, 3.0e-5, 65504.0, -65504.0, np.inf, -np.inf, 1.0, -2.5]
    vals = np.concatenate([edges, rng.standard_normal(256 - len(edges)) * 3]).astype(np.float32)
    out["f32"] = vals.view(np.uint8)
    out["f16"] = f16_bytes(vals)
    out["bf16"] = gguf.quants.quantize(
        np.concatenate([vals[:11], (rng.standard_normal(245) * 1e3).astype(np.float32)]), T.BF16)
    out["q8_0"] = gguf.quants.quantize((rng.standard_normal(8 * 32) * 0.5).astype(np.float32),
                                       T.Q8_0)

    def kquant(qtype, scale_at, blocks=4):
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
        for at in scale_at:  # finite f16 scales of both signs and several magnitudes
            d = rng.uniform(0.001, 0.1, blocks) * rng.choice([-1.0, 1.0], blocks)
            raw[:, at:at + 2] = f16_bytes(d).reshape(blocks, 2)
        return raw.reshape(-1)

    out["q4_k"] = kquant(T.Q4_K, (0, 2))
    out["q6_k"] = kquant(T.Q6_K, (208,))

    # mxfp4: 8 blocks quantised by gguf-py (magnitudes from 2^-130 to 2^100), then 16 random
    # blocks with chosen exponents; the first random block has every nibble 0..15 in order.
    mags = np.exp2(rng.integers(-130, 101, size=(8, 1))).astype(np.float32)
    quantised = gguf.quants.quantize(
        (rng.standard_normal((8, 32)) * mags).astype(np.float32).reshape(-1), T.MXFP4)
    raw = rng.integers(0, 256, size=(16, 17), dtype=np.uint8)
    raw[:, 0] = [0, 1, 2, 127, 128, 254, 255, 126, 100, 150, 3, 253, 120, 135, 64, 200]
    raw[0, 1:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    out["mxfp4"] = np.concatenate([np.asarray(quantised, dtype=np.uint8).reshape(-1),
                                   raw.reshape(-1)])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[2] /
                                         "tests/fixtures/dequant"))
    ap.add_argument("--check", action="store_true",
                    help="write nothing; fail unless the files in --out are what this would write")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    files = {}
    rng = np.random.default_rng(SEED)
    manifest = {"generator": "tools/reference/make_dequant_vectors.py", "seed": SEED,
                "gguf": importlib.metadata.version("gguf"), "numpy": np.__version__, "types": {}}
    for name, raw in make(rng).items():
        qtype = T[name.upper()]
        with np.errstate(over="ignore"):  # mxfp4's e = 255 overflows to infinity, as in ggml
            expected = gguf.quants.dequantize(np.asarray(raw, dtype=np.uint8), qtype)
        expected = np.asarray(expected, dtype="<f4").reshape(-1)
        files[f"{name}.raw"] = raw.tobytes()
        files[f"{name}.f32"] = expected.tobytes()
        manifest["types"][name] = {
            "raw": f"{name}.raw", "expected": f"{name}.f32", "elements": int(expected.size),
            "raw_bytes": int(raw.size),
            "sha256": hashlib.sha256(raw.tobytes() + expected.tobytes()).hexdigest()}
    files["vectors.json"] = (json.dumps(manifest, indent=2) + "\n").encode()
    if args.check:  # the versions in the manifest may differ; the vectors may not
        stale = [n for n, b in files.items() if n != "vectors.json" and
                 (not (out / n).exists() or (out / n).read_bytes() != b)]
        if stale:
            sys.exit(f"{out}: differs from what gguf {manifest['gguf']} computes: {stale}")
        print(f"{out}: {len(files) - 1} files match gguf {manifest['gguf']}")
        return
    out.mkdir(parents=True, exist_ok=True)
    for n, b in files.items():
        (out / n).write_bytes(b)


if __name__ == "__main__":
    main()
