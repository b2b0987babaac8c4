#!/usr/bin/env python3
"""Reference tokenizers for engine/tokenizer: small byte-level BPE tokenizers trained with Hugging
Face `tokenizers`, one per model family's pre-tokenizer, written into GGUFs as llama.cpp's
converter writes them, with a fixed corpus and HF's encodings of it.

    /tmp/refvenv/bin/python tools/reference/make_tokenizer_fixtures.py \
        --gguf-py /tmp/llsd/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py \
        --out tests/fixtures/tokenizers

Needs `tokenizers` (0.23 here) and llama.cpp's gguf-py. Writes:
  corpus.json            the test strings (>= 10,000), a JSON list
  <name>.gguf            the vocabulary only (no tensors): tokenizer.ggml.{model,pre,tokens,
                         token_type,merges,bos_token_id,eos_token_id,add_bos_token}; for
                         mixtral (SentencePiece, model "llama") scores instead of merges
  <name>.json            {"pre": ..., "ids": HF's ids of every corpus string without special
                         tokens, "ids_special": the first N strings with add_special_tokens,
                         "decoded": {index: HF's decode} where that is not the string (NFC)}

The pre-tokenizer patterns are those of each model's published tokenizer.json (public data).
Everything is seeded: the same versions give the same files.
"""

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
                 r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"""
                  r"""\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
GPT4O_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                 r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi-K2's tokenization_kimi.py (tiktoken; Oniguruma, like tiktoken's regex, has class
# intersection).
KIMI_K2_PATTERN = (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
                   r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}"
                   r"\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&"
                   r"[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                   r"\s*[\r\n]+|\s+(?!\S)|\s+")
DSV3_PATTERNS = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"""
     r""" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
]


def split(pattern):
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def byte_level_after_split():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)


# name, tokenizer.ggml.pre, pre-tokenizer, normalizer, special tokens, bos, eos, add_bos,
# ignore_merges (llama3's tokenizer.json sets it)
FAMILIES = [
    dict(name="gpt2", pre="gpt-2",
         pre_tokenizer=lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
         normalizer=None, specials=["<|endoftext|>"], bos="<|endoftext|>", eos="<|endoftext|>",
         add_bos=False, ignore_merges=False),
    dict(name="qwen2", pre="qwen2",
         pre_tokenizer=lambda: pre_tokenizers.Sequence([split(QWEN2_PATTERN),
                                                        byte_level_after_split()]),
         normalizer=normalizers.NFC,
         specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos="<|endoftext|>",
         eos="<|im_end|>", add_bos=False, ignore_merges=False),
    dict(name="llama3", pre="llama-bpe",
         pre_tokenizer=lambda: pre_tokenizers.Sequence([split(LLAMA3_PATTERN),
                                                        byte_level_after_split()]),
         normalizer=None,
         specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"],
         bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True, ignore_merges=True),
    dict(name="deepseek-v3", pre="deepseek-v3",
         pre_tokenizer=lambda: pre_tokenizers.Sequence([split(p) for p in DSV3_PATTERNS] +
                                                       [byte_level_after_split()]),
         normalizer=None,
         specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                   "<｜Assistant｜>", "<think>", "</think>"],
         bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", add_bos=True,
         ignore_merges=False),
    # GLM-4.5: Llama 3's split with ignore_merges, no BOS added (llama.cpp's glm4).
    dict(name="glm4", pre="glm4",
         pre_tokenizer=lambda: pre_tokenizers.Sequence([split(LLAMA3_PATTERN),
                                                        byte_level_after_split()]),
         normalizer=None,
         specials=["<|endoftext|>", "[MASK]", "[gMASK]", "<sop>", "<eop>", "<|system|>",
                   "<|user|>", "<|assistant|>", "<|observation|>"],
         bos="[gMASK]", eos="<|endoftext|>", add_bos=False, ignore_merges=True),
    # gpt-oss: o200k_harmony's split (llama.cpp's gpt-4o), no BOS added.
    dict(name="gpt-oss", pre="gpt-4o",
         pre_tokenizer=lambda: pre_tokenizers.Sequence([split(GPT4O_PATTERN),
                                                        byte_level_after_split()]),
         normalizer=None,
         specials=["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|start|>", "<|end|>",
                   "<|message|>", "<|channel|>", "<|call|>", "<|constrain|>"],
         bos="<|startoftext|>", eos="<|return|>", add_bos=False, ignore_merges=False),
    # Kimi-K2 (deepseek2): tiktoken, so a pre-token that is a token is taken whole.
    dict(name="kimi-k2", pre="kimi-k2",
         pre_tokenizer=lambda: pre_tokenizers.Sequence([split(KIMI_K2_PATTERN),
                                                        byte_level_after_split()]),
         normalizer=None,
         specials=["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                   "<|im_system|>", "<|im_middle|>"],
         bos="[BOS]", eos="[EOS]", add_bos=False, ignore_merges=True),
]

