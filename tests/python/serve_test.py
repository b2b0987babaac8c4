#!/usr/bin/env python3
"""expert-serve as a user meets it: a real expertd serving the qwen3moe-tiny fixture, a real
expert-serve on a free loopback port, driven by the official `openai` client (and by raw HTTP for
the requests the client would not send).

Checks: greedy completions and chat answers, streamed and not, equal expert-run --json's text for
the same prompt and max tokens, with the usage counts expert-run reports; a chat's second turn
reuses the first turn's KV cache (cached_tokens); every malformed request gets its 4xx with
OpenAI's error body and the server keeps answering /health; a full queue answers 503 with
Retry-After; a client that leaves mid-stream stops its generation at once and frees the engine
for the next request.

usage: serve_test.py --bin BUILD/bin --gguf model-f32.gguf --workdir DIR
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import openai

MODEL = "tiny"
CTX = 8192


def wait_for(what, predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Http:
    """Raw requests: what the openai client refuses to send, and headers it hides."""

    def __init__(self, port):
        self.port = port

    def request(self, method, path, body=None, timeout=60):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            elif isinstance(body, str):
                body = body.encode()
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            return r.status, dict(r.getheaders()), data
        finally:
            conn.close()

    def health(self):
        status, _, data = self.request("GET", "/health")
        assert status == 200, f"/health answered {status}: {data!r}"
        return json.loads(data)


def stop_procs(procs):
    """Terminates the processes started by start_expertd/start_serve, last first."""
    for p in reversed(procs):
        p.terminate()
        p.wait(timeout=20)
    procs.clear()


def start_expertd(args, models, sock, procs):
    """expertd serving `models` (NAME=GGUF each) on `sock` (16 MiB cache), up when it returns;
    appended to `procs`."""
    daemon_log = open(os.path.join(args.workdir, "expertd.log"), "w")
    cmd = [os.path.join(args.bin, "expertd"), "--socket", sock, "--cache", "16MiB", "--no-mlock"]
    for m in models:
        cmd += ["--model", m]
    procs.append(subprocess.Popen(cmd, stdout=daemon_log, stderr=daemon_log))

    def daemon_up():
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(sock)
                return True
            except OSError:
                return False
    wait_for("expertd's socket", daemon_up)


def start_serve(args, sock, model, extra, procs):
    """expert-serve for `model` on a free port, up (/health ok) when it returns; appended to
    `procs`. Returns the port, an Http on it and the log's path."""
    port = free_port()
    log_path = os.path.join(args.workdir, "expert-serve.log")
    serve_log = open(log_path, "w")
    procs.append(subprocess.Popen(
        [os.path.join(args.bin, "expert-serve"), "--socket", sock, "--model", model,
         "--port", str(port)] + extra, stdout=serve_log, stderr=serve_log))
    h = Http(port)

    def serve_up():
        if procs[-1].poll() is not None:
            raise AssertionError(f"expert-serve exited: {open(log_path).read()}")
        try:
            return h.health()["status"] == "ok"
        except OSError:
            return False
    wait_for("expert-serve's /health", serve_up)
    return port, h, log_path


def expert_run(args, socket_path, extra):
    out = subprocess.run(
        [os.path.join(args.bin, "expert-run"), "--socket", socket_path, "--model", MODEL,
         "--json", "--cpu"] + extra,
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"expert-run {extra}: {out.stderr}"
    return json.loads(out.stdout)


FINISH = {"max_tokens": "length", "eos": "stop", "stop": "stop"}


def check_same_as_expert_run(name, reference, text, finish, usage):
    assert text == reference["text"], f"{name}: text {text!r}, expert-run {reference['text']!r}"
    assert finish == FINISH[reference["stop_reason"]], \
        f"{name}: finish_reason {finish}, expert-run stopped by {reference['stop_reason']}"
    assert usage.prompt_tokens == len(reference["prompt_tokens"]), \
        f"{name}: prompt_tokens {usage.prompt_tokens}, expert-run {len(reference['prompt_tokens'])}"
    assert usage.completion_tokens == len(reference["generated"]), \
        f"{name}: completion_tokens {usage.completion_tokens}, expert-run {len(reference['generated'])}"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    print(f"ok: {name}: {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} generated, "
          f"text equals expert-run's")


def test_completions(args, sock, client):
    prompt = "Hello, MoE!\n"
    ref = expert_run(args, sock, ["--prompt", prompt, "--max-tokens", "8"])
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    check_same_as_expert_run("completion", ref, r.choices[0].text, r.choices[0].finish_reason,
                             r.usage)
    assert r.object == "text_completion" and r.model == MODEL

    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert usage is not None, "stream_options.include_usage: no chunk carried usage"
    assert len(pieces) >= 2, f"the answer came in {len(pieces)} chunk(s): not streamed"
    check_same_as_expert_run("streamed completion", ref, "".join(pieces), finish, usage)

    # A stop string cuts the answer where expert-run --stop cuts it.
    stop = ref["text"][2:4]
    ref_stop = expert_run(args, sock, ["--prompt", prompt, "--max-tokens", "8", "--stop", stop])
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  stop=[stop])
    check_same_as_expert_run("completion with stop", ref_stop, r.choices[0].text,
                             r.choices[0].finish_reason, r.usage)


