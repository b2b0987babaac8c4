#!/usr/bin/env python3
"""expert-serve splits a reasoning model's chat answer into reasoning_content and content, through
a real expertd, the real engine and the real HTTP path, driven by the `openai` client.

The fixtures are random-weight models: their text is noise and never a <think> block or a harmony
channel. But their greedy answer is fixed token ids, and what an id reads as is the vocabulary's
business: the test reads the fixture's greedy chat answer (expert-run --chat --json), then writes
a copy of the GGUF whose vocabulary spells some of those ids as the syntax's tags (special tokens,
as real models have them) and the rest of the answer's ids as words. The prompt encodes to the
same ids (checked), so the model writes the same ids, and the answer reads as a reasoning answer:

  --syntax harmony (gpt-oss): <|channel|>analysis<|message|>...<|end|>
      <|start|>assistant<|channel|>final<|message|>...; the GGUF names <|end|> as its EOT token
      and has <|return|> and <|call|>, so an engine that ended generation at <|end|> would stop
      before the final channel.
  --syntax think (Qwen3): <think>\\n...\\n</think>\\n\\n...

Checks, against a reference split written here from the documented rules: the answer's
message.reasoning_content and content, plain and streamed (delta.reasoning_content first, then
delta.content); "reasoning_format": "none" and /v1/completions give the raw text (expert-run's);
a stop string applies to the content, not the reasoning; a bad reasoning_format is a 400 naming
the field; expert-run --chat --json's "reasoning" and "content" are the same split. With the
<think> syntax, chat_template_kwargs {"enable_thinking": false} closes the block in the prompt and
the answer, tags and all, is content (plain and streamed), as expert-run's with the flag.

usage: serve_reasoning_test.py --bin BUILD/bin --fixture DIR --chat-fixture CHAT.json
                               --syntax harmony|think --workdir DIR
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import gguf
import openai
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import Http, start_expertd, start_serve, stop_procs  # noqa: E402

N = 24  # tokens the answer has
WS = " \t\n\r"
MAX_HELD = 256  # engine::ReasoningSplitter::kMaxHeld
CONTROL, USER_DEFINED = 3, 4


def split_think(raw):
    """The reference <think> split (engine/reasoning.h): a block opening the answer after white
    space is reasoning, stripped; the rest, stripped at its start, is content."""
    ws = len(raw) - len(raw.lstrip(WS))
    if ws > MAX_HELD or not raw[ws:].startswith("<think>"):
        return "", raw
    body = raw[ws + len("<think>"):].lstrip(WS)
    end = body.find("</think>")
    if end < 0:
        return body, ""
    return body[:end].rstrip(WS), body[end + len("</think>"):].lstrip(WS)


def split_harmony(raw):
    """The reference harmony split: analysis bodies are reasoning, final and commentary bodies
    content; from the first thing that is not an assistant's channel header, content verbatim."""
    reasoning, content, pos, after_end = "", "", 0, False
    while True:
        at = pos
        if after_end:
            if not raw.startswith("<|start|>assistant", pos):
                return reasoning, content + raw[pos:]
            at += len("<|start|>assistant")
        m = raw.find("<|message|>", at)
        header = raw[at:m]
        if m < 0 or not header.startswith("<|channel|>") or " to=" in header or \
                m + len("<|message|>") - pos > MAX_HELD:
            return reasoning, content + raw[pos:]
        name = re.split("[ <]", header[header.rfind("<|channel|>") + len("<|channel|>"):])[0]
        if name not in ("analysis", "final", "commentary"):
            return reasoning, content + raw[pos:]
        start = m + len("<|message|>")
        ends = [(raw.find(t, start), t) for t in ("<|end|>", "<|return|>", "<|call|>")]
        ends = sorted((i, t) for i, t in ends if i >= 0)
        body = raw[start:ends[0][0]] if ends else raw[start:]
        if name == "analysis":
            reasoning += body
        else:
            content += body
        if not ends:
            return reasoning, content
        pos = ends[0][0] + len(ends[0][1])
        if ends[0][1] != "<|end|>":
            return reasoning, content + raw[pos:]
        after_end = True


