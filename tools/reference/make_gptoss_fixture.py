#!/usr/bin/env python3
"""Builds the gptoss-tiny correctness fixture: a random-weight gpt-oss (transformers'
GptOssForCausalLM) whose routed experts are MXFP4 as gpt-oss ships them, converted by llama.cpp's
own convert_hf_to_gguf.py, and transformers' logits, greedy tokens and routing.

  1. The original checkpoint layout: experts as `gate_up_proj_blocks`/`_scales` (rows of gate and
     up interleaved, 32-element blocks of e2m1 pairs, low nibble first, e8m0 scales) and
     `down_proj_blocks`/`_scales`, quantization_config {quant_method: mxfp4}; every other weight
     (and the expert biases) f32. convert_hf_to_gguf.py repacks the blocks into ggml MXFP4 itself
     -> model-mxfp4.gguf.
  2. The same weights dequantised (exact: every expert weight is an MXFP4 value) saved by
     transformers' save_pretrained and converted with --outtype f32 -> model-f32.gguf. Both files
     therefore hold the same numbers and share one reference (logits.bin, trace.jsonl).
  3. transformers (float32, eager) runs the prompt and a greedy continuation (with the KV cache);
     the logits of the whole sequence come from one uncached forward.

The prompt is longer than the sliding window (the even layers' window is exercised); attention
sinks, q/k/v/o, router and expert biases are all non-zero; the gate/up weights are large enough
that the clamped SwiGLU's limit (7) clips (the fraction is recorded). RoPE is YaRN with gpt-oss's
`truncate: false`. The tokenizer is byte-level BPE without merges (token = byte), so every
pre-tokenizer gives the same tokens: the converter is told it is `gpt-2`.

    /tmp/refvenv/bin/python tools/reference/make_gptoss_fixture.py   # -> tests/fixtures/gptoss-tiny

Needs torch, transformers, safetensors and llama.cpp's tree (LLAMA_CPP).
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
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_deepseek4_fixture import (E2M1, LLAMA_CPP, greedy, gguf_module, rel_err,  # noqa: E402
                                    sha256, write_byte_tokenizer)

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    head_dim=16,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    attention_bias=True,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=32,
            beta_fast=32.0, beta_slow=1.0, truncate=False)
PROMPT = b"gpt-oss streams MXFP4 experts from NVMe.\n"  # token id = byte value
GENERATE = 8
DEFAULT_SEED = 1
# The k-th and (k+1)-th router logits of every (token, layer) must differ by this much.
MIN_ROUTING_MARGIN = 1e-3
LIMIT = 7.0  # GptOssExperts.limit (llama.cpp's SWIGLU_OAI_MOE uses the same constant)


def mxfp4_rows(blocks, scales):
    """gpt-oss's MXFP4 (blocks [..., n/32, 16] of e2m1 pairs, low nibble first; scales [..., n/32]
    e8m0) to f32 [..., n]."""
    codes = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    s = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    v = E2M1[codes] * s[..., None]
    return v.reshape(blocks.shape[:-2] + (-1,)).astype(np.float32)


def random_weights(seed):
    """The original checkpoint (expert blocks/scales as uint8) and transformers' f32 parameters."""
    rng = np.random.default_rng(seed)
    c = CONFIG
    h, nh, nkv, hd = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                      c["head_dim"])
    ne, ff, vocab = c["num_local_experts"], c["intermediate_size"], c["vocab_size"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight(n):
        return rng.uniform(0.75, 1.25, n).astype(np.float32)

    def mxfp4(shape, exp_lo, exp_hi):
        rows, n = shape[:-1], shape[-1]
        blocks = rng.integers(0, 256, rows + (n // 32, 16), dtype=np.uint8)
        scales = rng.integers(127 + exp_lo, 127 + exp_hi + 1, rows + (n // 32,)).astype(np.uint8)
        return blocks, scales

    sd = {"model.embed_tokens.weight": normal((vocab, h), 1.0)}
    raw = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_weight(h)
        for name, rows, cols in (("q", nh * hd, h), ("k", nkv * hd, h), ("v", nkv * hd, h),
                                 ("o", h, nh * hd)):
            sd[p + f"self_attn.{name}_proj.weight"] = normal((rows, cols), cols**-0.5)
            sd[p + f"self_attn.{name}_proj.bias"] = normal((rows,), 0.2)
        sd[p + "self_attn.sinks"] = rng.uniform(-1.0, 2.0, nh).astype(np.float32)
        sd[p + "post_attention_layernorm.weight"] = norm_weight(h)
        sd[p + "mlp.router.weight"] = normal((ne, h), 0.25)
        sd[p + "mlp.router.bias"] = normal((ne,), 0.5)
        # Rows out, columns in (the release's layout); gate/up rows interleaved. e2m1 values have
        # an rms of about 3: 2^-3 scales put gate/up pre-activations near 3 (the clamp at 7 clips
        # a few), 2^-5 keeps down's output O(1).
        gu_b, gu_s = mxfp4((ne, 2 * ff, h), -4, -2)
        dn_b, dn_s = mxfp4((ne, h, ff), -6, -5)
        raw[p + "mlp.experts.gate_up_proj_blocks"] = gu_b
        raw[p + "mlp.experts.gate_up_proj_scales"] = gu_s
        raw[p + "mlp.experts.down_proj_blocks"] = dn_b
        raw[p + "mlp.experts.down_proj_scales"] = dn_s
        # transformers multiplies x @ W: [expert, in, out].
        sd[p + "mlp.experts.gate_up_proj"] = np.ascontiguousarray(
            mxfp4_rows(gu_b, gu_s).transpose(0, 2, 1))
        sd[p + "mlp.experts.gate_up_proj_bias"] = normal((ne, 2 * ff), 0.2)
        sd[p + "mlp.experts.down_proj"] = np.ascontiguousarray(
            mxfp4_rows(dn_b, dn_s).transpose(0, 2, 1))
        sd[p + "mlp.experts.down_proj_bias"] = normal((ne, h), 0.2)
    sd["model.norm.weight"] = norm_weight(h)
    sd["lm_head.weight"] = normal((vocab, h), 2.0 * h**-0.5)
    return sd, raw


def hf_config():
    return GptOssConfig(**CONFIG, rope_parameters=dict(ROPE))


def make_model(sd, dtype=torch.float32):
    model = GptOssForCausalLM._from_config(hf_config(), attn_implementation="eager",
                                           experts_implementation="eager")
    own = model.state_dict()
    if set(own) != set(sd):
        raise SystemExit(f"state dict mismatch: {sorted(set(own) ^ set(sd))}")
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()})
    return model.to(dtype).eval()


def write_mxfp4_checkpoint(d, sd, raw):
    """The release's layout: experts as blocks/scales, the rest as transformers names them."""
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            continue
        tensors[k] = torch.from_numpy(np.ascontiguousarray(v))
    for k, v in raw.items():
        tensors[k] = torch.from_numpy(np.ascontiguousarray(v))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config().to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    write_byte_tokenizer(d, CONFIG["max_position_embeddings"])


CONVERT_WRAPPER = """
import runpy, sys
sys.path.insert(0, {root!r})
sys.path.insert(1, {root!r} + "/gguf-py")
from conversion import base
# The test tokenizer is byte-level with no merges: every pre-tokenizer gives the same tokens.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path({root!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(ckpt_dir, out):
    wrapper = ckpt_dir.parent / "convert_wrapper.py"
    wrapper.write_text(CONVERT_WRAPPER.format(root=str(LLAMA_CPP)))
    subprocess.run([sys.executable, str(wrapper), str(ckpt_dir), "--outfile", str(out),
                    "--outtype", "f32"], check=True)


def forward(model, tokens):
    """Uncached logits of every position, the routing of every (token, layer), the smallest
    top-k margin and the fraction of gate/up pre-activations the clamp clips."""
    router, gate_up = {}, []
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def on_router(_m, _inp, out, i=i):
            router[i] = out[0].detach().double().numpy().copy()
        hooks.append(layer.mlp.router.register_forward_hook(on_router))

        orig = layer.mlp.experts._apply_gate

        def apply_gate(x, orig=orig):
            gate_up.append(x.detach().double().numpy().ravel().copy())
            return orig(x)
        layer.mlp.experts._apply_gate = apply_gate
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    for hk in hooks:
        hk.remove()
    for layer in model.model.layers:
        del layer.mlp.experts._apply_gate
    k = CONFIG["num_experts_per_tok"]
    records, margin = [], np.inf
    for t in range(len(tokens)):
        for layer in range(len(router)):
            rl = router[layer][t]
            order = np.argsort(-rl, kind="stable")
            margin = min(margin, rl[order[k - 1]] - rl[order[k]])
            top = np.exp(rl[order[:k]] - rl[order[0]])
            top /= top.sum()
            records.append({"token": t, "layer": layer, "experts": [int(e) for e in order[:k]],
                            "weights": [round(float(x), 7) for x in top]})
    gu = np.concatenate(gate_up)
    clipped = float(np.mean(np.abs(gu) > LIMIT))
    return logits.double().numpy(), records, float(margin), clipped


def check_gguf(gguf, path, sd):
    """The converted experts (dequantised by gguf-py) are transformers' weights exactly."""
    r = gguf.GGUFReader(str(path))
    types = {}
    for t in r.tensors:
        if "_exps.weight" not in t.name:
            continue
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        i = int(t.name.split(".")[1])
        p = f"model.layers.{i}.mlp.experts."
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        gu = sd[p + "gate_up_proj"].transpose(0, 2, 1)  # [expert, out, in]
        want = {"ffn_gate_exps": gu[:, 0::2], "ffn_up_exps": gu[:, 1::2],
                "ffn_down_exps": sd[p + "down_proj"].transpose(0, 2, 1)}[t.name.split(".")[2]]
        if not np.array_equal(w.reshape(want.shape), want):
            raise SystemExit(f"{path.name}: {t.name} is not the checkpoint's experts")
    return types


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[2] /
                                         "tests/fixtures/gptoss-tiny"))
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--keep", help="keep the checkpoints in this folder (default: a temp dir)")
    args = ap.parse_args()
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{LLAMA_CPP}: no convert_hf_to_gguf.py (set LLAMA_CPP)")
    gguf = gguf_module()
    torch.use_deterministic_algorithms(True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp())

    sd, raw = random_weights(args.seed)
    model = make_model(sd)
    # 1. the release's MXFP4 layout, repacked by the converter
    write_mxfp4_checkpoint(work / "mxfp4", sd, raw)
    convert(work / "mxfp4", out / "model-mxfp4.gguf")
    # 2. transformers' own checkpoint (f32 experts)
    f32_ckpt = work / "f32"
    model.save_pretrained(str(f32_ckpt))
    write_byte_tokenizer(f32_ckpt, CONFIG["max_position_embeddings"])
    convert(f32_ckpt, out / "model-f32.gguf")
    types = {name: check_gguf(gguf, out / name, sd)
             for name in ("model-mxfp4.gguf", "model-f32.gguf")}

    # 3. reference runs
    prompt = list(PROMPT)
    tokens = greedy(model, prompt, GENERATE)
    logits, trace, margin, clipped = forward(model, tokens)
    logits64, _, _, _ = forward(make_model(sd, torch.float64), tokens)
    if margin < MIN_ROUTING_MARGIN:
        raise SystemExit(f"seed {args.seed}: routing margin {margin:.2e} < {MIN_ROUTING_MARGIN}: "
                         "pick another --seed")
    if clipped == 0.0:
        raise SystemExit(f"seed {args.seed}: the SwiGLU clamp never clips")

    logits.astype("<f4").tofile(out / "logits.bin")
    (out / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    files = ["model-f32.gguf", "model-mxfp4.gguf", "logits.bin", "trace.jsonl"]
    top2 = np.sort(logits, axis=1)
    meta = {
        "generator": "tools/reference/make_gptoss_fixture.py",
        "seed": args.seed,
        "config": dict(CONFIG, rope_parameters=ROPE,
                       layer_types=hf_config().layer_types),
        "prompt": PROMPT.decode(),
        "prompt_tokens": len(prompt),
        "tokens": tokens,
        "expert_types": types,
        "logits_shape": [len(tokens), CONFIG["vocab_size"]],
        "logits": "raw little-endian f32, row t = logits after tokens 0..t (uncached forward); "
                  "both GGUFs hold the same expert values, so one reference serves both",
        "trace": "JSON Lines {token, layer, experts, weights}, experts by descending router "
                 "logit, weights the softmax over the top-k logits",
        "f32_vs_f64_rel_err": rel_err(logits, logits64),
        "min_routing_margin": margin,
        "swiglu_clipped_fraction": clipped,
        "min_top2_logit_margin": float((top2[:, -1] - top2[:, -2]).min()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "python": platform.python_version(),
                     "llama.cpp": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp"},
        "sha256": {f: sha256(out / f) for f in files},
    }
    (out / "fixture.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in meta.items() if k not in ("config", "sha256")}, indent=1))
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
