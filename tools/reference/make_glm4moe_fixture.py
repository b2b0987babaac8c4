#!/usr/bin/env python3
"""Builds the glm4moe-tiny correctness fixture: a random-weight GLM-4.5 run by Hugging Face
transformers (Glm4MoeForCausalLM), converted to GGUF by llama.cpp's own converter (arch
`glm4moe`), and the logits and routing decisions of every position.

Steps:
  1. Random weights (numpy PCG64, fixed seed) in the released GLM-4.5 Hugging Face layout (one
     `mlp.experts.E.{gate,up,down}_proj.weight` per expert, `mlp.gate.e_score_correction_bias`,
     q/k/v biases, per-head q/k norms as GLM-4.5 (355B) has them, partial RoPE with
     partial_rotary_factor 0.5), plus the release's MTP block (`model.layers.N.*` after the
     num_hidden_layers main ones, with eh_proj/enorm/hnorm/shared_head.norm), written as
     safetensors + config.json + a byte-level tokenizer.json with GLM's special tokens (the
     converter's GLM vocabulary needs [gMASK], <|user|>, <|endoftext|> and <|observation|>).
  2. transformers loads the checkpoint with from_pretrained (the MTP block is not part of its
     forward and is left out); every parameter must equal the generated weights bit for bit.
  3. llama.cpp's convert_hf_to_gguf.py turns it into model-f32.gguf: block_count = main layers +
     nextn_predict_layers, the MTP block last. model-q8_0.gguf is the same file with the routed
     experts re-encoded as Q8_0 (gguf-py); its reference is transformers on the dequantised
     experts.
  4. transformers (float32, eager) runs the prompt and a greedy continuation token by token with
     its cache and the whole sequence without one; both must agree. The script refuses a seed
     where an expert choice (k-th vs (k+1)-th corrected score) is closer than a margin.

    /tmp/refvenv/bin/python tools/reference/make_glm4moe_fixture.py  # -> tests/fixtures/glm4moe-tiny

Needs torch and transformers 5.x and the llama.cpp sdist (LLAMA_CPP; not part of CI: outputs are
committed). See README.md.
"""

import json
import pathlib
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import Glm4MoeForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_deepseek3_fixture import build_fixture, fused, random_sigmoid_moe  # noqa: E402
from make_deepseek4_fixture import write_byte_tokenizer  # noqa: E402

LAYERS = 3
DENSE = 1  # first_k_dense_replace: layer 0 has a dense MLP
NEXTN = 1  # the MTP block, model.layers.3 (the converter writes it as blk.3)
# GLM's special tokens after the 256 byte tokens (the converter's GLM vocabulary looks these up).
SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
           "<|assistant|>", "<|observation|>"]
ORIG = dict(  # the release's config.json keys, shrunk
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    vocab_size=272,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=LAYERS,
    first_k_dense_replace=DENSE,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # explicit, as the release's (4096 / 96 heads is not 128)
    partial_rotary_factor=0.5,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=True,
    attention_bias=True,
    hidden_act="silu",
    rope_theta=1000000.0,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    num_nextn_predict_layers=NEXTN,
    bos_token_id=256 + SPECIAL.index("[gMASK]"),
    eos_token_id=256 + SPECIAL.index("<|endoftext|>"),
    pad_token_id=256 + SPECIAL.index("<|endoftext|>"),
    tie_word_embeddings=False,
    torch_dtype="float32",
)
PROMPT = b"GLM-4.5 streams its experts from disk.\n"  # token id = byte value
GENERATE = 8
DEFAULT_SEED = 1
MIN_ROUTING_MARGIN = 1e-3
GENERATOR = "tools/reference/make_glm4moe_fixture.py"
Q8_DENSE = {}  # the q8_0 file re-encodes the routed experts only