def test_chat(args, sock, client):
    ref = expert_run(args, sock, ["--chat", "--prompt", "Hi", "--max-tokens", "6"])
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant"
    check_same_as_expert_run("chat", ref, m.content, r.choices[0].finish_reason, r.usage)

    pieces, finish, usage, roles = [], None, None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages,
                                                max_completion_tokens=6, temperature=0,
                                                stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            d = chunk.choices[0].delta
            if d.role:
                roles.append(d.role)
            pieces.append(d.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert roles == ["assistant"], f"streamed chat roles {roles}"
    assert usage is not None, "stream_options.include_usage: no chunk carried usage"
    check_same_as_expert_run("streamed chat", ref, "".join(pieces), finish, usage)

    # The second turn starts with the first turn's tokens: they stay in the KV cache. (One
    # generated token: the KV cache then holds exactly the first prompt, which every engine can
    # keep; engines that cut their cache anywhere keep more.)
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           temperature=0)
    second = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=4,
        messages=messages + [{"role": "assistant", "content": first.choices[0].message.content},
                             {"role": "user", "content": "And then?"}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens > 0, \
        f"second turn: {cached} cached tokens; the first turn's prompt had " \
        f"{first.usage.prompt_tokens}"
    assert second.usage.prompt_tokens > cached
    print(f"ok: chat second turn: {cached} of {second.usage.prompt_tokens} prompt tokens reused")


def test_bad_requests(h, client):
    long_prompt = "a" * (CTX + 10)
    cases = [
        ("malformed JSON", "POST", "/v1/completions", '{"prompt": "x",', 400, None),
        ("max_tokens a string", "POST", "/v1/completions", {"prompt": "x", "max_tokens": "ten"},
         400, "max_tokens"),
        ("messages a number", "POST", "/v1/chat/completions", {"messages": 5}, 400, "messages"),
        ("stream a string", "POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400,
         "stream"),
        ("negative max_tokens", "POST", "/v1/completions", {"prompt": "x", "max_tokens": -3},
         400, "max_tokens"),
        ("max_tokens past the context", "POST", "/v1/completions",
         {"prompt": "x", "max_tokens": 10 ** 12}, 400, "max_tokens"),
        ("prompt longer than the context", "POST", "/v1/completions", {"prompt": long_prompt},
         400, "prompt"),
        ("non-UTF-8 text", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
        # A number beyond double's range anywhere in the body (issue 26): a 400, not a 500.
        ("number out of range", "POST", "/v1/completions", b'{"prompt": "x", "y": 1e400}', 400,
         None),
        ("unknown model", "POST", "/v1/completions", {"model": "nope", "prompt": "x"}, 404,
         "model"),
        ("missing prompt", "POST", "/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("a message without a role", "POST", "/v1/chat/completions",
         {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
        ("temperature negative", "POST", "/v1/completions", {"prompt": "x", "temperature": -1},
         400, "temperature"),
        ("empty stop string", "POST", "/v1/completions", {"prompt": "x", "stop": [""]}, 400,
         "stop"),
        ("n = 17", "POST", "/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
        ("best_of = 2", "POST", "/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
        ("wrong method", "GET", "/v1/completions", None, 405, None),
        ("wrong method on /health", "POST", "/health", "{}", 405, None),
        ("OPTIONS", "OPTIONS", "/v1/chat/completions", None, 405, None),  # issue 26
        ("unknown path", "GET", "/v1/nothing", None, 404, None),
    ]
    for name, method, path, body, status, param in cases:
        got, headers, data = h.request(method, path, body)
        assert got == status, f"{name}: {got} {data!r}, expected {status}"
        err = json.loads(data)["error"]
        assert err["message"] and err["type"], f"{name}: error body {data!r}"
        assert err["param"] == param, f"{name}: param {err['param']!r}, expected {param!r}"
        if name == "prompt longer than the context":
            assert str(CTX + 10) in err["message"] and str(CTX) in err["message"], err["message"]
        if status == 405:
            assert headers.get("Allow"), f"{name}: no Allow header"
        assert h.health()["status"] == "ok", f"after {name}"
        print(f"ok: {name}: {got} {err['message']!r}")
    # The same through the client: its exceptions carry the status.
    try:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=CTX * 2)
        raise AssertionError("max_tokens past the context was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400
    print("ok: the openai client gets NotFoundError and BadRequestError")


def test_logprobs(client):
    """logprobs on completions (legacy form) and chat (content items), plain and streamed: one
    item per generated token, and greedy picks the most likely alternative."""
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs), lp
    # (A token may be part of a UTF-8 character: the strings need not join into the text.)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 2 and abs(chosen - max(top.values())) < 1e-9, (chosen,
                                                                                         top)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0]), lp.text_offset
    messages = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens, items
    for it in items:
        assert len(it.top_logprobs) == 3 and it.top_logprobs[0].logprob == it.logprob, it
        assert len(it.bytes) >= 1, it
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                temperature=0, logprobs=True, top_logprobs=1,
                                                stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    assert [i.token for i in streamed] == [i.token for i in items], (streamed, items)
    assert [i.logprob for i in streamed] == [i.logprob for i in items]
    for bad in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2}):
        try:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **bad)
            raise AssertionError(f"{bad} was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "top_logprobs", e.body
    print(f"ok: logprobs: completions {len(lp.tokens)} tokens with 2 alternatives; chat "
          f"{len(items)} items with 3 alternatives, streamed the same")


def test_bias_and_penalties(h, client):
    """logit_bias +100 on one token makes every generated token that one; presence and frequency
    penalties change a greedy answer and are range-checked."""
    status, _, data = h.request("POST", "/tokenize", {"content": "Q"})
    forced = json.loads(data)["tokens"][0]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100})
    status, _, data = h.request("POST", "/detokenize", {"tokens": [forced] * 4})
    assert r.choices[0].text == json.loads(data)["content"] == "QQQQ", r.choices[0].text
    # +10 makes it the greedy choice; each time it is chosen, the penalties take 2 x count + 2
    # from it, until another token wins within the 8.
    lean = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                     logit_bias={str(forced): 10},
                                     extra_body={"ignore_eos": True}).choices[0].text
    pen = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                    logit_bias={str(forced): 10}, frequency_penalty=2.0,
                                    presence_penalty=2.0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert lean == "Q" * 8 and pen.startswith("Q") and pen != lean, (lean, pen)
    for bad, param in (({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"logit_bias": {"abc": 1}}, "logit_bias"),
                       ({"logit_bias": {str(forced): 101}}, "logit_bias")):
        try:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, **bad)
            raise AssertionError(f"{bad} was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == param, e.body
    print(f"ok: logit_bias forces token {forced}; penalties change the greedy answer; bad values "
          f"are 400")


def test_choices(client):
    """n > 1 (here 2: the test server runs --parallel 1 --queue 1): the choices are generated on their own sequences from seeds seed + i (they differ
    when sampling), the usage counts the prompt once and every choice's tokens, and the stream
    carries each choice's chunks by index, the same text as unstreamed."""
    kw = dict(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=5, n=2,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1] and len(set(texts)) > 1, texts
    assert r.usage.completion_tokens == 12, r.usage
    one = client.completions.create(**{**kw, "n": 1})
    assert one.choices[0].text == texts[0], (one.choices[0].text, texts[0])
    streamed = {0: "", 1: ""}
    finished = set()
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert [streamed[i] for i in range(2)] == texts and finished == {0, 1}, (streamed, texts)
    chat = client.chat.completions.create(model=MODEL, n=2, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert len(chat.choices) == 2 and chat.choices[0].message.content == \
        chat.choices[1].message.content, chat
    print(f"ok: n = 2: {texts}, the first as n = 1 gives it, streamed the same; greedy chat "
          f"choices agree")


def test_tokenize_and_props(args, sock, h):
    """/tokenize, /detokenize (llama.cpp server's endpoints) and /props: the model's own
    tokenizer, as expert-run encodes a prompt; bad input is a 400 naming the field."""
    text = "Hello, MoE!\n"
    ref = expert_run(args, sock, ["--prompt", text, "--max-tokens", "1"])
    status, _, data = h.request("POST", "/tokenize", {"content": text, "add_special": True})
    assert status == 200, data
    assert json.loads(data)["tokens"] == ref["prompt_tokens"], (data, ref["prompt_tokens"])
    status, _, data = h.request("POST", "/tokenize", {"content": text, "with_pieces": True})
    pieces = json.loads(data)["tokens"]
    assert "".join(p["piece"] for p in pieces) == text, pieces
    ids = [p["id"] for p in pieces]
    status, _, data = h.request("POST", "/detokenize", {"tokens": ids})
    assert status == 200 and json.loads(data)["content"] == text, data
    print(f"ok: /tokenize gives expert-run's prompt ids ({len(ref['prompt_tokens'])}); "
          f"/detokenize gives the text back")
    for path, body, param in (("/tokenize", {"content": 5}, "content"),
                              ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", [1, 2], None)):
        status, _, data = h.request("POST", path, body)
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == param, (path, body, status, data)
    status, headers, _ = h.request("GET", "/tokenize")
    assert status == 405 and headers.get("Allow") == "POST", status
    status, _, data = h.request("GET", "/props")
    props = json.loads(data)
    assert status == 200 and props["model"] == MODEL and props["context"] == CTX, props
    assert props["parallel"] == 1 and props["architecture"] == "qwen3moe", props
    assert "/tokenize" in props["endpoints"] and props["capabilities"]["chat"] is True, props
    print(f"ok: /props: {props['family']}, context {props['context']}, template "
          f"{props['chat_template']}; bad bodies get 400 naming the field")
    # /metrics: the server's counters (after the completions and chats above) and expertd's.
    status, headers, data = h.request("GET", "/metrics")
    text = data.decode()
    assert status == 200 and headers.get("Content-Type", "").startswith("text/plain"), headers
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["expert_serve_requests_total"] >= 3, values
    assert values["expert_serve_generated_tokens_total"] >= 8, values
    assert values["expert_serve_time_to_first_token_seconds_count"] >= 3, values
    assert values["expert_serve_daemon_up"] == 1, values
    assert values['expert_serve_responses_total{endpoint="/tokenize",status="400"}'] == 2, values
    assert values['expert_serve_responses_total{endpoint="/v1/completions",status="200"}'] >= 2
    assert any(k.startswith("expertd_") for k in values), "no expertd_ counter"
    assert "# TYPE expert_serve_decode_rows_total counter" in text
    print(f"ok: /metrics: {len(values)} samples, {int(values['expert_serve_requests_total'])} "
          f"requests, expertd's counters included")


def test_queue_and_disconnect(h, log_path):
    """--queue 1: one stream runs, one request waits, the next is refused with 503. The stream's
    client then leaves: its generation stops and the waiting request runs."""
    long_tokens = CTX - 16
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=60)
    conn.request("POST", "/v1/completions",
                 body=json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": long_tokens,
                                  "stream": True, "ignore_eos": True}),
                 headers={"Content-Type": "application/json"})
    stream = conn.getresponse()
    assert stream.status == 200
    wait_for("the long stream's first chunk", lambda: stream.readline().startswith(b"data: "))
    assert h.health()["running"], "the long stream is not running"

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    waiting = pool.submit(h.request, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": "Next", "max_tokens": 4})
    wait_for("the second request to queue", lambda: h.health()["queued"] == 1)
    status, headers, data = h.request("POST", "/v1/completions",
                                      {"model": MODEL, "prompt": "Third", "max_tokens": 4})
    assert status == 503, f"a request past --queue 1 got {status}: {data!r}"
    assert headers.get("Retry-After"), f"503 without Retry-After: {headers}"
    assert json.loads(data)["error"]["code"] == "queue_full"
    print(f"ok: full queue: 503, Retry-After {headers['Retry-After']}")

    # The client of the long stream leaves.
    stream.close()
    conn.close()
    status, _, data = waiting.result(timeout=30)
    assert status == 200, f"the waiting request got {status}: {data!r}"
    assert json.loads(data)["usage"]["completion_tokens"] == 4
    pool.shutdown()
    log = open(log_path, encoding="utf-8", errors="replace").read()
    m = re.search(r"the client left; stopped after (\d+) of (\d+) tokens", log)
    assert m, f"no log line for the stream whose client left:\n{log[-3000:]}"
    stopped = int(m.group(1))
    assert stopped < long_tokens, f"generation went on to {stopped} of {long_tokens} tokens"
    wait_for("the engine to be idle", lambda: not h.health()["running"])
    print(f"ok: the stream's client left: stopped after {stopped} of {long_tokens} tokens; the "
          f"waiting request then completed")

    # A client that leaves while its stream waits in the queue frees its place at once.
    def open_stream(prompt):
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=60)
        c.request("POST", "/v1/completions",
                  body=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": long_tokens,
                                   "stream": True, "ignore_eos": True}),
                  headers={"Content-Type": "application/json"})
        return c, c.getresponse()
    conn, stream = open_stream("Once more")
    wait_for("the long stream's first chunk", lambda: stream.readline().startswith(b"data: "))
    queued_conn, queued_stream = open_stream("Later")
    wait_for("the second stream to queue", lambda: h.health()["queued"] == 1)
    queued_stream.close()
    queued_conn.close()
    wait_for("the queue to free the place of the client that left",
             lambda: h.health()["queued"] == 0)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    waiting = pool.submit(h.request, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": "Next", "max_tokens": 4})
    wait_for("a new request to take the freed place", lambda: h.health()["queued"] == 1)
    stream.close()
    conn.close()
    status, _, data = waiting.result(timeout=30)
    assert status == 200, f"the request in the freed place got {status}: {data!r}"
    pool.shutdown()
    assert "the client left while it waited; dropped from the queue" in \
        open(log_path, errors="replace").read()
    print("ok: a stream whose client left while queued gave its place to the next request")


def run_briefly(argv):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    return out.returncode, out.stdout + out.stderr


def test_startup_errors(args, sock, port):
    serve = os.path.join(args.bin, "expert-serve")
    rc, out = run_briefly([serve, "--socket", os.path.join(args.workdir, "none.sock"), "--model",
                           MODEL, "--port", str(free_port())])
    assert rc != 0 and "cannot connect to expertd at" in out, f"no daemon: {rc} {out}"
    rc, out = run_briefly([serve, "--socket", sock, "--model", "nope", "--port", str(free_port())])
    assert rc != 0 and "'nope'" in out, f"unknown model: {rc} {out}"
    rc, out = run_briefly([serve, "--socket", sock, "--model", MODEL, "--port", str(port)])
    assert rc != 0 and f"cannot listen on 127.0.0.1:{port}" in out, f"port in use: {rc} {out}"
    rc, out = run_briefly([serve, "--help"])
    for flag in ("--socket", "--model", "--host", "--port", "--ctx", "--queue", "--cpu",
                 "--vram-experts", "--prefetch-depth", "--chat-template", "--reasoning-format",
                 "reasoning_content"):
        assert flag in out, f"--help does not mention {flag}"
    print("ok: startup errors name the socket, the model and the address in use")


def test_response_format(h, client):
    """Structured output: json_object and json_schema answers are JSON (of the schema) by
    constrained sampling, and end when the value closes; a schema that cannot be enforced is a
    400 naming the keyword's path."""
    schema = {"type": "object",
              "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                             "kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
              "required": ["name", "n", "kind"], "additionalProperties": False}
    formats = [{"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}]
    closed = 0
    for fmt in formats:
        closed_here = 0
        for seed in range(1, 7):
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "A pet, as JSON"}],
                max_tokens=2000, temperature=1.0, seed=seed, response_format=fmt)
            choice = r.choices[0]
            if choice.finish_reason != "stop":
                continue
            closed += 1
            closed_here += 1
            v = json.loads(choice.message.content)
            assert isinstance(v, dict), choice.message.content
            if fmt["type"] == "json_schema":
                assert set(v) <= set(schema["properties"]) and {"name", "n", "kind"} <= set(v), v
                assert isinstance(v["name"], str) and isinstance(v["n"], int), v
                assert v["kind"] in ("cat", "dog"), v
        assert closed_here >= 2, f"{fmt['type']}: {closed_here} of 6 answers closed"
    # (a random model writes long strings: the rest reach max_tokens inside one)
    bad = {"type": "json_schema",
           "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
               "a": {"type": "string", "pattern": "^x"}}}}}
    status, _, data = h.request("POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Hi"}],
                                 "response_format": bad})
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == "response_format.json_schema.schema", data
    assert "/properties/a/pattern" in err["message"], err
    status, _, data = h.request("POST", "/v1/completions",
                                {"prompt": "Hi", "response_format": {"type": "yaml"}})
    assert status == 400 and json.loads(data)["error"]["param"] == "response_format.type", data
    print(f"ok: response_format json_object and json_schema: {closed} of 12 sampled answers closed "
          "and parse (of the schema); an unenforceable schema is a 400 naming its keyword")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def start_tools_serve(args, sock, model, template, procs):
    """expert-serve for `model` with the chat template `template`; its client and Http."""
    port, h, _ = start_serve(args, sock, model,
                             ["--chat-template", template, "--ctx", "4096", "--cpu"], procs)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    return client, h


