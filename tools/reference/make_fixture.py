#!/usr/bin/env python3
"""Builds the qwen3moe-tiny correctness fixture: a random-weight Qwen3-MoE run by Hugging Face
transformers, its weights as GGUF (llama.cpp's qwen3moe names and layouts) and the logits and
routing decisions of every position.

Two models share every weight; they differ only in how the routed experts are stored:

  model-f32.gguf   experts in f32     expected logits-f32.bin  (transformers on the f32 weights)
  model-q8_0.gguf  experts in q8_0    expected logits-q8_0.bin (transformers with every expert
                                      weight replaced by dequantize(quantize_q8_0(w)), so the
                                      engine and the reference compute with the same numbers)

Needs torch and transformers (not part of CI: the outputs are committed). See README.md.
"""

import argparse
import hashlib
import importlib.metadata
import json
import pathlib
import platform
import sys

import numpy as np
import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import gguf
from gguf import GGMLQuantizationType

# The model. Every layer is sparse (decoder_sparse_step 1, no mlp_only_layers), no shared experts.
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,  # the dense MLP size; unused (no dense layers), recorded in the GGUF
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_bias=False,
)
ROPE_THETA = 1e6
PROMPT = b"Hello, MoE!\n"  # 12 tokens: token id = byte value (see tokenizer below)
# Seeds 1..39 were tried; 39 has the widest routing margin (1.8e-2) in both variants.
DEFAULT_SEED = 39
# The k-th and (k+1)-th router probabilities of every (token, layer) must differ by at least this
# much, so the f32 rounding differences between implementations cannot flip a routing decision.
MIN_ROUTING_MARGIN = 1e-3


def make_config():
    cfg = dict(CONFIG)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    try:
        return Qwen3MoeConfig(**cfg)
    except TypeError:  # transformers 4.x: rope_theta is a plain argument
        del cfg["rope_parameters"]
        return Qwen3MoeConfig(rope_theta=ROPE_THETA, **cfg)


def random_weights(seed):
    """Every weight as f32 numpy, from numpy's PCG64 (stable across numpy versions).

    Scales keep activations O(1) (projections ~ N(0, 1/fan_in)), make routing decisive (router
    logits with a std of about 2) and keep the logits spread, so a wrong position, head or expert
    changes the output far beyond the comparison tolerance.
    """
    rng = np.random.default_rng(seed)
    c = CONFIG
    h, hd, nh, nkv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    ne, ff, vocab = c["num_experts"], c["moe_intermediate_size"], c["vocab_size"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight(n):
        return rng.uniform(0.75, 1.25, n).astype(np.float32)

    w = {"token_embd": normal((vocab, h), 1.0)}
    layers = []
    for _ in range(c["num_hidden_layers"]):
        layers.append(
            {
                "attn_norm": norm_weight(h),
                "attn_q": normal((nh * hd, h), h**-0.5),
                "attn_k": normal((nkv * hd, h), h**-0.5),
                "attn_v": normal((nkv * hd, h), h**-0.5),
                "attn_output": normal((h, nh * hd), (nh * hd) ** -0.5),
                "attn_q_norm": norm_weight(hd),
                "attn_k_norm": norm_weight(hd),
                "ffn_norm": norm_weight(h),
                "ffn_gate_inp": normal((ne, h), 0.25),
                "ffn_gate_exps": normal((ne, ff, h), h**-0.5),
                "ffn_up_exps": normal((ne, ff, h), h**-0.5),
                "ffn_down_exps": normal((ne, h, ff), ff**-0.5),
            }
        )
    w["layers"] = layers
    w["output_norm"] = norm_weight(h)
    w["output"] = normal((vocab, h), 2.0 * h**-0.5)
    return w


def q8_0_roundtrip(a):
    q = gguf.quants.quantize(a, GGMLQuantizationType.Q8_0)
    return q, gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0).astype(np.float32)