def expert_run(args, sock, model, extra):
    out = subprocess.run(
        [os.path.join(args.bin, "expert-run"), "--socket", sock, "--model", model, "--json",
         "--cpu", "--max-tokens", str(N)] + extra,
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"expert-run {extra}: {out.stderr}"
    return json.loads(out.stdout)


def write_gguf(src, dst, template, pieces, eot=None):
    """A copy of `src` with `template` as its chat template and the tokens of `pieces` (id ->
    (text, token type)) spelled anew."""
    reader = gguf.GGUFReader(src)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    for i, (text, kind) in pieces.items():
        tokens[i], types[i] = text, kind
    new = {
        gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template),
        "tokenizer.ggml.tokens": MetadataDetails(gguf.GGUFValueType.ARRAY, tokens,
                                                 sub_type=gguf.GGUFValueType.STRING),
        "tokenizer.ggml.token_type": MetadataDetails(gguf.GGUFValueType.ARRAY, types,
                                                     sub_type=gguf.GGUFValueType.INT32),
    }
    if eot is not None:
        new["tokenizer.ggml.eot_token_id"] = MetadataDetails(gguf.GGUFValueType.UINT32, eot)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, new, [])


def word(token):
    # Readable, several UTF-8 widths, and no text the prompt holds. No Latin-1 letters: expert-run
    # reads every piece as GPT-2 byte-level text, where those stand for single bytes.
    return f"{token}{'思' if token % 3 == 0 else 'λ'}{'✓' if token % 5 == 0 else ''} "