def streamed_forced_calls(client, names, **request):
    """Streams a forced call with seeds 1..4: in each, the call arrives as one tool_calls delta
    (no content), then finish tool_calls, its function one of `names` and its arguments an
    object; one cut at max_tokens is skipped. Returns how many closed (at least 2)."""
    streamed = 0
    for seed in range(1, 5):
        calls, finish, content = {}, None, ""
        for chunk in client.chat.completions.create(temperature=1.0, seed=seed, stream=True,
                                                    **request):
            d = chunk.choices[0].delta
            for tc in d.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])
                calls[tc.index][1] += tc.function.arguments or ""
            content += d.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if finish == "length":
            continue  # the call cut short comes as content
        assert not content, f"content streamed with a forced call: {content!r}"
        assert finish == "tool_calls" and calls[0][0] in names, calls
        assert isinstance(json.loads(calls[0][1]), dict), calls
        streamed += 1
    assert streamed >= 2, f"{streamed} of 4 streamed forced calls closed"
    return streamed


def test_tools(args, sock, model, template, label, plain_client=None):
    """Tool calls on a template whose calls are JSON with the function's name (Qwen3's
    <tool_call>, Mistral-Nemo's [TOOL_CALLS] list): a forced call (a named function, or required)
    comes back as message.tool_calls with finish_reason tool_calls and arguments of the function's
    schema, streamed or not; auto leaves a model that calls nothing answering text; a second turn
    with the call and its result renders; a template without tool syntax (`plain_client`'s)
    refuses tools by name."""
    procs = []
    try:
        client, h = start_tools_serve(args, sock, model, template, procs)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        called = 0
        for seed in range(1, 5):
            r = client.chat.completions.create(
                model=model, messages=ask, tools=[WEATHER, SEARCH], tool_choice=named,
                max_tokens=1500, temperature=1.0, seed=seed)
            c = r.choices[0]
            if c.finish_reason == "length":
                continue  # a random model's string ran past max_tokens
            assert c.finish_reason == "tool_calls", c
            call = c.message.tool_calls[0]
            assert call.type == "function" and call.function.name == "get_weather", call
            a = json.loads(call.function.arguments)
            assert isinstance(a.get("city"), str) and set(a) <= {"city", "unit"}, a
            assert a.get("unit", "c") in ("c", "f"), a
            called += 1
        assert called >= 2, f"{called} of 4 forced calls closed"
        # Streamed, required: the call arrives as one tool_calls delta, then finish tool_calls.
        streamed = streamed_forced_calls(
            client, ("get_weather", "search"), model=model, messages=ask,
            tools=[WEATHER, SEARCH], tool_choice="required", max_tokens=1500)
        # auto: the tools are in the prompt; a model that calls nothing answers text.
        plain = client.chat.completions.create(model=model, messages=ask, max_tokens=4)
        auto = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],
                                              max_tokens=4)
        assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50, (auto.usage, plain.usage)
        assert auto.choices[0].finish_reason in ("stop", "length"), auto
        check_tool_turn(client, model)
        status, _, data = h.request("POST", "/v1/chat/completions", {
            "messages": ask, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}})
        assert status == 400 and json.loads(data)["error"]["param"] == "tool_choice", data
        if plain_client:
            # ChatML (the other server) has no tool syntax: tools are a 400 naming the template.
            try:
                plain_client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER])
                raise AssertionError("tools on a ChatML model were accepted")
            except openai.BadRequestError as e:
                assert "chatml" in str(e) and "tools" in str(e), e
        print(f"ok: tools ({label}): {called} of 4 named calls and {streamed} of 4 streamed "
              "required calls came back as tool_calls of the schema; auto renders the tools; a "
              "tool turn renders" + ("; ChatML refuses tools" if plain_client else ""))
    finally:
        stop_procs(procs)


