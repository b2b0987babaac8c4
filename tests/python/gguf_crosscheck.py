#!/usr/bin/env python3
"""Cross-checks expertd's GGUF reader against llama.cpp's own `gguf` Python package.

1. A file written by gguf.GGUFWriter (every metadata value type, MoE expert tensors) must read the
   same through `expertctl inspect` as through gguf.GGUFReader: metadata, tensors, expert slices.
2. Models written by expert-forge (single file and split shards, several expert types) must read
   the same through gguf.GGUFReader as through `expertctl inspect`, tensor by tensor, and
   `inspect --json` must equal the slice map derived from GGUFReader's tensor table byte-exactly.

Usage: gguf_crosscheck.py --expertctl BIN --forge BIN --workdir DIR
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as V

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print(f"MISMATCH: {what}", file=sys.stderr)


def inspect(expertctl, path, *flags):
    out = subprocess.run([expertctl, "inspect", *flags, path], check=True, capture_output=True,
                         text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def shard_paths(first):
    """All shard paths of a model given its first shard (or the single file)."""
    r = gguf.GGUFReader(first)
    f = r.get_field("split.count")
    if f is None:
        return [first]
    n = int(f.contents())
    prefix = first[: -len("-00001-of-00000.gguf")]
    return [f"{prefix}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def reader_tensors(paths):
    """(shard, name, type name, shape list, absolute offset, bytes) per tensor, via GGUFReader."""
    rows = []
    for shard, p in enumerate(paths):
        r = gguf.GGUFReader(p)
        for t in r.tensors:
            rows.append({"shard": shard, "name": t.name, "type": t.tensor_type.name.lower(),
                         "shape": [int(x) for x in t.shape], "offset": int(t.data_offset),
                         "bytes": int(t.n_bytes)})
    return rows


def expected_slices(paths):
    """The expert slice map computed from GGUFReader's view, in inspect --json order."""
    tensors = {}
    for row in reader_tensors(paths):
        tensors[row["name"]] = row
    r0 = gguf.GGUFReader(paths[0])
    arch = r0.get_field("general.architecture").contents()
    n_expert = int(r0.get_field(f"{arch}.expert_count").contents())
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.endswith("_exps.weight")})
    out = []
    for layer in layers:
        kinds = ["gate_up", "down"] if f"blk.{layer}.ffn_gate_up_exps.weight" in tensors else [
            "gate", "up", "down"]
        for e in range(n_expert):
            for kind in kinds:
                t = tensors[f"blk.{layer}.ffn_{kind}_exps.weight"]
                stride = t["bytes"] // n_expert
                out.append({"shard": t["shard"], "layer": layer, "expert": e, "kind": kind,
                            "offset": t["offset"] + e * stride, "bytes": stride,
                            "type": t["type"]})
    return out


def value_matches(ours, field):
    theirs = field.contents()
    vtype = field.types[0]
    if vtype == V.ARRAY:
        sub = field.types[-1]
        if len(ours) != len(theirs):
            return False
        if sub in (V.FLOAT32,):
            return all(np.float32(a) == np.float32(b) for a, b in zip(ours, theirs))
        return list(ours) == list(theirs)
    if vtype == V.FLOAT32:
        return np.float32(ours) == np.float32(theirs)
    return ours == theirs


def compare_metadata(expertctl, paths, label):
    ours = inspect(expertctl, paths[0], "--metadata")
    for shard, p in enumerate(paths):
        r = gguf.GGUFReader(p)
        # GGUFReader exposes the header counts as pseudo-fields named GGUF.*.
        fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
        mine = {m["key"]: m for m in ours if m["shard"] == shard}
        check(set(mine) == set(fields),
              f"{label} shard {shard}: key sets differ: {set(mine) ^ set(fields)}")
        for key, f in fields.items():
            if key not in mine:
                continue
            m = mine[key]
            check(m["type"] == f.types[0].name.lower(),
                  f"{label}: {key}: type {m['type']} vs {f.types[0].name.lower()}")
            if f.types[0] == V.ARRAY:
                check(m["elem_type"] == f.types[-1].name.lower(),
                      f"{label}: {key}: element type {m['elem_type']} vs {f.types[-1].name}")
            check(value_matches(m["value"], f), f"{label}: {key}: value {m['value']!r} differs")


