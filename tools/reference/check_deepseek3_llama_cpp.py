#!/usr/bin/env python3
"""Runs the committed deepseek3-tiny fixture (llama.cpp's converter's output, arch `deepseek2`) in
llama.cpp itself (llama-cpp-python 0.3.36, built from the sdist whose vendor/llama.cpp converted
it) and compares its logits and greedy tokens with Hugging Face transformers' (the fixture's).

llama.cpp's BPE loader wants a merges list; the byte vocabulary has none, so one placeholder merge
is added (its result is not a token, so it never applies). Each file runs with llama.cpp's default
f16 KV cache and with an f32 one. The q8_0 file's reference is transformers on the dequantised
weights; llama.cpp quantises activations to 8 bits for its Q8_0 dot products, so only its greedy
tokens are expected to agree there.

Needs llama-cpp-python (pip install the sdist) and the vendored gguf-py. Not part of CI.
"""

import argparse
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = HERE.parents[1] / "tests/fixtures/deepseek3-tiny"


def main(fixture=FIXTURE, work="/tmp/ds3-llama-check", doc=__doc__):
    """Checks `fixture` (a converter-made fixture with model-{f32,q8_0}.gguf, logits-*.bin and
    greedy_q8_0, as deepseek3-tiny and glm4moe-tiny are)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", default=work)
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))
    import make_deepseek4_fixture as make
    from check_deepseek4_llama_cpp import add_merges
    from llama_cpp import Llama

    meta = json.loads((fixture / "fixture.json").read_text())
    tokens, prompt = meta["tokens"], meta["prompt_tokens"]
    report = {}
    for variant, kv in (("f32", "f16"), ("f32", "f32"), ("q8_0", "f16"), ("q8_0", "f32")):
        path = work / f"model-{variant}-llama.gguf"
        if not path.exists():
            add_merges(make, fixture / f"model-{variant}.gguf", path)
        expected = np.fromfile(fixture / f"logits-{variant}.bin", dtype="<f4").reshape(
            len(tokens), -1)
        want = (tokens if variant == "f32" else meta["greedy_q8_0"])[prompt:]
        kv_type = {"f16": 1, "f32": 0}[kv]  # ggml type ids; llama.cpp's default KV cache is f16
        llm = Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                    type_k=kv_type, type_v=kv_type)
        # Greedy from the prompt, as transformers generated: llama.cpp's own continuation.
        llm.eval(tokens[:prompt])
        greedy = []
        for _ in range(len(want)):
            nxt = int(np.argmax(np.array(llm.scores[llm.n_tokens - 1])))
            greedy.append(nxt)
            llm.eval([nxt])
        llm.reset()
        # Logits of the fixture's sequence: both logits files are transformers' on `tokens` (the
        # f32 greedy run), whatever the q8_0 weights' own greedy continuation is.
        seq = tokens
        llm.eval(seq)
        got = np.array(llm.scores[: len(seq)], dtype=np.float32)
        err = [float(np.linalg.norm(got[t] - expected[t]) / np.linalg.norm(expected[t]))
               for t in range(len(seq))]
        report[f"{variant} weights, {kv} KV cache"] = {
            "max_rel_err": max(err), "median_rel_err": float(np.median(err)),
            "greedy": greedy, "transformers_greedy": want, "greedy_identical": greedy == want}
        del llm
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