def test_tools_named(args, sock, model, template, label):
    """Tool calls on a template whose calls write the function's name outside the JSON (gpt-oss's
    commentary header to=functions.NAME, DeepSeek-V3.1's NAME<｜tool▁sep｜>, Mistral-Small-3.2's
    [TOOL_CALLS]NAME[ARGS]), on a tiny fixture: a named forced call (the call's opening
    prefilled, the arguments constrained to the schema) comes back as message.tool_calls,
    streamed or not, and so does required with one tool; thinking on, the prompt closes its think
    block before the call; required with several tools is a 400; a turn with a call and its
    result renders."""
    procs = []
    try:
        client, h = start_tools_serve(args, sock, model, template, procs)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        called = 0
        for seed in range(1, 5):
            r = client.chat.completions.create(
                model=model, messages=ask, tools=[WEATHER, SEARCH] if seed % 2 else [WEATHER],
                tool_choice=named if seed % 2 else "required", max_tokens=600, temperature=1.0,
                seed=seed)
            c = r.choices[0]
            if c.finish_reason == "length":
                continue
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            call = c.message.tool_calls[0]
            assert call.function.name == "get_weather", call
            a = json.loads(call.function.arguments)
            assert isinstance(a.get("city"), str) and set(a) <= {"city", "unit"}, a
            called += 1
        assert called >= 2, f"{called} of 4 forced calls closed"
        streamed = streamed_forced_calls(client, ("get_weather",), model=model, messages=ask,
                                         tools=[WEATHER, SEARCH], tool_choice=named,
                                         max_tokens=600)
        # Thinking on (DeepSeek-V3.1's generation prompt opens <think>): the block is closed
        # before the call, which makes the prompt the one without thinking.
        prompts = [client.chat.completions.create(
            model=model, messages=ask, tools=[WEATHER], tool_choice=named, max_tokens=1,
            extra_body={"chat_template_kwargs": {"thinking": thinking}}).usage.prompt_tokens
            for thinking in (False, True)]
        assert prompts[0] == prompts[1], prompts
        status, _, data = h.request("POST", "/v1/chat/completions", {
            "messages": ask, "tools": [WEATHER, SEARCH], "tool_choice": "required"})
        error = json.loads(data)["error"]
        assert status == 400 and error["param"] == "tool_choice", data
        assert "name one function" in error["message"], error
        check_tool_turn(client, model)
        print(f"ok: tools ({label}): {called} of 4 forced calls and {streamed} of 4 streamed "
              "named calls came back as tool_calls of the schema; required with several tools "
              "is a 400; a tool turn renders")
    finally:
        stop_procs(procs)


