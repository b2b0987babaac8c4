#!/usr/bin/env python3
"""Runs the committed glm4moe-tiny fixture (llama.cpp's converter's output, arch `glm4moe`, with its
MTP block) in llama.cpp itself (llama-cpp-python 0.3.36, built from the sdist whose vendor/llama.cpp
converted it) and compares its logits and greedy tokens with Hugging Face transformers' (the
fixture's), with llama.cpp's default f16 KV cache and with an f32 one: the same run as
check_deepseek3_llama_cpp.py (one placeholder merge added for llama.cpp's BPE loader; on the q8_0
file llama.cpp quantises activations to 8 bits, so only its greedy tokens are expected to agree).

Needs llama-cpp-python (pip install the sdist) and the vendored gguf-py. Not part of CI. Results are
in tools/reference/README.md.
"""

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import check_deepseek3_llama_cpp  # noqa: E402

if __name__ == "__main__":
    check_deepseek3_llama_cpp.main(HERE.parents[1] / "tests/fixtures/glm4moe-tiny",
                                   "/tmp/glm4moe-llama-check", __doc__)
