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

import argparse
import json
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from transformers import Glm4MoeForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_deepseek3_fixture import CONVERT_WRAPPER, fused  # noqa: E402
from make_deepseek4_fixture import (LLAMA_CPP, gguf_module, greedy, q8_0_dequant,  # noqa: E402
                                    rel_err, rewrite_gguf, run_sequence, sha256,
                                    write_byte_tokenizer)

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


def random_checkpoint(seed):
    """Every weight, released Hugging Face names -> f32 numpy (the MTP block included)."""
    rng = np.random.default_rng(seed)
    c = ORIG
    h, v, nh, nkv, hd = (c["hidden_size"], c["vocab_size"], c["num_attention_heads"],
                         c["num_key_value_heads"], c["head_dim"])
    ne, ff, dff = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    sff = ff * c["n_shared_experts"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight(n):
        return rng.uniform(0.75, 1.25, n).astype(np.float32)

    def mlp(p, width):
        w[p + "gate_proj.weight"] = normal((width, h), h**-0.5)
        w[p + "up_proj.weight"] = normal((width, h), h**-0.5)
        w[p + "down_proj.weight"] = normal((h, width), width**-0.5)

    w = {"model.embed_tokens.weight": normal((v, h), 1.0)}
    for i in range(LAYERS + NEXTN):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(h)
        w[p + "post_attention_layernorm.weight"] = norm_weight(h)
        a = p + "self_attn."
        for name, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            w[a + f"{name}_proj.weight"] = normal((rows, h), h**-0.5)
            w[a + f"{name}_proj.bias"] = normal((rows,), 0.2)
        w[a + "o_proj.weight"] = normal((h, nh * hd), (nh * hd) ** -0.5)
        w[a + "q_norm.weight"] = norm_weight(hd)
        w[a + "k_norm.weight"] = norm_weight(hd)
        if i < DENSE:
            mlp(p + "mlp.", dff)
            continue
        # Router logits with a std of about 1.5: sigmoid scores spread over (0, 1).
        w[p + "mlp.gate.weight"] = normal((ne, h), 0.2)
        w[p + "mlp.gate.e_score_correction_bias"] = normal((ne,), 0.1)
        for e in range(ne):
            mlp(p + f"mlp.experts.{e}.", ff)
        mlp(p + "mlp.shared_experts.", sff)
        if i >= LAYERS:  # the MTP block's own projection and norms
            w[p + "eh_proj.weight"] = normal((h, 2 * h), (2 * h) ** -0.5)
            w[p + "enorm.weight"] = norm_weight(h)
            w[p + "hnorm.weight"] = norm_weight(h)
            w[p + "shared_head.norm.weight"] = norm_weight(h)
    w["model.norm.weight"] = norm_weight(h)
    w["lm_head.weight"] = normal((v, h), 2.0 * h**-0.5)
    return w


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


def convert(ckpt_dir, out):
    wrapper = ckpt_dir.parent / "convert_wrapper.py"
    wrapper.write_text(CONVERT_WRAPPER.format(root=str(LLAMA_CPP)))
    subprocess.run([sys.executable, str(wrapper), str(ckpt_dir), "--outfile", str(out),
                    "--outtype", "f32"], check=True)


def routes_and_margin(model, tokens):
    """The routing of every (token, sparse layer) from hooks on the routers, and the smallest
    margin of an expert choice (k-th vs (k+1)-th corrected score; n_group is 1)."""
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
    return records, float(margin[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[2] /
                                         "tests/fixtures/glm4moe-tiny"))
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--keep", help="keep the checkpoint in this folder (default: a temp dir)")
    args = ap.parse_args()
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{LLAMA_CPP}: no convert_hf_to_gguf.py (set LLAMA_CPP to the sdist's "
                         "vendor/llama.cpp)")
    gguf = gguf_module()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp())
    ckpt_dir = work / "checkpoint"

    ckpt = random_checkpoint(args.seed)
    write_checkpoint(ckpt, ckpt_dir)
    model = load_model(ckpt_dir)
    check_bit_identical(model, ckpt)
    print("checkpoint: transformers loads it back bit-identically")

    f32_path = out / "model-f32.gguf"
    convert(ckpt_dir, f32_path)
    q8_values = {}

    def to_q8(name, ttype, a):
        if "_exps." in name:
            q, deq = q8_0_dequant(gguf, a)
            q8_values[name] = deq
            return q, gguf.GGMLQuantizationType.Q8_0
        return a, (None if ttype == gguf.GGMLQuantizationType.F32 else ttype)

    rewrite_gguf(gguf, f32_path, out / "model-q8_0.gguf", to_q8)

    prompt = list(PROMPT)
    tokens = greedy(model, prompt, GENERATE)
    cached, full = run_sequence(model, tokens)
    cache_err = rel_err(cached, full)
    trace, margin = routes_and_margin(model, tokens)
    if margin < MIN_ROUTING_MARGIN:
        raise SystemExit(f"seed {args.seed}: routing margin {margin:.2e} < {MIN_ROUTING_MARGIN}")
    if cache_err > 1e-5:
        raise SystemExit(f"cached and uncached transformers disagree ({cache_err:.2e})")
    with torch.no_grad():
        m64 = load_model(ckpt_dir).double()
        full64 = m64(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].numpy()

    # The q8_0 reference: transformers with the routed experts as their Q8_0 dequantisation.
    model_q8 = load_model(ckpt_dir)
    ne, ff, h = ORIG["n_routed_experts"], ORIG["moe_intermediate_size"], ORIG["hidden_size"]
    with torch.no_grad():
        for i in range(DENSE, LAYERS):
            g = q8_values[f"blk.{i}.ffn_gate_exps.weight"].reshape(ne, ff, h)
            u = q8_values[f"blk.{i}.ffn_up_exps.weight"].reshape(ne, ff, h)
            d = q8_values[f"blk.{i}.ffn_down_exps.weight"].reshape(ne, h, ff)
            ex = model_q8.model.layers[i].mlp.experts
            ex.gate_up_proj.copy_(torch.from_numpy(np.concatenate([g, u], axis=1)))
            ex.down_proj.copy_(torch.from_numpy(d))
    cached_q8, full_q8 = run_sequence(model_q8, tokens)
    tokens_q8 = greedy(model_q8, prompt, GENERATE)
    trace_q8, margin_q8 = routes_and_margin(model_q8, tokens)
    if margin_q8 < MIN_ROUTING_MARGIN:
        raise SystemExit(f"seed {args.seed}: q8_0 routing margin {margin_q8:.2e} too small")

    full.astype("<f4").tofile(out / "logits-f32.bin")
    full_q8.astype("<f4").tofile(out / "logits-q8_0.bin")
    for name, records in (("trace-f32.jsonl", trace), ("trace-q8_0.jsonl", trace_q8)):
        with open(out / name, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    files = ["model-f32.gguf", "model-q8_0.gguf", "logits-f32.bin", "logits-q8_0.bin",
             "trace-f32.jsonl", "trace-q8_0.jsonl"]
    logit_sorted = np.sort(full, axis=1)
    meta = {
        "generator": "tools/reference/make_glm4moe_fixture.py",
        "seed": args.seed,
        "config": ORIG,
        "prompt": PROMPT.decode(),
        "prompt_tokens": len(prompt),
        "tokens": tokens,
        "greedy_q8_0": tokens_q8,
        "vocab": ORIG["vocab_size"],
        "logits_shape": [len(tokens), ORIG["vocab_size"]],
        "logits": "raw little-endian f32, row t = logits after tokens 0..t (the uncached forward; "
                  "the cached one agrees)",
        "trace": "JSON Lines {token, layer, experts, weights} for the sparse layers; experts by "
                 "descending weight; weights normalised over the top-k and x routed_scaling_factor",
        "cached_vs_uncached_rel_err": cache_err,
        "cached_vs_uncached_rel_err_q8_0": rel_err(cached_q8, full_q8),
        "f32_vs_f64_rel_err": rel_err(full, full64),
        "q8_0_vs_f32_rel_err": rel_err(full_q8, full),
        "min_routing_margin": margin,
        "min_routing_margin_q8_0": margin_q8,
        "distinct_experts_routed": len({(r["layer"], e) for r in trace for e in r["experts"]}),
        "min_top2_logit_margin": float((logit_sorted[:, -1] - logit_sorted[:, -2]).min()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "python": platform.python_version(),
                     "llama.cpp": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp"},
        "sha256": {f: sha256(out / f) for f in files},
    }
    (out / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({k: v for k, v in meta.items() if k not in ("config", "sha256")}, indent=1))
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