def check_tool_turn(client, model):
    """A conversation with a call and its result (OpenAI's form of id) renders (and generates)."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    call_id = "call_Qm9vQ2FsbElkMTIzNDU2"
    turn = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "21 C, clear"}]
    plain = client.chat.completions.create(model=model, messages=ask, max_tokens=2)
    r = client.chat.completions.create(model=model, messages=turn, tools=[WEATHER], max_tokens=2)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 100, (r.usage, plain.usage)


def byte_tokens(tokens):
    """GPT-2's byte-level spelling: each byte's token text -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xa1, 0xad))
                 + list(range(0xae, 0x100)))
    spelled, n = {}, 0
    for b in range(256):
        if b in printable:
            spelled[chr(b)] = b
        else:
            spelled[chr(256 + n)] = b
            n += 1
    return {i: spelled[t] for i, t in enumerate(tokens) if t in spelled}


CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# Answers to spell, per template: the text of each of the answer's first tokens, and the
# reasoning and content it reads as beside the call.
SPELLED_CALLS = [
    ("gptoss-tiny", "gpt-oss",
     ["<|channel|>analysis<|message|>Rain?<|end|>",
      "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
      '<|message|>{"city": "Paris"}'], "Rain?", None),
    ("qwen3moe-tiny", "qwen3", ["Checking.\n<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"],
     None, "Checking."),
    ("deepseek3-tiny", "deepseek3",
     ["Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
      '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'], None, "Checking."),
    ("deepseek4-tiny", "deepseek4",
     ["Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
      '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
      "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"], None, "Checking."),
]


