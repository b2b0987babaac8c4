#!/usr/bin/env python3
"""Loads a deepseek4 GGUF made by llama.cpp's converter in llama.cpp itself (llama-cpp-python
0.3.36, built from the sdist whose vendor/llama.cpp made the file) and compares its logits and
greedy tokens with Hugging Face transformers'.

llama.cpp loads compress ratios 0, 4 and 128 only, so the committed fixture (HCA ratio 8) cannot
be loaded; this script makes the same model with HCA ratio 128 (make_deepseek4_fixture.py
--hca-rate 128: with 47 tokens its HCA layers never emit an entry, so they act as sliding-window
layers; CSA selection and everything else is exercised as in the fixture). llama.cpp's BPE loader
also wants a merges list: the byte vocabulary has none, so one placeholder merge is added (its
result is not a token, so it never applies).

Each file runs with llama.cpp's default f16 KV cache and with an f32 one. Measured (2026-12-01,
llama-cpp-python 0.3.36 CPU): greedy tokens identical to transformers' in all four runs; f32
weights: logits within 2.7e-3 relative with the f16 cache and 5.0e-6 with the f32 one (so
llama.cpp's DeepSeek-V4 graph agrees with transformers, and with expertd's engines, up to its KV
cache precision); mxfp4 weights: 0.75 / 0.56 (median 3.4e-2 / 2.8e-2), llama.cpp quantising the
activations to 8 bits for its MXFP4 dot products (expertd's engines compute with float
activations and match transformers to 2.4e-6 on the same file).

Needs torch, transformers and llama-cpp-python (pip install the sdist). Not part of CI.
"""

import argparse
import json
import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent


def add_merges(make, src, dst):
    gguf = make.gguf_module()

    def same(name, ttype, a):
        return a, (None if ttype == gguf.GGMLQuantizationType.F32 else ttype)

    r = gguf.GGUFReader(str(src))
    if "tokenizer.ggml.merges" in r.fields:
        dst.write_bytes(src.read_bytes())
        return
    make.rewrite_gguf(gguf, src, dst, same, extra={"tokenizer.ggml.merges": ["Ġ Ġ"]})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", default="/tmp/ds4-llama-check")
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(HERE / "make_deepseek4_fixture.py"), "--hca-rate", "128",
                    "--out", str(work)], check=True, stdout=subprocess.DEVNULL)
    sys.path.insert(0, str(HERE))
    import make_deepseek4_fixture as make
    from llama_cpp import Llama

    meta = json.loads((work / "fixture.json").read_text())
    tokens, prompt = meta["tokens"], meta["prompt_tokens"]
    expected = np.fromfile(work / "logits-f32.bin", dtype="<f4").reshape(len(tokens), -1)
    report = {}
    for variant, kv in (("f32", "f16"), ("f32", "f32"), ("mxfp4", "f16"), ("mxfp4", "f32")):
        path = work / f"model-{variant}-llama.gguf"
        if not path.exists():
            add_merges(make, work / f"model-{variant}.gguf", path)
        kv_type = {"f16": 1, "f32": 0}[kv]  # ggml type ids; llama.cpp's default KV cache is f16
        llm = Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                    type_k=kv_type, type_v=kv_type)
        llm.eval(tokens)
        got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
        err = [float(np.linalg.norm(got[t] - expected[t]) / np.linalg.norm(expected[t]))
               for t in range(len(tokens))]
        greedy = [int(np.argmax(got[t])) for t in range(prompt - 1, len(tokens) - 1)]
        want = tokens[prompt:]
        report[f"{variant} weights, {kv} KV cache"] = {
                           "max_rel_err": max(err), "median_rel_err": float(np.median(err)),
                           "greedy": greedy, "transformers_greedy": want,
                           "greedy_identical": greedy == want}
        del llm
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