def load_into(model, w):
    """Copies the numpy weights into the transformers model (4.x and 5.x expert layouts)."""
    sd = model.state_dict()
    new = {"model.embed_tokens.weight": w["token_embd"], "model.norm.weight": w["output_norm"]}
    new["lm_head.weight"] = w["output"]
    for i, lw in enumerate(w["layers"]):
        p = f"model.layers.{i}."
        new[p + "input_layernorm.weight"] = lw["attn_norm"]
        new[p + "post_attention_layernorm.weight"] = lw["ffn_norm"]
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            new[p + f"self_attn.{theirs}.weight"] = lw[ours]
        new[p + "self_attn.q_norm.weight"] = lw["attn_q_norm"]
        new[p + "self_attn.k_norm.weight"] = lw["attn_k_norm"]
        new[p + "mlp.gate.weight"] = lw["ffn_gate_inp"]
        if p + "mlp.experts.gate_up_proj" in sd:  # 5.x: fused [E, 2*ff, h], gate rows first
            new[p + "mlp.experts.gate_up_proj"] = np.concatenate(
                [lw["ffn_gate_exps"], lw["ffn_up_exps"]], axis=1)
            new[p + "mlp.experts.down_proj"] = lw["ffn_down_exps"]
        else:  # 4.x: one Qwen3MoeMLP per expert
            for e in range(CONFIG["num_experts"]):
                q = p + f"mlp.experts.{e}."
                new[q + "gate_proj.weight"] = lw["ffn_gate_exps"][e]
                new[q + "up_proj.weight"] = lw["ffn_up_exps"][e]
                new[q + "down_proj.weight"] = lw["ffn_down_exps"][e]
    missing = set(sd) - set(new)
    extra = set(new) - set(sd)
    if missing or extra:
        sys.exit(f"state dict mismatch: missing {sorted(missing)}, unexpected {sorted(extra)}")
    for k, v in new.items():
        if tuple(sd[k].shape) != v.shape:
            sys.exit(f"{k}: shape {tuple(sd[k].shape)} != {v.shape}")
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in new.items()})


def run(w, tokens, dtype):
    """Logits of every position and the router logits of every (layer, position)."""
    cfg = make_config()
    try:
        model = Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="eager",
                                                 experts_implementation="eager")
    except TypeError:
        model = Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="eager")
    model.eval()
    load_into(model, w)
    model.to(dtype)
    router_logits = {}

    def hook(layer):
        def f(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            router_logits[layer] = logits.detach().to(torch.float64).numpy().copy()
        return f

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(hook(i))
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False)
    logits = out.logits[0].to(torch.float64).numpy()
    return logits, [router_logits[i] for i in range(len(model.model.layers))]