def test_tools_spelled_answer(args, fixture, template, pieces, want_reasoning, want_content):
    """A model's own call, as "auto" reads it (through the reasoning splitter, streamed or not):
    the tiny fixture's greedy answer to a request with tools, its first tokens spelled as
    `pieces` in a copy of the GGUF (as serve_reasoning_test.py spells answers), comes back as
    reasoning_content, content and message.tool_calls with finish_reason tool_calls."""
    import gguf
    from serve_reasoning_test import CONTROL, write_gguf
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(args.gguf))), fixture,
                       "model-f32.gguf")
    tokens = list(gguf.GGUFReader(src).fields["tokenizer.ggml.tokens"].contents())
    id_of = {b: i for i, b in byte_tokens(tokens).items()}
    # gpt-oss's prompt has <|end|> after each turn: one special token, a control byte's.
    end = {id_of[2]: ("<|end|>", CONTROL)} if template == "gpt-oss" else {}
    plain, spelled = (os.path.join(args.workdir, f"{fixture}-{n}.gguf") for n in ("plain", "call"))
    write_gguf(src, plain, "", end)
    sock = os.path.join(args.workdir, "spelled.sock")
    procs = []
    request = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "tools": [WEATHER], "max_tokens": len(pieces), "temperature": 0}

    def serve(gguf_path):
        start_expertd(args, [f"m={gguf_path}"], sock, procs)
        port, _, _ = start_serve(args, sock, "m", ["--chat-template", template, "--ctx", "4096",
                                                   "--cpu"], procs)
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                             max_retries=0, timeout=60)
    try:
        r = serve(plain).chat.completions.create(logprobs=True, **request)
        # The answer's tokens are bytes that no prompt here has (control bytes, bytes of
        # multi-byte characters): they can be spelled anew without changing the prompt's tokens.
        answer = [bytes(t.bytes) for t in r.choices[0].logprobs.content]
        assert len(set(answer)) == len(pieces) and all(
            len(b) == 1 and (b[0] >= 0x80 or b[0] < 0x20 and b[0] not in b"\x02\t\n\r")
            for b in answer), f"the fixture's answer cannot be spelled: {answer}"
        prompt_tokens = r.usage.prompt_tokens
        stop_procs(procs)
        write_gguf(src, spelled, "", {**end, **{id_of[b[0]]: (text, CONTROL)
                                                for b, text in zip(answer, pieces)}})
        client = serve(spelled)
        r = client.chat.completions.create(**request)
        assert r.usage.prompt_tokens == prompt_tokens, "the prompt encodes differently"
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert (c.message.model_extra or {}).get("reasoning_content") == want_reasoning, c.message
        assert c.message.content == want_content, c.message
        calls = [{"name": t.function.name, "arguments": json.loads(t.function.arguments)}
                 for t in c.message.tool_calls]
        assert calls == [CALL], calls
        reasoning, content, deltas, finish = "", "", [], None
        for chunk in client.chat.completions.create(stream=True, **request):
            d = chunk.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            deltas += d.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert (reasoning or None, content or None, finish) == \
            (want_reasoning, want_content, "tool_calls"), (reasoning, content, finish)
        assert [{"name": t.function.name, "arguments": json.loads(t.function.arguments)}
                for t in deltas] == calls, deltas
        print(f"ok: tools ({template}, auto): the model's own call comes back as tool_calls "
              "(reasoning and content beside it), streamed or not")
    finally:
        stop_procs(procs)