def compare_model(expertctl, first, label):
    paths = shard_paths(first)
    compare_metadata(expertctl, paths, label)
    ours = inspect(expertctl, first, "--tensors")
    theirs = reader_tensors(paths)
    check(len(ours) == len(theirs), f"{label}: {len(ours)} tensors vs {len(theirs)}")
    for a, b in zip(ours, theirs):
        check(a == b, f"{label}: tensor {a} vs {b}")
    slices = inspect(expertctl, first, "--json")
    want = expected_slices(paths)
    check(len(slices) == len(want), f"{label}: {len(slices)} slices vs {len(want)}")
    check(slices == want, f"{label}: expert slice map differs from GGUFReader's")
    # The exact key order the format promises.
    if slices:
        check(list(slices[0].keys()) == ["shard", "layer", "expert", "kind", "offset", "bytes",
                                         "type"], f"{label}: key order {list(slices[0].keys())}")
    print(f"ok: {label}: {len(paths)} shard(s), {len(ours)} tensors, {len(slices)} expert slices")


def write_with_gguf_writer(path):
    """A MoE file written by llama.cpp's own writer, with every metadata value type."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("gguf-writer-crosscheck")
    w.add_block_count(2)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.1)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", 1.0 / 3.0)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo, wörld")
    w.add_array("test.arr_i32", [1, -2, 3])
    w.add_array("test.arr_f32", [0.5, -1.25])
    w.add_array("test.arr_str", ["a", "", "ccc"])
    w.add_key_value("test.arr_u8", [1, 2, 255], V.ARRAY, V.UINT8)
    embd, ff, n_exp = 64, 96, 4
    w.add_tensor("token_embd.weight", rng.standard_normal((32, embd)).astype(np.float16))
    for layer in range(2):
        w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                     rng.standard_normal((n_exp, embd)).astype(np.float32))
        for kind, (rows, cols) in (("gate", (ff, embd)), ("up", (ff, embd)),
                                    ("down", (embd, ff))):
            # Q8_0 blocks: f16 scale + 32 int8, laid out as raw bytes [experts, rows, blocks*34].
            nblk = cols // 32
            raw = rng.integers(0, 256, size=(n_exp, rows, nblk * 34), dtype=np.uint8)
            w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", raw, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expertctl", required=True)
    ap.add_argument("--forge", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)

    p = os.path.join(a.workdir, "writer.gguf")
    write_with_gguf_writer(p)
    compare_model(a.expertctl, p, "GGUFWriter file")

    forged = [
        ("single q8_0", ["--expert-type", "q8_0"], 1),
        ("single q4_k, alignment 64", ["--expert-type", "q4_k", "--alignment", "64"], 1),
        ("single q6_k bf16 dense", ["--expert-type", "q6_k", "--dense-type", "bf16"], 1),
        ("single mxfp4, alignment 1", ["--expert-type", "mxfp4", "--alignment", "1"], 1),
        ("single f16", ["--expert-type", "f16", "--dense-type", "f32"], 1),
        ("split 3 q4_k", ["--expert-type", "q4_k", "--layers", "5"], 3),
        ("split 2 f32", ["--expert-type", "f32", "--layers", "3"], 2),
    ]
    for i, (label, flags, split) in enumerate(forged):
        out = os.path.join(a.workdir, f"forged{i}.gguf")
        subprocess.run([a.forge, "-o", out, "--force", "--seed", str(11 + i), "--split",
                        str(split), *flags], check=True, capture_output=True)
        first = out if split == 1 else out[: -len(".gguf")] + f"-00001-of-{split:05d}.gguf"
        compare_model(a.expertctl, first, f"expert-forge {label}")

    # The ggml type table: block sizes and bytes must agree with gguf-py's for every type both
    # know. gguf-py lists Q8_1 as 40 bytes from an old layout; ggml's block_q8_1 is 36.
    table = subprocess.run([a.expertctl, "inspect", "--types"], check=True, capture_output=True,
                           text=True).stdout
    ours = {r["id"]: r for r in map(json.loads, table.splitlines())}
    for t, (blk, size) in gguf.GGML_QUANT_SIZES.items():
        if t == Q.Q8_1:
            continue
        r = ours.get(int(t))
        check(r is not None and r["block_elems"] == blk and r["block_bytes"] == size
              and r["name"] == t.name.lower(),
              f"ggml type {t.name}: ours {r} vs gguf-py ({blk}, {size})")
    print(f"ok: ggml type table agrees on {len(gguf.GGML_QUANT_SIZES) - 1} types")

    if FAILURES:
        print(f"{len(FAILURES)} mismatches", file=sys.stderr)
        return 1
    print("all cross-checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