def random_checkpoint(seed):
    """Every weight, released Hugging Face names -> f32 numpy (the MTP block included)."""
    c = ORIG
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def gqa(h, normal, norm_weight):
        a = {}
        for name, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            a[f"{name}_proj.weight"] = normal((rows, h), h**-0.5)
            a[f"{name}_proj.bias"] = normal((rows,), 0.2)
        a["o_proj.weight"] = normal((h, nh * hd), (nh * hd) ** -0.5)
        a["q_norm.weight"] = norm_weight(hd)
        a["k_norm.weight"] = norm_weight(hd)
        return a

    def mtp(i, normal, norm_weight):  # the MTP block's own projection and norms
        h = c["hidden_size"]
        if i < LAYERS:
            return {}
        return {"eh_proj.weight": normal((h, 2 * h), (2 * h) ** -0.5),
                "enorm.weight": norm_weight(h), "hnorm.weight": norm_weight(h),
                "shared_head.norm.weight": norm_weight(h)}

    return random_sigmoid_moe(seed, c, LAYERS + NEXTN, DENSE, gqa, mtp)


def write_tokenizer(d):
    """The byte tokenizer with GLM's special tokens as added tokens (ids 256...)."""
    write_byte_tokenizer(d, ORIG["max_position_embeddings"])
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"] = [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False, "special": True}
                           for i, s in enumerate(SPECIAL)]
    (d / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(bos_token="[gMASK]", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_checkpoint(ckpt, d):
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(a) for k, a in ckpt.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(ORIG, indent=2))
    write_tokenizer(d)


def load_model(d):
    # The MTP block is not part of transformers' forward (the release's is ignored by layer index).
    Glm4MoeForCausalLM._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    return Glm4MoeForCausalLM.from_pretrained(str(d), attn_implementation="eager",
                                              experts_implementation="eager",
                                              dtype=torch.float32).eval()


def check_bit_identical(model, ckpt):
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    ne = ORIG["n_routed_experts"]
    expect = {k: v for k, v in ckpt.items()
              if ".mlp.experts." not in k and not k.startswith(f"model.layers.{LAYERS}.")}
    for i in range(DENSE, LAYERS):
        gu, dn = fused(ckpt, i, ne)
        expect[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gu
        expect[f"model.layers.{i}.mlp.experts.down_proj"] = dn
    for name, a in expect.items():
        if name not in own:
            raise SystemExit(f"{name}: not in transformers' model")
        if not np.array_equal(own[name].detach().numpy(), a):
            raise SystemExit(f"{name}: transformers did not load the checkpoint bit-identically")
    if own["model.rotary_emb.inv_freq"].numel() * 2 != ORIG["head_dim"] // 2:
        raise SystemExit("transformers does not rotate half the head (partial_rotary_factor)")


def routes_and_margin(model, tokens):
    """The routing of every (token, sparse layer) from hooks on the routers, the smallest margin of
    an expert choice (k-th vs (k+1)-th corrected score; n_group is 1) and no extra entries."""
    k = ORIG["num_experts_per_tok"]
    routes, margin, hooks = {}, [1.0], []
    for i, layer in enumerate(model.model.layers):
        if i < DENSE:
            continue

        def on_gate(mod, inputs, output, i=i):
            logits, weights, indices = output
            scores = torch.sigmoid(logits).detach().double().numpy()
            corr = scores + mod.e_score_correction_bias.detach().double().numpy()
            for t in range(corr.shape[0]):
                srt = -np.sort(-corr[t])
                margin[0] = min(margin[0], srt[k - 1] - srt[k])
                order = np.argsort(-weights[t].detach().numpy(), kind="stable")
                routes[(t, i)] = ([int(indices[t, j]) for j in order],
                                  [float(weights[t, j]) for j in order])
        hooks.append(layer.mlp.gate.register_forward_hook(on_gate))
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]), use_cache=False)
    for hk in hooks:
        hk.remove()
    records = []
    for t in range(len(tokens)):
        for i in range(DENSE, LAYERS):
            e, w = routes[(t, i)]
            records.append({"token": t, "layer": i, "experts": e,
                            "weights": [round(x, 7) for x in w]})
    return records, float(margin[0]), {}


if __name__ == "__main__":
    build_fixture(sys.modules[__name__], "tests/fixtures/glm4moe-tiny", __doc__)