WORDS = ("the of and to in is was for that on with as by at from it an be this are or have not "
         "but which you they we their one all were there can been has more if will would about "
         "tokenizer engine expert daemon cache model layer token vocabulary Hello World OK HTTP "
         "naïve café résumé Zürich façade coöperate São Paulo Ñandú Ångström").split()
CONTRACTIONS = ["don't", "I'm", "you're", "we've", "they'll", "she'd", "it's", "DON'T", "I'M",
                "YOU'RE", "WE'VE", "THEY'LL", "SHE'D", "IT'S", "y'all", "'tis", "o'clock",
                "rock'n'roll", "Mc'Donald", "l'homme", "'S", "'s", "'ſ", "can't", "won't"]
CODE = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
        "if x == None: pass", "#include <stdio.h>\nint main(void) { return 0; }",
        "let v: Vec<u8> = vec![0xff, 0x00];", "SELECT * FROM t WHERE id = 42;",
        "fn main() { println!(\"{}\", 1 + 2); }", "x = [i ** 2 for i in range(10)]",
        "a->b = c && d || !e;", "<div class=\"x\">&nbsp;</div>", "$ ls -la | grep '^d'",
        "std::vector<std::string> v{\"a\", \"b\"};", "  \t  indented\t\ttabs", "//comment\r\n",
        "0x1F600 0b1010 1e-9 3.14159 -273.15 1_000_000", "camelCaseName snake_case_name",
        "ALLCAPS MixedCASE iPhone eBay", "url: https://example.com/a?b=c&d=e#f"]
CJK = ["你好，世界！", "自然语言处理", "東京都は日本の首都です。", "ひらがな カタカナ ｶﾀｶﾅ",
       "한국어 텍스트입니다", "中文English混合123", "《红楼梦》第一回", "龥龦𠀀𪚥", "ㄅㄆㄇ",
       "「引用」と『二重』", "１２３４５６ ＡＢＣ ａｂｃ", "漢字かな交じり文"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇩🇪🇯🇵", "🤖💬", "✨🎉🎊", "☕", "🧑🏿‍💻",
         "1️⃣", "#️⃣", "🫠"]
COMBINING = ["e\u0301", "a\u0308", "n\u0303o", "Z\u0335\u0321a\u0336l\u0337g\u0338o",
             "\u0915\u093f", "\u0e01\u0e34\u0e48", "o\u0302\u0323", "A\u030a", "\u1100\u1161",
             "q\u0307\u0323", "i\u0307", "\u0301leading", "ﬁ ﬂ Ⅻ ½ ²"]
RTL = ["مرحبا بالعالم", "שלום עולם", "العربية 123 English", "\u200fRTL mark\u200e",
       "فارسی‌نویسی", "עִבְרִית", "ا ل ع ر ب ي ة"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n ", "\u00a0", "\u3000",
          "\u2003", "\u2009", "\u200b", "\u2028", "\u0085", "\u000b", "\u000c", "    ",
          "\t\t\n", " \t \n", "\n   \n"]