def test_tools_dsml(args, sock):
    """DeepSeek-V4's template (the deepseek4-tiny fixture): its DSML calls are not JSON, so a
    forced call is a 400; auto writes the tools into the system prompt; a tool turn renders."""
    procs = []
    try:
        client, h = start_tools_serve(args, sock, "ds4", "deepseek4", procs)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        status, _, data = h.request("POST", "/v1/chat/completions", {
            "messages": ask, "tools": [WEATHER], "tool_choice": "required"})
        error = json.loads(data)["error"]
        assert status == 400 and "not JSON" in error["message"], data
        plain = client.chat.completions.create(model="ds4", messages=ask, max_tokens=2)
        auto = client.chat.completions.create(model="ds4", messages=ask, tools=[WEATHER],
                                              max_tokens=2)
        assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 500, (auto.usage, plain.usage)
        check_tool_turn(client, "ds4")
        print("ok: tools (DeepSeek-V4): a forced call is a 400; auto renders the tools; a tool turn "
              "renders")
    finally:
        stop_procs(procs)


def test_two_models(args, sock, tiny_h, odd_h):
    """Several models behind one port: --model twice; a request's "model" picks the engine, and
    each answers as the server of that model alone does."""
    procs = []
    try:
        port, h, _ = start_serve(args, sock, MODEL, ["--model", "odd", "--ctx", "256", "--cpu"],
                                 procs)
        status, _, data = h.request("GET", "/v1/models")
        assert status == 200, data
        assert [m["id"] for m in json.loads(data)["data"]] == [MODEL, "odd"], data
        req = {"prompt": "Once upon", "max_tokens": 6}
        for name, alone in ((MODEL, tiny_h), ("odd", odd_h)):
            status, _, both = h.request("POST", "/v1/completions", dict(req, model=name))
            assert status == 200, both
            status, _, one = alone.request("POST", "/v1/completions", dict(req, model=name))
            assert status == 200, one
            assert json.loads(both)["choices"][0]["text"] == json.loads(one)["choices"][0]["text"]
        status, _, data = h.request("POST", "/v1/completions", req)
        assert status == 400 and json.loads(data)["error"]["param"] == "model", data
        status, _, data = h.request("POST", "/v1/completions", dict(req, model="nope"))
        assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found", data
        status, _, data = h.request("GET", "/props?model=odd")
        assert status == 200 and json.loads(data)["model"] == "odd", data
        assert json.loads(data)["models"] == [MODEL, "odd"], data
        status, _, data = h.request("GET", "/metrics")
        text = data.decode()
        assert f'expert_serve_requests_total{{model="{MODEL}"}} 1' in text, text[:2000]
        assert 'expert_serve_requests_total{model="odd"} 1' in text, text[:2000]
        assert text.count("# TYPE expert_serve_requests_total ") == 1, text[:2000]
        health = h.health()
        assert set(health["models"]) == {MODEL, "odd"}, health
        twice = subprocess.run(
            [os.path.join(args.bin, "expert-serve"), "--socket", sock, "--model", "odd",
             "--model", "odd", "--port", str(free_port())],
            capture_output=True, text=True, timeout=20)
        assert twice.returncode == 1 and "--model odd is given twice" in twice.stderr, twice
        print("ok: two models behind one port: each request to its model's engine, answers as "
              "each alone; no model 400, unknown 404; /metrics labelled by model")
    finally:
        stop_procs(procs)


