#!/usr/bin/env python3
"""Builds the kimi-k2-tiny correctness fixture: a random-weight Kimi-K2 run by Hugging Face
transformers. Kimi-K2 is a DeepSeek-V3 (DeepseekV3ForCausalLM, llama.cpp's `deepseek2`) with its
own widths and router: one expert group (n_group = topk_group = 1, so the group-limited top-k is a
plain top-k over every expert), 384 experts of which 8 are used (here 24 and 6),
routed_scaling_factor 2.827, and YaRN with beta_fast = beta_slow = 1 (DeepSeek-V3 has 32/1).

Everything else, the steps and the outputs, are make_deepseek3_fixture.py's (its build, run with
this config): random weights in the release's layout, transformers loads them bit for bit, llama.cpp's
converter writes model-f32.gguf, model-q8_0.gguf re-encodes the routed experts, and transformers
gives the logits, routing and greedy tokens.

Needs torch and transformers 5.x and the llama.cpp sdist (not part of CI: outputs are committed).
See README.md.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_deepseek3_fixture as ds3  # noqa: E402

# Kimi-K2-Instruct's config.json keys that differ from DeepSeek-V3's, shrunk like the V3 fixture.
KIMI = dict(
    n_routed_experts=24,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=1,
                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
)

if __name__ == "__main__":
    # The V3 build reads its module's config; this script's differences replace those keys.
    ds3.ORIG = dict(ds3.ORIG, **KIMI)
    ds3.PROMPT = b"Kimi-K2 streams 384 experts.\n"  # token id = byte value
    ds3.GENERATOR = "tools/reference/make_kimi_k2_fixture.py"
    ds3.DEFAULT_SEED = 9  # seeds 1-8 leave a routing margin below the bar (f32 or q8_0)
    # 6 of 24 experts leave closer calls than V3's 4 of 16 in 4 groups (seeds 1-4 all had one
    # below V3's 1e-3); 5e-4 is still ~500x the engine's f32 error on a router score.
    ds3.MIN_ROUTING_MARGIN = 5e-4
    ds3.build_fixture(ds3, "tests/fixtures/kimi-k2-tiny", __doc__)