DIGITS = ["0", "7", "42", "123", "1234", "12345", "1234567890", "3.14", "1,000,000", "2026-12-01",
          "٣٤٥", "१२३", "Ⅳ", "½", "²³", "①②", "007", "99.9%", "-5", "+1e10"]
PUNCT = [".", ",", "!", "?", "...", "—", "–", "-", "(", ")", "[", "]", "{", "}", "\"", "'", "`",
         ":", ";", "@", "#", "$", "%", "^", "&", "*", "_", "=", "+", "|", "\\", "/", "<", ">",
         "~", "«", "»", "„", "‘", "’", "“", "”", "…", "·", "¿", "¡", "§", "¶", "©", "®", "™", "€",
         "£", "¥", "°", "±", "×", "÷", "→", "∑", "∞", "≠", "√", "♪", "★", "\x00", "\x7f", "\x1b"]
MISC = ["Ω Ωmega ΣΊΣΥΦΟΣ ελληνικά", "Привет, мир!", "ǅungla ǈj ǋ", "İstanbul ıI", "ß ẞ straße",
        "K (Kelvin) Å (Angstrom)", "Ꭰ Ꮳ", "ſtraße", "\ufeffBOM", "tab\there", "ok\x00nul"]
# In the test corpus only (never trained on): llama3 gets "Ġqqjx" as a token that no merge makes.
UNTRAINED = [" qqjx", "qqjx", "a qqjx qqjxqqjx", "Qqjx qqjx.", " qqj", " qqjxx"]


def pieces_for(specials):
    groups = [WORDS, CONTRACTIONS, CODE, CJK, EMOJI, COMBINING, RTL, SPACES, DIGITS, PUNCT, MISC]
    special_texts = list(specials) + [s[:-1] for s in specials] + [s[1:] for s in specials] + \
        ["<|", "|>", "<｜", "｜>", "<|im_start|>", "<|endoftext|>", "<think>", "<｜User｜>"]
    return groups, special_texts


def make_string(rng, groups, special_texts):
    parts = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.08:
            parts.append(rng.choice(special_texts))
        elif r < 0.35:
            parts.append(rng.choice(SPACES))
        else:
            parts.append(rng.choice(rng.choice(groups)))
        if rng.random() < 0.5:
            parts.append(" ")
    s = "".join(parts)
    if rng.random() < 0.05:
        s = s.upper()
    return s


def corpus(seed, count, all_specials, extra=()):
    rng = random.Random(seed)
    groups, special_texts = pieces_for(all_specials)
    fixed = [w for g in groups for w in g] + special_texts + [""] + list(extra)
    out = fixed + [make_string(rng, groups, special_texts) for _ in range(count - len(fixed))]
    return out