def test_unsupported_template(args, sock, procs):
    """A model whose chat template no family matches: chat requests get a 400 naming it, and
    completions still work."""
    port = free_port()
    log_path = os.path.join(args.workdir, "expert-serve-odd.log")
    procs.append(subprocess.Popen(
        [os.path.join(args.bin, "expert-serve"), "--socket", sock, "--model", "odd", "--port",
         str(port), "--ctx", "256", "--cpu", "--reconnect-timeout", "3"],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT))
    h = Http(port)

    def up():
        if procs[-1].poll() is not None:
            raise AssertionError(f"expert-serve exited: {open(log_path).read()}")
        try:
            return h.health()["status"] == "ok"
        except OSError:
            return False
    wait_for("expert-serve (odd)'s /health", up)
    status, _, data = h.request("POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400, f"chat with an unsupported template: {status} {data!r}"
    message = json.loads(data)["error"]["message"]
    assert "<<{{ m.content }}>>" in message, message
    status, _, data = h.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, f"completion on the model with an odd template: {status} {data!r}"
    assert "chat completions are off" in open(log_path).read()
    print(f"ok: unsupported chat template: chat 400 ({message!r}), completions 200")
    return procs[-1], h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    sock = os.path.join(args.workdir, "expertd.sock")
    # The fixture with a chat template no family matches.
    odd = os.path.join(args.workdir, "odd.gguf")
    new_metadata = os.path.join(os.path.dirname(sys.executable), "gguf-new-metadata")
    subprocess.run([new_metadata, "--chat-template",
                    "{% for m in messages %}<<{{ m.content }}>>{% endfor %}", args.gguf, odd],
                   check=True, capture_output=True, timeout=60)
    procs = []
    try:
        # gpt-oss's, DeepSeek's and Mixtral's fixtures, for their templates' tool calls.
        fixtures = os.path.dirname(os.path.dirname(os.path.abspath(args.gguf)))
        others = [f"{name}={os.path.join(fixtures, d, 'model-f32.gguf')}" for name, d in
                  (("oss", "gptoss-tiny"), ("ds3", "deepseek3-tiny"), ("ds4", "deepseek4-tiny"),
                   ("mix", "mixtral-tiny"))]
        start_expertd(args, [f"{MODEL}={args.gguf}", f"odd={odd}"] + others, sock, procs)
        port, h, log_path = start_serve(args, sock, MODEL,
                                        ["--ctx", str(CTX), "--queue", "1", "--parallel", "1", "--cpu"], procs)

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL], models
        print(f"ok: /v1/models lists {MODEL}")

        test_completions(args, sock, client)
        test_chat(args, sock, client)
        test_bad_requests(h, client)
        test_tokenize_and_props(args, sock, h)
        test_logprobs(client)
        test_bias_and_penalties(h, client)
        test_choices(client)
        test_response_format(h, client)
        test_queue_and_disconnect(h, log_path)
        test_startup_errors(args, sock, port)
        odd_serve, odd_h = test_unsupported_template(args, sock, procs)
        test_two_models(args, sock, h, odd_h)
        test_tools(args, sock, MODEL, "qwen3", "Qwen3", client)
        test_tools(args, sock, "mix", "mistral-nemo", "Mistral-Nemo")
        test_tools_named(args, sock, "oss", "gpt-oss", "gpt-oss")
        test_tools_named(args, sock, "ds3", "deepseek3", "DeepSeek-V3.1")
        test_tools_named(args, sock, "mix", "mistral-small-3.2", "Mistral-Small-3.2")
        test_tools_dsml(args, sock)
        for case in SPELLED_CALLS:
            test_tools_spelled_answer(args, *case)

        # SIGTERM in the middle of a stream: the stream ends with an error event, the server
        # exits 0 without generating the rest.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions",
                     body=json.dumps({"prompt": "Once", "max_tokens": CTX - 16, "stream": True,
                                      "ignore_eos": True}),
                     headers={"Content-Type": "application/json"})
        stream = conn.getresponse()
        wait_for("a stream's first chunk", lambda: stream.readline().startswith(b"data: "))
        serve = procs.pop(1)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=20) == 0, f"expert-serve exited {serve.returncode}"
        rest = stream.read()
        conn.close()
        assert b"the server is shutting down" in rest and rest.endswith(b"data: [DONE]\n\n"), \
            rest[-300:]
        print("ok: SIGTERM mid-stream: the stream ends with an error event, expert-serve exits 0")

        # expertd goes away: /health turns 503 naming it (its ping), requests get 503 with
        # Retry-After while expert-serve waits for expertd, and once --reconnect-timeout (3 s)
        # has passed it exits 1, so that its unit (Restart=on-failure) starts it again.
        # (tests/chaos/serve_chaos.py has expertd coming back.)
        daemon = procs.pop(0)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=20) == 0, f"expertd exited {daemon.returncode}"
        t0 = time.monotonic()

        def health_503():
            status, _, data = odd_h.request("GET", "/health")
            return (status, data) if status == 503 else None
        status, data = wait_for("/health's 503", health_503, timeout=2.5)
        assert b"expertd" in data, data
        status, headers, data = odd_h.request("POST", "/v1/completions",
                                              {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and headers.get("Retry-After") == "1", f"{status} {data!r}"
        assert odd_serve.wait(timeout=20) == 1, f"expert-serve exited {odd_serve.returncode}"
        procs.remove(odd_serve)
        print(f"ok: expertd went away: /health 503 after {time.monotonic() - t0:.2f} s, "
              "requests 503, then expert-serve exits 1 after --reconnect-timeout")
    except BaseException:
        for name in ("expert-serve.log", "expertd.log"):
            path = os.path.join(args.workdir, name)
            if os.path.exists(path):
                print(f"--- {name} (last 3000 bytes)", file=sys.stderr)
                print(open(path, errors="replace").read()[-3000:], file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    print("expert-serve: all checks passed")


if __name__ == "__main__":
    main()
