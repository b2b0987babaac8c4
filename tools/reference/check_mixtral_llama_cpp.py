#!/usr/bin/env python3
"""Runs the committed mixtral-tiny GGUFs (tests/fixtures/mixtral-tiny, made by llama.cpp's own
converter) in llama.cpp itself (llama-cpp-python 0.3.36, built from the sdist whose vendor/llama.cpp
converted them) and compares with Hugging Face transformers: llama.cpp's tokenization of the
fixture's strings, its logits on the fixture's tokens, and its own greedy continuation of the
prompt (token by token from its KV cache).

Needs only numpy and llama-cpp-python (pip install the sdist). Not part of CI. Results are in
tools/reference/README.md.
"""

import argparse
import json
import pathlib

import numpy as np
from llama_cpp import Llama

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "tests/fixtures/mixtral-tiny"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fixture", default=str(FIXTURE))
    args = ap.parse_args()
    fx = pathlib.Path(args.fixture)
    meta = json.loads((fx / "fixture.json").read_text())
    tokens, prompt = meta["tokens"], meta["prompt_tokens"]
    report = {}
    for variant, kv in (("f32", "f16"), ("f32", "f32"), ("q8_0", "f32")):
        expected = np.fromfile(fx / f"logits-{variant}.bin", dtype="<f4").reshape(len(tokens), -1)
        want = tokens if variant == "f32" else meta["greedy_q8_0"]
        kv_type = {"f16": 1, "f32": 0}[kv]  # ggml type ids; llama.cpp's default KV cache is f16
        llm = Llama(model_path=str(fx / f"model-{variant}.gguf"), n_ctx=128, logits_all=True,
                    verbose=False, n_threads=2, type_k=kv_type, type_v=kv_type)
        llm.eval(tokens)
        got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
        err = [float(np.linalg.norm(got[t] - expected[t]) / np.linalg.norm(expected[t]))
               for t in range(len(tokens))]
        llm.reset()
        seq = list(tokens[:prompt])
        llm.eval(seq)
        while len(seq) < len(want):
            seq.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([seq[-1]])
        entry = {"max_rel_err": max(err), "median_rel_err": float(np.median(err)),
                 "greedy": seq[prompt:], "transformers_greedy": want[prompt:],
                 "greedy_identical": seq == want}
        if variant == "f32" and kv == "f32":
            mismatched = []
            for case in meta["tokenized"]:
                ids = llm.tokenize(case["text"].encode(), add_bos=True, special=True)
                if ids != case["ids"]:
                    mismatched.append({"text": case["text"], "llama.cpp": ids, "hf": case["ids"]})
            entry["tokenized_identical"] = len(meta["tokenized"]) - len(mismatched)
            entry["tokenized_mismatches"] = mismatched
        report[f"{variant} experts, {kv} KV cache"] = entry
        del llm
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