def train(family, training_text):
    tok = Tokenizer(models.BPE(ignore_merges=family["ignore_merges"]))
    if family["normalizer"] is not None:
        tok.normalizer = family["normalizer"]()
    tok.pre_tokenizer = family["pre_tokenizer"]()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, show_progress=False,
                                  special_tokens=family["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text, trainer)
    if family["ignore_merges"]:
        # A token no merge makes, as tiktoken-derived vocabularies have: with ignore_merges a
        # pre-token equal to it is that token, without it the bytes are merged.
        tj = json.loads(tok.to_str())
        assert "Ġqqjx" not in tj["model"]["vocab"]
        tj["model"]["vocab"]["Ġqqjx"] = max(tj["model"]["vocab"].values()) + 1
        tok = Tokenizer.from_str(json.dumps(tj))
    if family["add_bos"]:
        bos = family["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def train_spm(training_text):
    """A Mistral/Mixtral-style tokenizer: a SentencePiece BPE vocabulary (<unk>, <s>, </s>, the 256
    byte pieces <0xXX>, then pieces scored -id) in HF's form as transformers' converter writes it
    for Mixtral-8x7B (normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, BPE with
    byte_fallback and merges extracted from the scores like tokenizers' SentencePieceExtractor,
    decoder Replace/ByteFallback/Fuse/Strip, "<s> $A")."""
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=2, show_progress=False,
                                  limit_alphabet=300)
    base.train_from_iterator(training_text, trainer)
    learned = sorted(base.get_vocab().items(), key=lambda kv: kv[1])
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [p for p, _ in learned if p not in pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    return spm_tokenizer(pieces, scores), pieces, scores


def spm_tokenizer(pieces, scores):
    """HF's tokenizer for a SentencePiece BPE vocabulary (piece 0 `<unk>`, 1 `<s>`, 2 `</s>`), in
    the form transformers' converter writes for Mixtral-8x7B: merges extracted from the scores as
    tokenizers' SentencePieceExtractor does, Prepend/Replace normaliser, byte fallback, BOS."""
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for piece, score in zip(pieces, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges = sorted(merges, key=lambda m: m[2], reverse=True)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def write_spm_gguf(gguf, path, pieces, scores):
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(pieces) - 259)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(gguf, path, family, tok):
    tj = json.loads(tok.to_str())
    vocab = tj["model"]["vocab"]
    added = {a["id"]: a for a in tj["added_tokens"]}
    n = max(max(vocab.values()), max(added) if added else 0) + 1
    tokens, types = [""] * n, [gguf.TokenType.NORMAL] * n
    for text, i in vocab.items():
        tokens[i] = text
    for i, a in added.items():
        # As the converter does: added tokens are stored as their text (not byte-level encoded);
        # special ones are CONTROL, the others USER_DEFINED.
        tokens[i] = a["content"]
        types[i] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(family["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.token_to_id(family["bos"]))
    w.add_eos_token_id(tok.token_to_id(family["eos"]))
    w.add_add_bos_token(family["add_bos"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-py", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=10000)
    ap.add_argument("--special-count", type=int, default=300)
    args = ap.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_specials = sorted({s for f in FAMILIES for s in f["specials"]})
    strings = corpus(1234, args.count, all_specials, UNTRAINED)
    training = corpus(99, 40000, [])  # no special-token text: they are added, not learned
    (out / "corpus.json").write_text(json.dumps(strings, ensure_ascii=False, indent=0) + "\n",
                                     encoding="utf-8")
    spm, pieces, scores = train_spm(training)
    for family in FAMILIES + [dict(name="mixtral", pre="default", normalizer="spm")]:
        if family["name"] == "mixtral":
            tok = spm
            write_spm_gguf(gguf, out / "mixtral.gguf", pieces, scores)
        else:
            tok = train(family, training)
            write_gguf(gguf, out / f"{family['name']}.gguf", family, tok)
        plain = [e.ids for e in tok.encode_batch(strings, add_special_tokens=False)]
        special = [e.ids for e in tok.encode_batch(strings[:args.special_count],
                                                   add_special_tokens=True)]
        # HF's decoding where it is not the string itself (a normalizer changed it).
        decoded = {}
        for i, (s, ids) in enumerate(zip(strings, plain)):
            d = tok.decode(ids, skip_special_tokens=False)
            if d != s:
                assert family["normalizer"] is not None, s
                decoded[str(i)] = d
        (out / f"{family['name']}.json").write_text(
            json.dumps({"pre": family["pre"], "ids": plain, "ids_special": special,
                        "decoded": decoded}, ensure_ascii=False,
                       separators=(",", ":")) + "\n")
        print(f"{family['name']}: vocab {tok.get_vocab_size()}, "
              f"{sum(map(len, plain))} tokens over {len(strings)} strings")


if __name__ == "__main__":
    main()
