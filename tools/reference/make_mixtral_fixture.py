#!/usr/bin/env python3
"""Builds the mixtral-tiny correctness fixture: a random-weight Mixtral (transformers'
MixtralForCausalLM) with a SentencePiece tokenizer, converted by llama.cpp's own
convert_hf_to_gguf.py (arch `llama` with merged `ffn_*_exps` experts, q/k permuted for NORM RoPE),
and transformers' logits, greedy tokens and routing.

  1. A SentencePiece BPE tokenizer (sentencepiece, byte fallback, 512 pieces) trained on the
     ASCII-ish strings of tests/fixtures/tokenizers/corpus.json, with the tokenizer.json
     transformers writes for Mixtral-8x7B (Prepend/Replace normaliser, merges from the scores).
  2. Weights from numpy's PCG64 loaded into MixtralForCausalLM, saved with save_pretrained (the
     original `block_sparse_moe.experts.N.w{1,2,3}` names) and loaded back bit for bit.
  3. convert_hf_to_gguf.py --outtype f32 -> model-f32.gguf; model-q8_0.gguf is the same file with
     the routed experts re-encoded as Q8_0 by gguf-py.
  4. transformers (float32, eager) runs the prompt and a greedy continuation (with the KV cache);
     the logits of the whole sequence come from one uncached forward; the q8_0 reference runs on
     the dequantised experts.

    /tmp/refvenv/bin/python tools/reference/make_mixtral_fixture.py   # -> tests/fixtures/mixtral-tiny

Needs torch, transformers, sentencepiece, tokenizers and llama.cpp's tree (LLAMA_CPP).
"""

import argparse
import io
import json
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import sentencepiece
import tokenizers
import torch
import transformers
from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_deepseek4_fixture import (LLAMA_CPP, greedy, gguf_module, q8_0_dequant,  # noqa: E402
                                    rel_err, rewrite_gguf, sha256)
from make_tokenizer_fixtures import spm_tokenizer  # noqa: E402

CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
ROPE_THETA = 1e6
HEAD_DIM = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
PROMPT = "Mixtral streams 8 experts from NVMe: ünïcode, spaces  and\ttabs."
GENERATE = 8
# Strings whose HF tokenization the engine must reproduce (spaces, digits, unicode through byte
# fallback, special-token text, newlines).
TOKENIZE = [PROMPT, "", " ", "  leading and trailing  ", "x = 1234567 + 89;", "日本語のテキスト",
            "emoji 👋🏽 and é/e\u0301", "<s>inside</s> text", "line one\nline two\r\n",
            "tab\there", "Hello world", "ALLCAPS MixedCASE iPhone"]
# Seeds 1..24 were tried; 19 is one of the two with every routing margin above 1e-3 (2.5e-3).
DEFAULT_SEED = 19
# The k-th and (k+1)-th router probabilities of every (token, layer) must differ by this much.
MIN_ROUTING_MARGIN = 1e-3


def train_tokenizer(ckpt):
    """tokenizer.model (SentencePiece BPE) and Mixtral's tokenizer.json / tokenizer_config.json."""
    root = pathlib.Path(__file__).resolve().parents[2]
    corpus = json.loads((root / "tests/fixtures/tokenizers/corpus.json").read_text())
    text = [s for s in corpus if s.strip() and all(ord(c) < 0x180 for c in s)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=CONFIG["vocab_size"],
        model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2)
    (ckpt / "tokenizer.model").write_bytes(model.getvalue())
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    scores = [sp.get_score(i) for i in range(sp.vocab_size())]
    tok = spm_tokenizer(pieces, scores)
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "legacy": True, "tokenizer_class": "LlamaTokenizer",
        "clean_up_tokenization_spaces": False}, indent=2))
    return tok


