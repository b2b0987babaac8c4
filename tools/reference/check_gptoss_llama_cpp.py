#!/usr/bin/env python3
"""Runs the committed gptoss-tiny GGUFs (tests/fixtures/gptoss-tiny, made by llama.cpp's own
converter) in llama.cpp itself (llama-cpp-python 0.3.36, built from the sdist whose vendor/llama.cpp
converted them) and compares with Hugging Face transformers: its logits on the fixture's tokens and
its own greedy continuation of the prompt (token by token from its KV cache).

llama.cpp's BPE loader wants a merges list: the byte vocabulary has none, so one placeholder merge
is added to a copy (its result is not a token, so it never applies), as check_deepseek4_llama_cpp.py
does.

Needs numpy, llama.cpp's gguf-py (LLAMA_CPP) and llama-cpp-python (pip install the sdist). Not part of CI. Results are in
tools/reference/README.md.
"""

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np
from llama_cpp import Llama

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = HERE.parents[1] / "tests/fixtures/gptoss-tiny"


def truncated_reference(meta, tokens, prompt):
    """transformers' logits on the fixture's tokens, and its greedy continuation, with YaRN's
    correction range rounded outwards (what llama.cpp computes for every model)."""
    import torch
    import make_gptoss_fixture as make
    make.ROPE["truncate"] = True
    sd, _ = make.random_weights(meta["seed"])
    model = make.make_model(sd)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].numpy()
    return logits, make.greedy(model, tokens[:prompt], len(tokens) - prompt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--fixture", default=str(FIXTURE))
    ap.add_argument("--truncated-yarn", action="store_true",
                    help="also compare with transformers run with YaRN truncate: true (llama.cpp "
                         "always rounds the correction range; needs torch and transformers)")
    args = ap.parse_args()
    fx = pathlib.Path(args.fixture)
    meta = json.loads((fx / "fixture.json").read_text())
    tokens, prompt = meta["tokens"], meta["prompt_tokens"]
    expected = np.fromfile(fx / "logits.bin", dtype="<f4").reshape(len(tokens), -1)
    references = {"transformers": (expected, tokens)}
    if args.truncated_yarn:
        references["transformers, truncate: true"] = truncated_reference(meta, tokens, prompt)
    sys.path.insert(0, str(HERE))
    import make_deepseek4_fixture as make
    from check_deepseek4_llama_cpp import add_merges
    work = pathlib.Path(tempfile.mkdtemp())
    report = {}
    for variant, kv in (("f32", "f32"), ("mxfp4", "f32"), ("mxfp4", "f16")):
        kv_type = {"f16": 1, "f32": 0}[kv]  # ggml type ids; llama.cpp's default KV cache is f16
        path = work / f"model-{variant}.gguf"
        if not path.exists():
            add_merges(make, fx / f"model-{variant}.gguf", path)
        llm = Llama(model_path=str(path), n_ctx=128, logits_all=True,
                    verbose=False, n_threads=2, type_k=kv_type, type_v=kv_type)
        llm.eval(tokens)
        got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
        llm.reset()
        seq = list(tokens[:prompt])
        llm.eval(seq)
        while len(seq) < len(tokens):
            seq.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([seq[-1]])
        for ref, (want_logits, want) in references.items():
            err = [float(np.linalg.norm(got[t] - want_logits[t]) / np.linalg.norm(want_logits[t]))
                   for t in range(len(tokens))]
            report[f"{variant} experts, {kv} KV cache vs {ref}"] = {
                "max_rel_err": max(err), "median_rel_err": float(np.median(err)),
                "greedy": seq[prompt:], "reference_greedy": want[prompt:],
                "greedy_identical": seq == want}
        del llm
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