def plan(syntax, prompt_ids, generated, prompt_end):
    """Which generated ids become tags (pieces id -> (text, type)) and which words, or None when
    this answer does not allow it (the first id is one of the prompt's, or not unique).
    `prompt_end`: the id that spells the prompt's <|end|> (harmony), which the answer must not
    have; the answer's <|end|> is a later id (the encoder takes the first of two)."""
    prompt = set(prompt_ids)
    free = [i for i, t in enumerate(generated) if t not in prompt and generated.count(t) == 1]
    if not free or free[0] != 0 or len(free) < 4 or prompt_end in generated:
        return None
    pieces = {t: (word(t), USER_DEFINED) for t in set(generated) - prompt}
    if syntax == "think":
        pieces[generated[0]] = ("<think>\n", CONTROL)
        pieces[generated[free[len(free) // 2]]] = ("\n</think>\n\n", CONTROL)
        return pieces, None
    later = [i for i in free[1:-1] if generated[i] > prompt_end]
    if not later:
        return None
    close = later[len(later) // 2]
    final = next(i for i in free if i > close)
    pieces[generated[0]] = ("<|channel|>analysis<|message|>", CONTROL)
    pieces[generated[close]] = ("<|end|>", CONTROL)
    pieces[generated[final]] = ("<|start|>assistant<|channel|>final<|message|>", CONTROL)
    # <|return|> and <|call|> on ids neither the prompt nor the answer has: harmony's vocabulary.
    unused = [t for t in range(2, len(pieces) + len(prompt) + 300)
              if t not in prompt and t not in generated and t != prompt_end][:2]
    pieces[unused[0]] = ("<|return|>", CONTROL)
    pieces[unused[1]] = ("<|call|>", CONTROL)
    return pieces, generated[close]


def stream(client, messages, **kw):
    """The streamed answer: (reasoning, content, finish, kinds) with kinds the order of the
    non-empty deltas, 'r' or 'c'."""
    reasoning, content, finish, kinds = "", "", None, []
    for chunk in client.chat.completions.create(model="fixture", messages=messages, stream=True,
                                                max_tokens=N, temperature=0, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        r = (delta.model_extra or {}).get("reasoning_content")
        if r:
            reasoning += r
            kinds.append("r")
        if delta.content:
            content += delta.content
            kinds.append("c")
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish, kinds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--variant", default="f32")
    ap.add_argument("--chat-fixture", required=True)
    ap.add_argument("--syntax", choices=["harmony", "think"], required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    chat = json.load(open(args.chat_fixture, encoding="utf-8"))
    src = os.path.join(args.fixture, f"model-{args.variant}.gguf")
    plain = os.path.join(args.workdir, "plain.gguf")
    spelled = os.path.join(args.workdir, "spelled.gguf")
    # Harmony's prompt has <|end|> after each turn: a special token in both models, on an id no
    # (ASCII) prompt has, a control byte's (GPT-2 spells byte 0x02 as U+0102).
    prompt_pieces = {}
    prompt_end = None
    if args.syntax == "harmony":
        tokens = list(gguf.GGUFReader(src).fields["tokenizer.ggml.tokens"].contents())
        prompt_end = tokens.index("\u0102")
        prompt_pieces = {prompt_end: ("<|end|>", CONTROL)}
    write_gguf(src, plain, chat["template"], prompt_pieces)
    sock = os.path.join(args.workdir, "expertd.sock")
    procs = []
    try:
        start_expertd(args, [f"plain={plain}"], sock, procs)
        # An answer whose first token can be spelled as the opening tag: the user's message picks
        # it (a deterministic search over a few).
        for k in range(40):
            user = f"Question {k}: what is 2 + 2?"
            ref = expert_run(args, sock, "plain", ["--chat", "--prompt", user])
            if len(ref["generated"]) < N:
                continue  # the fixture's EOS came first
            made = plan(args.syntax, ref["prompt_tokens"], ref["generated"], prompt_end)
            if made:
                break
        else:
            raise AssertionError("no user message among 40 gives an answer to spell")
        pieces, end_id = made
        print(f"ok: the plain fixture's answer to {user!r} can be spelled "
              f"({len(pieces)} tokens renamed)")
        stop_procs(procs)
        procs.clear()

        write_gguf(src, spelled, chat["template"], {**prompt_pieces, **pieces}, eot=end_id)
        start_expertd(args, [f"fixture={spelled}"], sock, procs)
        raw_ref = expert_run(args, sock, "fixture", ["--chat", "--prompt", user])
        assert raw_ref["prompt_tokens"] == ref["prompt_tokens"], "the prompt encodes differently"
        assert raw_ref["generated"] == ref["generated"], \
            f"the spelled model stopped or changed: {raw_ref['generated']} vs {ref['generated']}"
        raw = raw_ref["text"]
        want_r, want_c = split_harmony(raw) if args.syntax == "harmony" else split_think(raw)
        assert want_r and want_c, f"the spelled answer has no reasoning or no content: {raw!r}"
        print(f"ok: expert-run's raw answer: {raw!r}")
        assert (raw_ref["reasoning"], raw_ref["content"]) == (want_r, want_c), \
            f"expert-run's split: {raw_ref['reasoning']!r}, {raw_ref['content']!r}"
        print("ok: expert-run --chat --json splits it as the reference: reasoning, content")

        port, h, log_path = start_serve(args, sock, "fixture", ["--ctx", "1024", "--cpu"], procs)
        assert f"chat template: {chat['family']} (reasoning: " in open(log_path).read()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        messages = [{"role": "user", "content": user}]

        r = client.chat.completions.create(model="fixture", messages=messages, max_tokens=N,
                                           temperature=0)
        m = r.choices[0].message
        got_r = (m.model_extra or {}).get("reasoning_content")
        assert (got_r, m.content) == (want_r, want_c), \
            f"split: reasoning {got_r!r}, content {m.content!r}; want {want_r!r}, {want_c!r}"
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N
        print(f"ok: chat: reasoning_content {got_r!r}, content {m.content!r}")

        s_r, s_c, finish, kinds = stream(client, messages)
        assert (s_r, s_c) == (want_r, want_c), f"streamed: {s_r!r}, {s_c!r}"
        assert finish == "length"
        # The server sends what the engine has made since its last write, so on a loaded
        # machine (CI: 2 cores, tests in parallel) the whole answer may come as one reasoning
        # and one content delta; what must hold is that both come, reasoning first.
        assert kinds.count("r") >= 1 and kinds.count("c") >= 1, f"not streamed: {kinds}"
        assert "c" not in kinds[:max(i for i, k in enumerate(kinds) if k == "r")], \
            f"content came before the reasoning ended: {kinds}"
        print(f"ok: streamed chat: {kinds.count('r')} reasoning deltas, then "
              f"{kinds.count('c')} content deltas, the same split")

        # Off: the raw text, as expert-run and the completions endpoint give it.
        r = client.chat.completions.create(model="fixture", messages=messages, max_tokens=N,
                                           temperature=0, extra_body={"reasoning_format": "none"})
        m = r.choices[0].message
        assert m.content == raw and "reasoning_content" not in (m.model_extra or {}), m
        s_r, s_c, _, _ = stream(client, messages, extra_body={"reasoning_format": "none"})
        assert (s_r, s_c) == ("", raw), f"streamed, reasoning_format none: {s_r!r}, {s_c!r}"
        c = client.completions.create(model="fixture", prompt=ref["prompt_tokens"], max_tokens=N,
                                      temperature=0, extra_body={"reasoning_format": "auto"})
        assert c.choices[0].text == raw, f"completion {c.choices[0].text!r}"
        print("ok: reasoning_format none and /v1/completions: the raw text")

        if args.syntax == "think":
            # Thinking off: the prompt closes an empty block, and the answer, whatever it is, is
            # content, as /v1/completions gives it for the same prompt (expert-run's).
            off = ["--chat", "--prompt", user, "--chat-template-kwargs", '{"enable_thinking": false}']
            off_ref = expert_run(args, sock, "fixture", off)
            assert "reasoning" in off_ref and off_ref["reasoning"] == "", off_ref
            assert off_ref["content"] == off_ref["text"], off_ref
            r = client.chat.completions.create(
                model="fixture", messages=messages, max_tokens=N, temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            m = r.choices[0].message
            assert r.usage.prompt_tokens == len(off_ref["prompt_tokens"]) > len(ref["prompt_tokens"])
            assert m.content == off_ref["text"] and \
                not (m.model_extra or {}).get("reasoning_content"), m
            s_r, s_c, _, _ = stream(
                client, messages, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert (s_r, s_c) == ("", off_ref["text"]), f"streamed, thinking off: {s_r!r}, {s_c!r}"
            print(f"ok: enable_thinking false: all content, plain and streamed ({m.content!r})")

        # A stop string cuts the content only: one found in the reasoning and later in the
        # content ends the answer in the content, and the reasoning is whole.
        stop = next((want_c[i:i + 2] for i in range(1, len(want_c) - 1)
                     if want_c[i:i + 2].strip() and want_c[i:i + 2] in want_r), want_c[1:3])
        r = client.chat.completions.create(model="fixture", messages=messages, max_tokens=N,
                                           temperature=0, stop=[stop])
        m = r.choices[0].message
        got_r = (m.model_extra or {}).get("reasoning_content")
        assert got_r == want_r and m.content == want_c[:want_c.find(stop)], \
            f"stop {stop!r}: reasoning {got_r!r}, content {m.content!r}"
        assert r.choices[0].finish_reason == "stop"
        print(f"ok: stop {stop!r} (in the reasoning: {stop in want_r}) cuts the content only")

        status, _, data = h.request("POST", "/v1/chat/completions",
                                    {"messages": messages, "reasoning_format": "raw"})
        body = json.loads(data)
        assert status == 400 and body["error"]["param"] == "reasoning_format" and \
            "auto, deepseek, none" in body["error"]["message"], (status, body)
        status, _, data = h.request("POST", "/v1/chat/completions",
                                    {"messages": messages, "reasoning_format": False})
        assert status == 400 and json.loads(data)["error"]["param"] == "reasoning_format"
        print(f"ok: bad reasoning_format: 400 ({body['error']['message']!r})")

        # --reasoning-format none: raw for every request, unless the request asks for the split.
        port, _, log_path = start_serve(args, sock, "fixture",
                                        ["--ctx", "1024", "--cpu", "--reasoning-format", "none"],
                                        procs)
        assert "--reasoning-format none" in open(log_path).read()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        m = client.chat.completions.create(model="fixture", messages=messages, max_tokens=N,
                                           temperature=0).choices[0].message
        assert m.content == raw and "reasoning_content" not in (m.model_extra or {}), m
        m = client.chat.completions.create(model="fixture", messages=messages, max_tokens=N,
                                           temperature=0,
                                           extra_body={"reasoning_format": "deepseek"}
                                           ).choices[0].message
        assert (m.model_extra["reasoning_content"], m.content) == (want_r, want_c), m
        print("ok: --reasoning-format none: the raw text; a request's \"deepseek\" splits")
    finally:
        stop_procs(procs)


if __name__ == "__main__":
    main()