def random_weights(seed):
    """transformers' parameters as f32 numpy from PCG64. Scales keep activations O(1), routing
    decisive (router logits with a std of about 2) and the logits spread."""
    rng = np.random.default_rng(seed)
    c = CONFIG
    h, nh, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    ne, ff, vocab = c["num_local_experts"], c["intermediate_size"], c["vocab_size"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight(n):
        return rng.uniform(0.75, 1.25, n).astype(np.float32)

    sd = {"model.embed_tokens.weight": normal((vocab, h), 1.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_weight(h)
        sd[p + "self_attn.q_proj.weight"] = normal((nh * HEAD_DIM, h), h**-0.5)
        sd[p + "self_attn.k_proj.weight"] = normal((nkv * HEAD_DIM, h), h**-0.5)
        sd[p + "self_attn.v_proj.weight"] = normal((nkv * HEAD_DIM, h), h**-0.5)
        sd[p + "self_attn.o_proj.weight"] = normal((h, nh * HEAD_DIM), (nh * HEAD_DIM)**-0.5)
        sd[p + "post_attention_layernorm.weight"] = norm_weight(h)
        sd[p + "mlp.gate.weight"] = normal((ne, h), 0.25)
        gate, up = normal((ne, ff, h), h**-0.5), normal((ne, ff, h), h**-0.5)
        sd[p + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)  # gate rows first
        sd[p + "mlp.experts.down_proj"] = normal((ne, h, ff), ff**-0.5)
    sd["model.norm.weight"] = norm_weight(h)
    sd["lm_head.weight"] = normal((vocab, h), 2.0 * h**-0.5)
    return sd


def hf_config():
    return MixtralConfig(**CONFIG, rope_parameters={"rope_type": "default",
                                                    "rope_theta": ROPE_THETA})


def make_model(sd, dtype=torch.float32):
    model = MixtralForCausalLM._from_config(hf_config(), attn_implementation="eager",
                                            experts_implementation="eager")
    own = model.state_dict()
    if set(own) != set(sd):
        raise SystemExit(f"state dict mismatch: {sorted(set(own) ^ set(sd))}")
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()})
    return model.to(dtype).eval()


def forward(model, tokens):
    """Uncached logits of every position, and the routing of every (token, layer)."""
    router = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def on_gate(_m, _inp, out, i=i):
            router[i] = out[0].detach().double().numpy().copy()
        hooks.append(layer.mlp.gate.register_forward_hook(on_gate))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    for hk in hooks:
        hk.remove()
    k = CONFIG["num_experts_per_tok"]
    records, margin = [], 1.0
    for t in range(len(tokens)):
        for layer in range(len(router)):
            rl = router[layer][t]
            p = np.exp(rl - rl.max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            margin = min(margin, p[order[k - 1]] - p[order[k]])
            top = p[order[:k]] / p[order[:k]].sum()
            records.append({"token": t, "layer": layer, "experts": [int(e) for e in order[:k]],
                            "weights": [round(float(x), 7) for x in top]})
    return logits.double().numpy(), records, margin


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[2] /
                                         "tests/fixtures/mixtral-tiny"))
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--keep", help="keep the checkpoint in this folder (default: a temp dir)")
    args = ap.parse_args()
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{LLAMA_CPP}: no convert_hf_to_gguf.py (set LLAMA_CPP)")
    gguf = gguf_module()
    torch.use_deterministic_algorithms(True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp())
    ckpt = work / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)

    # 1. tokenizer. The reference is tokenizer.json as Mixtral-8x7B ships it (run by tokenizers).
    # transformers 5.17's LlamaTokenizer replaces that pipeline with its own Metaspace
    # (prepend_scheme "always": no second ▁ before text that starts with a space), so where it
    # differs its ids are recorded too ("ids_transformers"); on the prompt both must agree.
    tok = train_tokenizer(ckpt)
    auto = AutoTokenizer.from_pretrained(str(ckpt))
    tokenized = []
    for s in TOKENIZE:
        ids = tok.encode(s, add_special_tokens=True).ids
        # HF's decoding of the ids after BOS, special tokens kept as text.
        entry = {"text": s, "ids": ids, "decoded": tok.decode(ids[1:], skip_special_tokens=False)}
        if auto(s)["input_ids"] != ids:
            entry["ids_transformers"] = auto(s)["input_ids"]
        tokenized.append(entry)
    if "ids_transformers" in tokenized[0]:
        raise SystemExit("transformers and tokenizers disagree on the prompt")

    # 2. weights, saved and loaded back
    sd = random_weights(args.seed)
    model = make_model(sd)
    model.save_pretrained(str(ckpt))
    back = MixtralForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    for k, v in back.state_dict().items():
        if not np.array_equal(v.numpy(), sd[k]):
            raise SystemExit(f"{k}: the saved checkpoint does not load back bit for bit")

    # 3. llama.cpp's converter, then the q8_0 experts
    f32_path = out / "model-f32.gguf"
    subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(ckpt),
                    "--outfile", str(f32_path), "--outtype", "f32"], check=True)
    q8 = {}

    def experts_q8(name, ttype, a):
        if "_exps." in name:
            q, deq = q8_0_dequant(gguf, a)
            q8[name] = deq
            return q, gguf.GGMLQuantizationType.Q8_0
        return a, None

    rewrite_gguf(gguf, f32_path, out / "model-q8_0.gguf", experts_q8)

    # 4. reference runs
    prompt = tok.encode(PROMPT, add_special_tokens=True).ids
    tokens = greedy(model, prompt, GENERATE)
    logits, trace, margin = forward(model, tokens)
    logits64, _, _ = forward(make_model(sd, torch.float64), tokens)
    sd_q8 = dict(sd)
    for i in range(CONFIG["num_hidden_layers"]):
        b, p = f"blk.{i}.", f"model.layers.{i}.mlp.experts."
        sd_q8[p + "gate_up_proj"] = np.concatenate(
            [q8[b + "ffn_gate_exps.weight"], q8[b + "ffn_up_exps.weight"]], axis=1)
        sd_q8[p + "down_proj"] = q8[b + "ffn_down_exps.weight"]
    model_q8 = make_model(sd_q8)
    tokens_q8 = greedy(model_q8, prompt, GENERATE)
    logits_q8, trace_q8, margin_q8 = forward(model_q8, tokens)
    if min(margin, margin_q8) < MIN_ROUTING_MARGIN:
        raise SystemExit(f"seed {args.seed}: routing margin {min(margin, margin_q8):.2e} < "
                         f"{MIN_ROUTING_MARGIN}: pick another --seed")

    logits.astype("<f4").tofile(out / "logits-f32.bin")
    logits_q8.astype("<f4").tofile(out / "logits-q8_0.bin")
    for name, records in (("trace-f32.jsonl", trace), ("trace-q8_0.jsonl", trace_q8)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    files = ["model-f32.gguf", "model-q8_0.gguf", "logits-f32.bin", "logits-q8_0.bin",
             "trace-f32.jsonl", "trace-q8_0.jsonl"]
    top2 = np.sort(logits, axis=1)
    meta = {
        "generator": "tools/reference/make_mixtral_fixture.py",
        "seed": args.seed,
        "config": dict(CONFIG, rope_theta=ROPE_THETA, head_dim=HEAD_DIM),
        "prompt": PROMPT,
        "prompt_tokens": len(prompt),
        "tokens": tokens,
        "greedy_q8_0": tokens_q8,
        "tokenized": tokenized,
        "logits_shape": [len(tokens), CONFIG["vocab_size"]],
        "logits": "raw little-endian f32, row t = logits after tokens 0..t (uncached forward)",
        "trace": "JSON Lines {token, layer, experts, weights}, experts by descending "
                 "probability, weights renormalised over the top-k",
        "f32_vs_f64_rel_err": rel_err(logits, logits64),
        "q8_0_vs_f32_rel_err": rel_err(logits_q8, logits),
        "min_routing_margin": margin,
        "min_routing_margin_q8_0": margin_q8,
        "min_top2_logit_margin": float((top2[:, -1] - top2[:, -2]).min()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__,
                     "sentencepiece": sentencepiece.__version__, "numpy": np.__version__,
                     "python": platform.python_version(),
                     "llama.cpp": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp"},
        "sha256": {f: sha256(out / f) for f in files},
    }
    (out / "fixture.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in meta.items() if k not in ("config", "sha256", "tokenized")},
                     indent=1))
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