def routing(router_logits, k):
    """The model's routing from its router logits: softmax, top-k, renormalised; and the margin."""
    records, margin = [], 1.0
    n_tokens = router_logits[0].shape[0]
    for t in range(n_tokens):
        for layer, rl in enumerate(router_logits):
            p = np.exp(rl[t] - rl[t].max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            margin = min(margin, p[order[k - 1]] - p[order[k]])
            top = p[order[:k]]
            top = top / top.sum()
            records.append({"token": t, "layer": layer, "experts": [int(e) for e in order[:k]],
                            "weights": [round(float(x), 7) for x in top]})
    return records, margin


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: byte b is stored as the character bytes_to_unicode()[b]."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_gguf(path, w, expert_type):
    c = CONFIG
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("qwen3moe-tiny")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_expert_count(c["num_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if expert_type == "f32"
                         else gguf.LlamaFileType.MOSTLY_Q8_0)
    # A byte-level vocabulary: token id b is byte b, as GPT-2 spells it. llama.cpp's BPE loader
    # requires a merges list; the one merge is a placeholder (its result is not in the vocabulary).
    alphabet = bytes_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([alphabet[b] for b in range(256)])
    writer.add_token_types([gguf.TokenType.NORMAL] * 256)
    writer.add_token_merges([alphabet[32] + " " + alphabet[32]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)

    def f32(name, a):
        writer.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    f32("token_embd.weight", w["token_embd"])
    for i, lw in enumerate(w["layers"]):
        for key in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                    "attn_k_norm", "ffn_norm", "ffn_gate_inp"):
            f32(f"blk.{i}.{key}.weight", lw[key])
        for key in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            # numpy [n_expert, rows, cols] is GGUF ne [cols, rows, n_expert].
            if expert_type == "f32":
                f32(f"blk.{i}.{key}.weight", lw[key])
            else:
                q, _ = q8_0_roundtrip(lw[key])
                writer.add_tensor(f"blk.{i}.{key}.weight", q,
                                  raw_dtype=GGMLQuantizationType.Q8_0)
    f32("output_norm.weight", w["output_norm"])
    f32("output.weight", w["output"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[2] /
                                         "tests/fixtures/qwen3moe-tiny"))
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)  # nothing random is drawn from torch; set for completeness
    torch.use_deterministic_algorithms(True)

    tokens = list(PROMPT)
    k = CONFIG["num_experts_per_tok"]
    base = random_weights(args.seed)
    variants = {}
    for name in ("f32", "q8_0"):
        w = base
        if name == "q8_0":  # the same model with every expert weight as its q8_0 dequantisation
            w = dict(base)
            w["layers"] = [dict(lw) for lw in base["layers"]]
            for lw in w["layers"]:
                for key in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                    lw[key] = q8_0_roundtrip(lw[key])[1]
        logits32, router32 = run(w, tokens, torch.float32)
        logits64, _ = run(w, tokens, torch.float64)
        trace, margin = routing(router32, k)
        if margin < MIN_ROUTING_MARGIN:
            sys.exit(f"{name}: a routing decision has margin {margin:.2e} < {MIN_ROUTING_MARGIN}:"
                     " pick another --seed")
        gguf_path = out / f"model-{name}.gguf"
        write_gguf(gguf_path, w if name == "f32" else base, name)
        logits_path = out / f"logits-{name}.bin"
        logits32.astype("<f4").tofile(logits_path)
        trace_path = out / f"trace-{name}.jsonl"
        trace_path.write_text("".join(json.dumps(r) + "\n" for r in trace))
        variants[name] = {
            "gguf": gguf_path.name,
            "gguf_sha256": sha256(gguf_path),
            "expert_type": name,
            "logits": logits_path.name,
            "logits_sha256": sha256(logits_path),
            "trace": trace_path.name,
            "min_routing_margin": margin,
            "f32_vs_f64_rel_err": rel_err(logits32, logits64),
            "greedy_next": [int(i) for i in logits32.argmax(axis=1)],
        }
        print(f"{name}: {gguf_path.stat().st_size} B gguf, routing margin {margin:.3e}, "
              f"f32 vs f64 logits rel err {variants[name]['f32_vs_f64_rel_err']:.2e}")

    fixture = {
        "description": "random-weight Qwen3-MoE run by Hugging Face transformers in float32",
        "generator": "tools/reference/make_fixture.py",
        "seed": args.seed,
        "weights_rng": "numpy.random.default_rng(seed) (PCG64), see random_weights()",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__,
                     "gguf": importlib.metadata.version("gguf")},
        "config": dict(CONFIG, rope_theta=ROPE_THETA),
        "tokens": tokens,
        "text": PROMPT.decode(),
        "logits_format": "raw little-endian float32, row-major [n_tokens, vocab_size]: row t is "
                         "the logits after tokens[0..t], computed with a causal mask (no cache)",
        "logits_shape": [len(tokens), CONFIG["vocab_size"]],
        "trace_format": "JSON Lines {token, layer, experts, weights}, token-major; experts in "
                        "descending router probability; weights renormalised over the top-k",
        "tokenizer": "gpt2 byte-level: token id b is byte b, stored as GPT-2's unicode spelling",
        "variants": variants,
    }
    (out / "fixture.json").write_text(json.dumps(fixture, indent=2) + "\n")


if __name__ == "__main__":
    main()
