#!/usr/bin/env python3
"""expert-serve's and expert-run's thinking switches (chat_template_kwargs, reasoning_effort)
render the prompt the model's real template renders with them, through a real expertd and a real
expert-serve, driven by the `openai` client.

The fixtures are random-weight models, so the check is the prompt, not the answer: the model is
served with a chat fixture's template (tests/fixtures/chat/NAME.json, transformers' renderings) as
its tokenizer.chat_template, and for each of the fixture's cases of [user "Hello"] with a
generation prompt and switches ("kwargs"), the chat request with those switches must
  - render transformers' text (expert-serve --log-level debug logs the prompt it rendered),
  - count as many prompt tokens as that text does (expert-run --prompt TEXT, plain), and
  - give expert-run --chat --chat-template-kwargs the same prompt tokens.
Then: a wrong type or value of a known switch is a 400 naming the field; unknown keys are
ignored; a switch the template does not read is ignored with a log line; --chat-template-kwargs
and --reasoning-effort set every request's default, a request's own switch overrides it; a bad
flag value stops expert-serve with the flag's name.

usage: serve_thinking_test.py --bin BUILD/bin --fixture DIR --variant f32 --workdir DIR
                              --chat-fixture tests/fixtures/chat/NAME.json
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import start_expertd, start_serve, stop_procs  # noqa: E402

MODEL = "fixture"


def expert_run(args, sock, extra):
    out = subprocess.run(
        [os.path.join(args.bin, "expert-run"), "--socket", sock, "--model", MODEL, "--json",
         "--cpu", "--max-tokens", "2"] + extra,
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"expert-run {extra}: {out.stderr}"
    return json.loads(out.stdout), out.stderr


def logged_prompts(log_path):
    """The prompts expert-serve logged (debug), in order."""
    return [json.loads(m.group(1)) for m in
            re.finditer(r"chat prompt: (\".*\")$", open(log_path, encoding="utf-8").read(), re.M)]


def request_args(kwargs):
    """The openai client's arguments for the switches: reasoning_effort as OpenAI's own field,
    the rest in chat_template_kwargs."""
    kw, extra = dict(kwargs), {}
    if list(kw) == ["reasoning_effort"]:
        return {"reasoning_effort": kw["reasoning_effort"]}
    if kw:
        extra["chat_template_kwargs"] = kw
    return {"extra_body": extra}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--variant", default="f32")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--chat-fixture", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    chat = json.load(open(args.chat_fixture, encoding="utf-8"))
    gguf = os.path.join(args.workdir, "model-chat.gguf")
    jinja = os.path.join(args.workdir, "chat_template.jinja")  # a file: GLM's opens with '['
    with open(jinja, "w", encoding="utf-8") as f:
        f.write(chat["template"])
    new_metadata = os.path.join(os.path.dirname(sys.executable), "gguf-new-metadata")
    subprocess.run([new_metadata, "--chat-template-file", jinja,
                    os.path.join(args.fixture, f"model-{args.variant}.gguf"), gguf],
                   check=True, capture_output=True, timeout=60)

    today = datetime.now().strftime("%Y-%m-%d")
    # The BOS text is the served tokenizer's (the fixture model's differs from the fixture's):
    # learnt from the first, plain, rendering.
    bos = {"served": chat["bos"]}

    def want_text(case):
        out = case["output"]
        if "date" in chat:  # strftime_now: the fixture's fixed date; the engine writes today's
            out = out.replace(f"Current date: {chat['date']}\n", f"Current date: {today}\n")
        if chat["bos"] and out.startswith(chat["bos"]):
            out = bos["served"] + out[len(chat["bos"]):]
        return out

    hello = [{"role": "user", "content": "Hello"}]
    cases = [c for c in chat["cases"] if c["messages"] == hello and c["add_generation_prompt"]]
    plain = next(c for c in cases if "kwargs" not in c)
    switched = [c for c in cases if "kwargs" in c]
    assert len(switched) >= 8, f"{chat['name']}: {len(switched)} cases with kwargs"
    sock = os.path.join(args.workdir, "expertd.sock")
    procs = []
    try:
        start_expertd(args, [f"{MODEL}={gguf}"], sock, procs)
        port, h, log_path = start_serve(args, sock, MODEL,
                                        ["--ctx", "1024", "--cpu", "--log-level", "debug"], procs)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        ids_of = {}  # text -> its prompt ids, plain (expert-run --prompt)

        def ids(text):
            if text not in ids_of:
                path = os.path.join(args.workdir, "prompt.txt")  # the BOS text may be "\0"
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                ids_of[text] = expert_run(args, sock, ["--prompt-file", path])[0]["prompt_tokens"]
            return ids_of[text]

        changed = 0
        for case in [plain] + switched:
            kwargs = case.get("kwargs", {})
            want = want_text(case)
            before = len(logged_prompts(log_path))
            r = client.chat.completions.create(model=MODEL, messages=hello, max_tokens=2,
                                               temperature=0, **request_args(kwargs))
            got = logged_prompts(log_path)[before:]
            if case is plain and chat["bos"] and want.startswith(chat["bos"]) and len(got) == 1:
                rest = len(want) - len(bos["served"])
                bos["served"] = got[0][:len(got[0]) - rest]
                want = want_text(case)
            assert got == [want], f"{kwargs}: rendered {got}, transformers {want!r}"
            assert r.usage.prompt_tokens == len(ids(want)), \
                f"{kwargs}: {r.usage.prompt_tokens} prompt tokens, the text has {len(ids(want))}"
            run_args = ["--chat", "--prompt", "Hello"]
            if kwargs:
                run_args += ["--chat-template-kwargs", json.dumps(kwargs)]
            ran, _ = expert_run(args, sock, run_args)
            assert ran["prompt_tokens"] == ids(want), f"{kwargs}: expert-run --chat's prompt"
            changed += want != want_text(plain)
        print(f"ok: {len(switched)} switch sets render as transformers ({changed} change the "
              f"prompt), in expert-serve and expert-run --chat")
        assert changed >= 1, "no switch changes this template's prompt"

        # Strict about the switches it knows, lenient about the rest.
        bad = [({"chat_template_kwargs": {"enable_thinking": "no"}},
                "chat_template_kwargs.enable_thinking", "must be a boolean"),
               ({"chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs.thinking",
                "must be a boolean"),
               ({"chat_template_kwargs": {"reasoning_effort": "max"}},
                "chat_template_kwargs.reasoning_effort", "low, medium, high"),
               ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs",
                "must be an object"),
               ({"reasoning_effort": 3}, "reasoning_effort", "must be a string"),
               ({"reasoning_effort": "extreme"}, "reasoning_effort", "low, medium, high"),
               ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                "reasoning_effort", "differ")]
        for body, param, text in bad:
            status, _, data = h.request("POST", "/v1/chat/completions",
                                        {"messages": hello, "max_tokens": 1, **body})
            err = json.loads(data)["error"]
            assert status == 400 and err["param"] == param and text in err["message"], \
                (body, status, err)
        print(f"ok: {len(bad)} bad switches: 400 naming the field")
        before = len(logged_prompts(log_path))
        status, _, data = h.request("POST", "/v1/chat/completions",
                                    {"messages": hello, "max_tokens": 1,
                                     "chat_template_kwargs": {"custom": [1], "tools_style": None}})
        assert status == 200, data
        assert logged_prompts(log_path)[before:] == [want_text(plain)]
        print("ok: unknown chat_template_kwargs keys are ignored")

        # A switch this template does not read: ignored (the template's rendering), logged.
        # (one whose every value, alone, renders the plain prompt).
        singles = {}
        for c in switched:
            if len(c["kwargs"]) == 1:
                singles.setdefault(next(iter(c["kwargs"])), []).append(c)
        unread = next((cs[0] for cs in singles.values()
                       if all(want_text(c) == want_text(plain) for c in cs)), None)
        if unread is not None:
            name = next(iter(unread["kwargs"]))
            assert re.search(f"chat request: {name} ignored: the {re.escape(chat['family'])} "
                             "template does not read it", open(log_path).read()), name
            _, err = expert_run(args, sock, ["--chat", "--prompt", "Hello", "--chat-template-kwargs",
                                             json.dumps(unread["kwargs"])])
            assert f"expert-run: {name} ignored: the {chat['family']} template" in err, err
            print(f"ok: {name}, which the template does not read, is ignored with a log line")

        # Server-wide defaults: the first switch set that changes the prompt, as a flag; a request
        # overrides it key by key.
        default = next(c for c in switched if want_text(c) != want_text(plain))
        flags = ["--chat-template-kwargs", json.dumps(default["kwargs"])]
        if list(default["kwargs"]) == ["reasoning_effort"]:
            flags = ["--reasoning-effort", default["kwargs"]["reasoning_effort"]]
        for p in procs[1:]:
            p.terminate()
            p.wait(timeout=20)
        del procs[1:]
        port, h, log_path = start_serve(
            args, sock, MODEL, ["--ctx", "1024", "--cpu", "--log-level", "debug"] + flags, procs)
        h.request("POST", "/v1/chat/completions", {"messages": hello, "max_tokens": 1})
        undo = {k: (not v if isinstance(v, bool) else "medium")
                for k, v in default["kwargs"].items()}
        h.request("POST", "/v1/chat/completions",
                  {"messages": hello, "max_tokens": 1, "chat_template_kwargs": undo})
        got = logged_prompts(log_path)
        # "medium" is gpt-oss's default: the plain rendering.
        undone = next((c for c in switched if c["kwargs"] == undo), plain)
        assert got == [want_text(default), want_text(undone)], (flags, undo, got)
        print(f"ok: {' '.join(flags)} is every request's default; a request's {undo} overrides it")

        for flags, msg in ((["--chat-template-kwargs", '{"enable_thinking": "off"}'],
                            "--chat-template-kwargs.enable_thinking must be a boolean"),
                           (["--chat-template-kwargs", "[1]"],
                            "--chat-template-kwargs must be an object")):
            out = subprocess.run([os.path.join(args.bin, "expert-serve"), "--socket", sock,
                                  "--model", MODEL, "--port", "1"] + flags,
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode != 0 and msg in out.stderr, (flags, out.stderr)
        print("ok: a bad --chat-template-kwargs stops expert-serve, naming the flag")
    finally:
        stop_procs(procs)


if __name__ == "__main__":
    main()
