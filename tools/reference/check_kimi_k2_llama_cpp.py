#!/usr/bin/env python3
"""Runs the committed kimi-k2-tiny fixture (llama.cpp's converter's output, arch `deepseek2` with one
expert group) in llama.cpp (llama-cpp-python 0.3.36) and compares its logits and greedy tokens with
transformers' (the fixture). check_deepseek3_llama_cpp.py's check on this fixture."""

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import check_deepseek3_llama_cpp  # noqa: E402

if __name__ == "__main__":
    check_deepseek3_llama_cpp.main(HERE.parents[1] / "tests/fixtures/kimi-k2-tiny",
                                   "/tmp/kimi-llama-check", __doc__)
