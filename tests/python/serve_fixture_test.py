#!/usr/bin/env python3
"""expert-serve runs a converter-made fixture's family by model name (the engine tests cover the
forward; serve_test.py covers the API on qwen3moe): a real expertd serving FIXTURE/model-VARIANT.gguf,
a real expert-serve on a free loopback port. Its greedy completion of the fixture's prompt, plain
and streamed, is transformers' greedy continuation (the fixture's token ids, through expert-run
--json) and the same text and usage as expert-run's.

With --chat-fixture tests/fixtures/chat/NAME.json the model is served with that fixture's template
as its tokenizer.chat_template (gguf-new-metadata): expert-run --chat and expert-serve pick the
family from it, the prompt is the fixture's rendering of [system, user] (transformers'), and a
chat answer equals expert-run --chat's.

usage: serve_fixture_test.py --bin BUILD/bin --fixture DIR --variant q8_0 --workdir DIR
                             [--chat-fixture tests/fixtures/chat/NAME.json]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from datetime import datetime

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import (check_same_as_expert_run, start_expertd, start_serve,  # noqa: E402
                        stop_procs)

MODEL = "fixture"


def check_chat(args, sock, chat, port, log_path):
    """The model's own template, detected by expert-run and expert-serve: [system, user] renders
    as transformers rendered it (the same prompt ids as that text given plainly), and expert-serve's
    chat answer is expert-run --chat's."""
    case = next(c for c in chat["cases"] if c["add_generation_prompt"] and
                [m["role"] for m in c["messages"]] == ["system", "user"])
    system, user = (m["content"] for m in case["messages"])
    want = case["output"]
    if "date" in chat:  # strftime_now: the fixture's fixed date; the engine writes today's
        want = want.replace(f"Current date: {chat['date']}\n",
                            f"Current date: {datetime.now().strftime('%Y-%m-%d')}\n")
    run = [os.path.join(args.bin, "expert-run"), "--socket", sock, "--model", MODEL, "--cpu",
           "--max-tokens", "4"]
    chat_args = ["--chat", "--system", system, "--prompt", user]
    shown = subprocess.run(run + chat_args, capture_output=True, text=True, errors="replace",
                           timeout=60, check=True)  # the random model's answer: any bytes
    assert f"expert-run: chat template {chat['family']}\n" in shown.stdout, shown.stdout
    ref = json.loads(subprocess.run(run + ["--json"] + chat_args, capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    plain = json.loads(subprocess.run(run + ["--json", "--prompt", want],
                                      capture_output=True, text=True, timeout=60,
                                      check=True).stdout)
    assert ref["prompt_tokens"] == plain["prompt_tokens"], \
        f"--chat prompt {ref['prompt_tokens']}, transformers' rendering {plain['prompt_tokens']}"
    print(f"ok: expert-run --chat: {chat['family']}, transformers' rendering of {chat['name']}")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=case["messages"], max_tokens=4,
                                       temperature=0)
    check_same_as_expert_run("chat", ref, r.choices[0].message.content,
                             r.choices[0].finish_reason, r.usage)
    assert f"chat template: {chat['family']}" in open(log_path).read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--variant", default="f32")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--chat-fixture")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    meta = json.load(open(os.path.join(args.fixture, "fixture.json")))
    want = meta["tokens"] if args.variant == "f32" else meta[f"greedy_{args.variant}"]
    prompt, n = meta["prompt"], len(want) - meta["prompt_tokens"]
    gguf = os.path.join(args.fixture, f"model-{args.variant}.gguf")
    chat = None
    if args.chat_fixture:
        chat = json.load(open(args.chat_fixture, encoding="utf-8"))
        templated = os.path.join(args.workdir, "model-chat.gguf")
        jinja = os.path.join(args.workdir, "chat_template.jinja")  # a file: GLM's opens with '['
        with open(jinja, "w", encoding="utf-8") as f:
            f.write(chat["template"])
        new_metadata = os.path.join(os.path.dirname(sys.executable), "gguf-new-metadata")
        subprocess.run([new_metadata, "--chat-template-file", jinja, gguf, templated],
                       check=True, capture_output=True, timeout=60)
        gguf = templated
    sock = os.path.join(args.workdir, "expertd.sock")
    procs = []
    try:
        start_expertd(args, [f"{MODEL}={gguf}"], sock, procs)
        ref = json.loads(subprocess.run(
            [os.path.join(args.bin, "expert-run"), "--socket", sock, "--model", MODEL, "--json",
             "--cpu", "--prompt", prompt, "--max-tokens", str(n), "--ignore-eos"],
            capture_output=True, text=True, timeout=60, check=True).stdout)
        assert ref["prompt_tokens"] + ref["generated"] == want, \
            f"expert-run {ref['prompt_tokens'] + ref['generated']}, transformers {want}"
        print(f"ok: expert-run: transformers' {n} greedy tokens")

        port, _, log_path = start_serve(args, sock, MODEL, ["--ctx", "512", "--cpu"], procs)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        check_same_as_expert_run("completion", ref, r.choices[0].text, r.choices[0].finish_reason,
                                 r.usage)
        pieces, finish, usage = [], None, None
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        check_same_as_expert_run("streamed completion", ref, "".join(pieces), finish, usage)
        if chat is not None:
            check_chat(args, sock, chat, port, log_path)
    finally:
        stop_procs(procs)


if __name__ == "__main__":
    main()
