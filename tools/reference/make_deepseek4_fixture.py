#!/usr/bin/env python3
"""Builds the deepseek4-tiny correctness fixture: a random-weight DeepSeek-V4 run by Hugging Face
transformers (DeepseekV4ForCausalLM), converted to GGUF by llama.cpp's own converter, and the
logits and routing decisions of every position.

Steps:
  1. Random weights (numpy PCG64, fixed seed) in the original DeepSeek checkpoint layout: the
     names the converter reads (`layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`
     ...), routed experts as MXFP4 (packed e2m1 codes + e8m0 scales, as the release ships them),
     every other weight f32. The checkpoint is written as safetensors + config.json + a byte-level
     tokenizer.json.
  2. The checkpoint is loaded back into transformers' DeepseekV4ForCausalLM (the experts
     dequantised, the names mapped as transformers' own conversion mapping maps them) and every
     parameter and buffer must equal the generated weights bit for bit.
  3. llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python 0.3.36 sdist, --llama-cpp) turns
     the checkpoint into model-mxfp4.gguf. The one patch: the converter identifies a tokenizer by
     hashing its output, and this test tokenizer is unknown to it. Its vocabulary is the 256 bytes
     with no merges, so every pre-tokenizer splits text into the same byte tokens; it is named
     "gpt-2".
  4. Variants of that file: model-f32.gguf (the MXFP4 experts expanded to F32, lossless: same
     logits) and model-q8_0.gguf (experts and the 2-D attention / shared-expert / head weights
     re-encoded as Q8_0; its reference is transformers with those weights dequantised).
  5. transformers (float32, eager) runs the prompt and a greedy continuation token by token with
     its cache, and the whole sequence once without a cache; both must agree. The script refuses a
     seed where a learned router's k-th and (k+1)-th corrected scores, or an indexer's k-th and
     (k+1)-th scores, are closer than a margin (ties make results unspecified).

Needs torch and transformers 5.x and the llama.cpp sdist (not part of CI: outputs are committed).
See README.md.
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_fixture import bytes_to_unicode  # noqa: E402  (GPT-2's byte alphabet)

# The model: every layer type and both MLP types; rates and window small enough that the prompt
# exercises the sliding window, CSA selection (more entries than index_topk) and HCA emits.
LAYERS = 5
# layer: attention type (compress ratio), MLP type
COMPRESS_RATIOS = [8, 4, 0, 4, 8]  # 0 sliding only, 4 CSA (overlapping + indexer), 8 HCA
NUM_HASH_LAYERS = 2
CSA_RATE = 4
HCA_RATE = 8
ORIG = dict(  # the original checkpoint's config.json keys (what the converter reads)
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=2.0,
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=4,
    compress_ratios=COMPRESS_RATIOS,
    compress_rope_theta=160000.0,
    rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32,
                      beta_slow=1),
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    num_hash_layers=NUM_HASH_LAYERS,
    num_nextn_predict_layers=0,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,  # = yarn factor x original context
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
PROMPT = b"DeepSeek-V4 streams experts from NVMe.\n"  # 39 tokens: token id = byte value
GENERATE = 8
DEFAULT_SEED = 3  # seeds 1 and 2 fail the margin checks
MIN_ROUTING_MARGIN = 1e-3  # learned routers: k-th vs (k+1)-th corrected score
MIN_INDEX_MARGIN = 1e-3  # indexer: k-th vs (k+1)-th score (relative to the k-th's magnitude)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
                 -6.0], dtype=np.float32)

LLAMA_CPP = pathlib.Path(os.environ.get(
    "LLAMA_CPP", "/tmp/llsd/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def set_hca_rate(rate):
    global HCA_RATE, COMPRESS_RATIOS
    COMPRESS_RATIOS = [rate if r == HCA_RATE else r for r in COMPRESS_RATIOS]
    HCA_RATE = rate
    ORIG["compress_ratios"] = COMPRESS_RATIOS


def hf_config():
    legacy = {k: v for k, v in ORIG.items() if k not in ("architectures", "model_type", "torch_dtype",
                                                         "rope_scaling", "compress_ratios",
                                                         "num_hash_layers", "qk_rope_head_dim")}
    rs = dict(ORIG["rope_scaling"])
    rs["rope_type"] = rs.pop("type")
    cfg = DeepseekV4Config(
        **legacy,
        compress_ratios=[{HCA_RATE: 128}.get(r, r) for r in COMPRESS_RATIOS],  # types (0/4/128)
        compress_rates={"compressed_sparse_attention": CSA_RATE,
                        "heavily_compressed_attention": HCA_RATE},
        num_hash_layers=NUM_HASH_LAYERS,
        qk_rope_head_dim=ORIG["qk_rope_head_dim"],
        rope_parameters=rs,
    )
    cfg._attn_implementation = "eager"
    assert cfg.compress_rates["heavily_compressed_attention"] == HCA_RATE
    return cfg


def random_checkpoint(seed):
    """Every weight in the original checkpoint layout: name -> numpy (experts as MXFP4 bytes)."""
    rng = np.random.default_rng(seed)
    c = ORIG
    h, v, hd, nh = c["hidden_size"], c["vocab_size"], c["head_dim"], c["num_attention_heads"]
    qlr, og, olr = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    ne, k, ff = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    hc = c["hc_mult"]
    mix = (2 + hc) * hc
    inh, ihd = c["index_n_heads"], c["index_head_dim"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight(n):
        return rng.uniform(0.75, 1.25, n).astype(np.float32)

    def mxfp4(rows, cols, std):
        # e2m1 codes (uniform) times a per-32 power of two near std / 2.5 (the codes' RMS)
        codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
        e0 = int(np.round(np.log2(std / 2.5))) + 127
        scale = (e0 + rng.integers(-1, 2, (rows, cols // 32))).astype(np.uint8)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        return packed, scale

    w = {
        "embed.weight": normal((v, h), 1.0),
        "head.weight": normal((v, h), 2.0 * h**-0.5),
        "norm.weight": norm_weight(h),
        "hc_head_fn": normal((hc, hc * h), 0.1),
        "hc_head_base": normal((hc,), 0.5),
        "hc_head_scale": rng.uniform(0.5, 1.5, 1).astype(np.float32),
    }
    for i in range(LAYERS):
        p = f"layers.{i}."
        ratio = COMPRESS_RATIOS[i]
        w[p + "attn_norm.weight"] = norm_weight(h)
        w[p + "ffn_norm.weight"] = norm_weight(h)
        for site in ("attn", "ffn"):
            w[p + f"hc_{site}_fn"] = normal((mix, hc * h), 0.1)
            w[p + f"hc_{site}_base"] = normal((mix,), 0.5)
            w[p + f"hc_{site}_scale"] = rng.uniform(0.5, 1.5, 3).astype(np.float32)
        w[p + "attn.attn_sink"] = normal((nh,), 1.0)
        w[p + "attn.wq_a.weight"] = normal((qlr, h), h**-0.5)
        w[p + "attn.q_norm.weight"] = norm_weight(qlr)
        w[p + "attn.wq_b.weight"] = normal((nh * hd, qlr), qlr**-0.5)
        w[p + "attn.wkv.weight"] = normal((hd, h), h**-0.5)
        w[p + "attn.kv_norm.weight"] = norm_weight(hd)
        w[p + "attn.wo_a.weight"] = normal((og * olr, nh * hd // og), (nh * hd // og) ** -0.5)
        w[p + "attn.wo_b.weight"] = normal((h, og * olr), (og * olr) ** -0.5)
        if ratio:
            coff = 2 if ratio == CSA_RATE else 1
            q = p + "attn.compressor."
            w[q + "wkv.weight"] = normal((coff * hd, h), h**-0.5)
            w[q + "wgate.weight"] = normal((coff * hd, h), h**-0.5)
            w[q + "ape"] = normal((ratio, coff * hd), 0.5)
            w[q + "norm.weight"] = norm_weight(hd)
            if ratio == CSA_RATE:
                q = p + "attn.indexer."
                w[q + "wq_b.weight"] = normal((inh * ihd, qlr), qlr**-0.5)
                w[q + "weights_proj.weight"] = normal((inh, h), h**-0.5)
                w[q + "compressor.wkv.weight"] = normal((2 * ihd, h), h**-0.5)
                w[q + "compressor.wgate.weight"] = normal((2 * ihd, h), h**-0.5)
                w[q + "compressor.ape"] = normal((ratio, 2 * ihd), 0.5)
                w[q + "compressor.norm.weight"] = norm_weight(ihd)
        w[p + "ffn.gate.weight"] = normal((ne, h), 0.3)
        if i < NUM_HASH_LAYERS:
            w[p + "ffn.gate.tid2eid"] = np.stack(
                [rng.choice(ne, k, replace=False) for _ in range(v)]).astype(np.int64)
        else:
            w[p + "ffn.gate.bias"] = normal((ne,), 0.1)
        for e in range(ne):
            for name, rows, cols, std in (("w1", ff, h, h**-0.5), ("w3", ff, h, h**-0.5),
                                          ("w2", h, ff, ff**-0.5)):
                packed, scale = mxfp4(rows, cols, std)
                w[p + f"ffn.experts.{e}.{name}.weight"] = packed
                w[p + f"ffn.experts.{e}.{name}.scale"] = scale
        w[p + "ffn.shared_experts.w1.weight"] = normal((ff, h), h**-0.5)
        w[p + "ffn.shared_experts.w3.weight"] = normal((ff, h), h**-0.5)
        w[p + "ffn.shared_experts.w2.weight"] = normal((h, ff), ff**-0.5)
    return w


def mxfp4_to_f32(packed, scale):
    rows = packed.shape[0]
    codes = np.empty((rows, packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    s = np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127).astype(np.float32)
    return (E2M1[codes] * np.repeat(s, 32, axis=1)).astype(np.float32)


def to_hf(ckpt):
    """The checkpoint as transformers' state dict (its conversion mapping's renames)."""
    sd = {}
    ren = [
        (".attn_norm.weight", ".input_layernorm.weight"),
        (".ffn_norm.weight", ".post_attention_layernorm.weight"),
        (".hc_attn_fn", ".attn_hc.fn"), (".hc_attn_base", ".attn_hc.base"),
        (".hc_attn_scale", ".attn_hc.scale"), (".hc_ffn_fn", ".ffn_hc.fn"),
        (".hc_ffn_base", ".ffn_hc.base"), (".hc_ffn_scale", ".ffn_hc.scale"),
        (".attn.attn_sink", ".self_attn.sinks"),
        (".attn.wq_a.weight", ".self_attn.q_a_proj.weight"),
        (".attn.q_norm.weight", ".self_attn.q_a_norm.weight"),
        (".attn.wq_b.weight", ".self_attn.q_b_proj.weight"),
        (".attn.wkv.weight", ".self_attn.kv_proj.weight"),
        (".attn.kv_norm.weight", ".self_attn.kv_norm.weight"),
        (".attn.wo_a.weight", ".self_attn.o_a_proj.weight"),
        (".attn.wo_b.weight", ".self_attn.o_b_proj.weight"),
        (".attn.compressor.wkv.weight", ".self_attn.compressor.kv_proj.weight"),
        (".attn.compressor.wgate.weight", ".self_attn.compressor.gate_proj.weight"),
        (".attn.compressor.ape", ".self_attn.compressor.position_bias"),
        (".attn.compressor.norm.weight", ".self_attn.compressor.kv_norm.weight"),
        (".attn.indexer.wq_b.weight", ".self_attn.compressor.indexer.q_b_proj.weight"),
        (".attn.indexer.weights_proj.weight",
         ".self_attn.compressor.indexer.scorer.weights_proj.weight"),
        (".attn.indexer.compressor.wkv.weight", ".self_attn.compressor.indexer.kv_proj.weight"),
        (".attn.indexer.compressor.wgate.weight", ".self_attn.compressor.indexer.gate_proj.weight"),
        (".attn.indexer.compressor.ape", ".self_attn.compressor.indexer.position_bias"),
        (".attn.indexer.compressor.norm.weight", ".self_attn.compressor.indexer.kv_norm.weight"),
        (".ffn.gate.weight", ".mlp.gate.weight"),
        (".ffn.gate.bias", ".mlp.gate.e_score_correction_bias"),
        (".ffn.gate.tid2eid", ".mlp.gate.tid2eid"),
        (".ffn.shared_experts.w1.weight", ".mlp.shared_experts.gate_proj.weight"),
        (".ffn.shared_experts.w2.weight", ".mlp.shared_experts.down_proj.weight"),
        (".ffn.shared_experts.w3.weight", ".mlp.shared_experts.up_proj.weight"),
    ]
    root = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
            "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
            "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
    for name, a in ckpt.items():
        if name in root:
            sd[root[name]] = torch.from_numpy(np.array(a))
            continue
        if ".ffn.experts." in name:
            continue
        i, rest = name.split(".", 2)[1], "." + name.split(".", 2)[2]
        for src, dst in ren:
            if rest == src:
                sd[f"model.layers.{i}{dst}"] = torch.from_numpy(np.array(a))
                break
        else:
            raise KeyError(f"no transformers name for {name}")
    ne = ORIG["n_routed_experts"]
    for i in range(LAYERS):
        p = f"layers.{i}.ffn.experts."

        def deq(e, n):
            return mxfp4_to_f32(ckpt[p + f"{e}.{n}.weight"], ckpt[p + f"{e}.{n}.scale"])

        gate_up = np.stack([np.concatenate([deq(e, "w1"), deq(e, "w3")], 0) for e in range(ne)])
        down = np.stack([deq(e, "w2") for e in range(ne)])
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.from_numpy(gate_up)
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.from_numpy(down)
    return sd


def load_model(sd):
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM._from_config(hf_config(), attn_implementation="eager",
                                               experts_implementation="eager").float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # Non-persistent buffers (rotary inv_freq) are not in a state dict.
    missing = [m for m in missing if "inv_freq" not in m]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return model


def check_bit_identical(model, sd):
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    for name, t in sd.items():
        mine = own[name]
        if mine.dtype != t.dtype and not (mine.dtype == torch.long and t.dtype == torch.int64):
            raise SystemExit(f"{name}: dtype {mine.dtype} != {t.dtype}")
        if not torch.equal(mine.detach().to(t.dtype), t):
            raise SystemExit(f"{name}: transformers did not load the checkpoint bit-identically")


def write_byte_tokenizer(d, max_len):
    """tokenizer.json / tokenizer_config.json: byte-level BPE, token b is byte b (GPT-2's byte
    alphabet), no merges; bos is byte 0, eos byte 1. Shared by the deepseek3 and gpt-oss scripts."""
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    (d / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": alphabet[0],
        "eos_token": alphabet[1], "add_bos_token": False, "add_eos_token": False,
        "model_max_length": max_len}))


def write_checkpoint(ckpt, d):
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, a in ckpt.items():
        t = torch.from_numpy(np.ascontiguousarray(a))
        if name.endswith(".scale") and ".experts." in name:
            t = t.view(torch.float8_e8m0fnu)  # the release's dtype for MXFP4 scales
        elif name.endswith(".weight") and ".experts." in name:
            t = t.view(torch.int8)  # packed e2m1 pairs, as released
        tensors[name] = t
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(ORIG, indent=2))
    write_byte_tokenizer(d, ORIG["max_position_embeddings"])


def read_checkpoint(d):
    out = {}
    for name, t in load_file(str(d / "model.safetensors")).items():
        if t.dtype in (torch.float8_e8m0fnu, torch.int8):
            t = t.view(torch.uint8)
        out[name] = t.numpy()
    return out


CONVERT_WRAPPER = """
import runpy, sys
sys.path.insert(0, {root!r})
sys.path.insert(1, {root!r} + "/gguf-py")
from conversion import base
# The test tokenizer is byte-level with no merges: every pre-tokenizer gives the same tokens.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# transformers labels layers by ratio 0/4/128 only; this tiny model's HCA ratio is {hca}.
from transformers.models.deepseek_v4 import configuration_deepseek_v4 as c
c._COMPRESS_RATIO_TO_LAYER_TYPE[{hca}] = "heavily_compressed_attention"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path({root!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(ckpt_dir, out):
    wrapper = ckpt_dir.parent / "convert_wrapper.py"
    wrapper.write_text(CONVERT_WRAPPER.format(root=str(LLAMA_CPP), hca=HCA_RATE))
    subprocess.run([sys.executable, str(wrapper), str(ckpt_dir), "--outfile", str(out),
                    "--outtype", "f32"], check=True)


def gguf_module():
    sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
    import gguf  # the vendored gguf-py: it knows deepseek4's keys
    return gguf


def rewrite_gguf(gguf, src, dst, recode, extra=None):
    """Copies src to dst with each tensor passed through recode(name, type, array) -> (array,
    raw_dtype or None), adding the string-array keys in `extra`."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    w = gguf.GGUFWriter(str(dst), arch)
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(field.name, val, vt, sub_type=sub)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(field.name, bytes(field.parts[field.data[0]]).decode("utf-8"), vt)
        else:
            w.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], vt)
    for key, val in (extra or {}).items():
        w.add_key_value(key, val, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    for t in r.tensors:
        a = np.array(t.data)
        new, raw = recode(t.name, t.tensor_type, a)
        if raw is None:
            w.add_tensor(t.name, np.ascontiguousarray(new))
        else:
            w.add_tensor(t.name, np.ascontiguousarray(new), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


Q8_DENSE = ("attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight",
            "attn_output_b.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
            "ffn_down_shexp.weight", "output.weight", "indexer.attn_q_b.weight")


def run_sequence(model, tokens):
    """Cached token-by-token logits, and an uncached forward over all of them."""
    cache = None
    rows = []
    with torch.no_grad():
        for t in tokens:
            out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].float().numpy())
        full = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()
    return np.stack(rows), full


def greedy(model, prompt, n):
    tokens = list(prompt)
    cache = None
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=True)
        for _ in range(n):
            nxt = int(out.logits[0, -1].argmax())
            tokens.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens


def margins_and_routes(model, tokens):
    """Runs the uncached forward with hooks: the routing of every (token, layer), the smallest
    learned-router margin and the smallest indexer top-k margin."""
    cfg = model.config
    k, topk = cfg.num_experts_per_tok, cfg.index_topk
    routes = {}
    state = {"route": 1.0, "index": 1.0, "index_checked": 0}
    hooks = []
    ids = torch.tensor([tokens])

    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def on_gate(mod, inputs, output, i=i):
            logits, weights, indices = output
            scores = mod.score_fn(logits)
            if hasattr(mod, "e_score_correction_bias"):
                corr = (scores + mod.e_score_correction_bias).detach().numpy()
                srt = -np.sort(-corr, axis=1)
                state["route"] = min(state["route"], float((srt[:, k - 1] - srt[:, k]).min()))
            for t in range(indices.shape[0]):
                order = np.argsort(-weights[t].detach().numpy(), kind="stable")
                routes[(t, i)] = ([int(indices[t, j]) for j in order],
                                  [float(weights[t, j]) for j in order])
        hooks.append(gate.register_forward_hook(on_gate))
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            m = comp.indexer.compress_rate

            def on_scores(mod, inputs, output, m=m):
                sc = output[0].detach().numpy()  # [S, T]
                for t in range(sc.shape[0]):
                    valid = (t + 1) // m
                    if valid <= topk:
                        continue
                    srt = -np.sort(-sc[t, :valid])
                    gap = (srt[topk - 1] - srt[topk]) / max(abs(srt[topk - 1]), 1e-30)
                    state["index"] = min(state["index"], float(gap))
                    state["index_checked"] += 1
            hooks.append(comp.indexer.scorer.register_forward_hook(on_scores))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    records = []
    for t in range(len(tokens)):
        for i in range(len(model.model.layers)):
            e, w = routes[(t, i)]
            records.append({"token": t, "layer": i, "experts": e,
                            "weights": [round(x, 7) for x in w]})
    return records, state


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def q8_0_dequant(gguf, a):
    q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    return q, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[2] /
                                         "tests/fixtures/deepseek4-tiny"))
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--keep", help="keep the checkpoint in this folder (default: a temp dir)")
    ap.add_argument("--hca-rate", type=int, default=HCA_RATE,
                    help="the HCA layers' compress ratio (8; llama.cpp loads only 128, which a "
                         "47-token sequence never fills: check_deepseek4_llama_cpp.py uses it)")
    args = ap.parse_args()
    set_hca_rate(args.hca_rate)
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{LLAMA_CPP}: no convert_hf_to_gguf.py (set LLAMA_CPP to the sdist's "
                         "vendor/llama.cpp)")
    gguf = gguf_module()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp())
    ckpt_dir = work / "checkpoint"

    # 1-2. checkpoint, loaded back bit-identically
    ckpt = random_checkpoint(args.seed)
    write_checkpoint(ckpt, ckpt_dir)
    sd = to_hf(read_checkpoint(ckpt_dir))
    model = load_model(sd)
    check_bit_identical(model, to_hf(ckpt))
    print("checkpoint: transformers loads it back bit-identically")

    # 3. llama.cpp's converter
    mx = out / "model-mxfp4.gguf"
    convert(ckpt_dir, mx)

    # 4. variants
    def expand(name, ttype, a):
        if ttype == gguf.GGMLQuantizationType.MXFP4:
            return gguf.quants.dequantize(a, ttype).astype(np.float32), None
        return a, (None if ttype in (gguf.GGMLQuantizationType.F32,) else ttype)

    rewrite_gguf(gguf, mx, out / "model-f32.gguf", expand)
    q8_values = {}

    def to_q8(name, ttype, a):
        if ttype == gguf.GGMLQuantizationType.MXFP4:
            a = gguf.quants.dequantize(a, ttype).astype(np.float32)
            ttype = gguf.GGMLQuantizationType.F32
        if ttype == gguf.GGMLQuantizationType.F32 and (
                "_exps." in name or name.endswith(Q8_DENSE)) and a.shape[-1] % 32 == 0:
            q, deq = q8_0_dequant(gguf, a)
            q8_values[name] = deq
            return q, gguf.GGMLQuantizationType.Q8_0
        return a, (None if ttype == gguf.GGMLQuantizationType.F32 else ttype)

    rewrite_gguf(gguf, mx, out / "model-q8_0.gguf", to_q8)

    # 5. reference runs
    prompt = list(PROMPT)
    tokens = greedy(model, prompt, GENERATE)
    cached, full = run_sequence(model, tokens)
    cache_err = rel_err(cached, full)
    trace, margins = margins_and_routes(model, tokens)
    if margins["route"] < MIN_ROUTING_MARGIN or margins["index"] < MIN_INDEX_MARGIN:
        raise SystemExit(f"seed {args.seed}: margins {margins} below the limits; try another seed")
    if cache_err > 1e-5:
        raise SystemExit(f"cached and uncached transformers disagree ({cache_err:.2e})")
    with torch.no_grad():
        f64 = DeepseekV4ForCausalLM._from_config(hf_config(), attn_implementation="eager",
                                                 experts_implementation="eager").double().eval()
        f64.load_state_dict({k: (v.double() if v.is_floating_point() else v) for k, v in sd.items()},
                            strict=False)
        full64 = f64(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].numpy()

    # the q8_0 reference: the same model with the re-encoded weights dequantised
    gg2hf = {}
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        gg2hf.update({b + "attn_q_a.weight": p + "self_attn.q_a_proj.weight",
                      b + "attn_q_b.weight": p + "self_attn.q_b_proj.weight",
                      b + "attn_kv.weight": p + "self_attn.kv_proj.weight",
                      b + "attn_output_a.weight": p + "self_attn.o_a_proj.weight",
                      b + "attn_output_b.weight": p + "self_attn.o_b_proj.weight",
                      b + "ffn_gate_shexp.weight": p + "mlp.shared_experts.gate_proj.weight",
                      b + "ffn_up_shexp.weight": p + "mlp.shared_experts.up_proj.weight",
                      b + "ffn_down_shexp.weight": p + "mlp.shared_experts.down_proj.weight",
                      b + "indexer.attn_q_b.weight":
                          p + "self_attn.compressor.indexer.q_b_proj.weight"})
    gg2hf["output.weight"] = "lm_head.weight"
    sd_q8 = dict(sd)
    for name, deq in q8_values.items():
        if "_exps." in name:
            continue
        if name not in gg2hf:
            raise SystemExit(f"no transformers name for the q8_0 tensor {name}")
        tgt = gg2hf[name]
        sd_q8[tgt] = torch.from_numpy(deq.reshape(sd[tgt].shape))
    for i in range(LAYERS):
        g = q8_values[f"blk.{i}.ffn_gate_exps.weight"]
        u = q8_values[f"blk.{i}.ffn_up_exps.weight"]
        d = q8_values[f"blk.{i}.ffn_down_exps.weight"]
        sd_q8[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.from_numpy(
            np.concatenate([g, u], axis=1))
        sd_q8[f"model.layers.{i}.mlp.experts.down_proj"] = torch.from_numpy(d)
    model_q8 = load_model(sd_q8)
    cached_q8, full_q8 = run_sequence(model_q8, tokens)
    tokens_q8 = greedy(model_q8, prompt, GENERATE)
    trace_q8, margins_q8 = margins_and_routes(model_q8, tokens)
    if margins_q8["route"] < MIN_ROUTING_MARGIN or margins_q8["index"] < MIN_INDEX_MARGIN:
        raise SystemExit(f"seed {args.seed}: q8_0 margins {margins_q8} below the limits")

    full.astype("<f4").tofile(out / "logits-f32.bin")
    full_q8.astype("<f4").tofile(out / "logits-q8_0.bin")
    for name, records in (("trace-f32.jsonl", trace), ("trace-q8_0.jsonl", trace_q8)):
        with open(out / name, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    files = ["model-mxfp4.gguf", "model-f32.gguf", "model-q8_0.gguf", "logits-f32.bin",
             "logits-q8_0.bin", "trace-f32.jsonl", "trace-q8_0.jsonl"]
    logit_sorted = np.sort(full, axis=1)
    meta = {
        "generator": "tools/reference/make_deepseek4_fixture.py",
        "seed": args.seed,
        "config": ORIG,
        "compress_rates": {"csa": CSA_RATE, "hca": HCA_RATE},
        "prompt": PROMPT.decode(),
        "prompt_tokens": len(prompt),
        "tokens": tokens,
        "greedy_q8_0": tokens_q8,
        "vocab": 256,
        "logits_shape": [len(tokens), 256],
        "logits": "row t = logits after tokens 0..t (the uncached forward; the cached one agrees)",
        "cached_vs_uncached_rel_err": cache_err,
        "cached_vs_uncached_rel_err_q8_0": rel_err(cached_q8, full_q8),
        "f32_vs_f64_rel_err": rel_err(full, full64),
        "q8_0_vs_f32_rel_err": rel_err(full_q8, full),
        "min_routing_margin": margins["route"],
        "min_indexer_margin": margins["index"],
        "indexer_selections_checked": margins["index_checked"],
        "min_routing_margin_q8_0": margins_q8["route"],
        "min_indexer_margin_q8_0": margins_q8["index"],
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
