#!/usr/bin/env python3
"""expert-serve under hostile or unlucky clients (the chaos suite, issue 26's HTTP layer): a real
expertd serving the qwen3moe-tiny fixture, a real expert-serve (--cpu) on a free loopback port,
driven by raw sockets where a well-behaved client would not do what the case needs.

One case a run (--case), each bounded in time and asserting the numbers it measures:

  slow_clients      50 connections send a request head one byte a second for 20 s (the default
                    --header-timeout, 10 s): /health and a small completion keep answering within
                    1 s meanwhile, and each slow connection is cut (408 or closed) once its head
                    is 10 s old; --max-connections 8: the 9th connection gets a quick 503.
  big_prompts       12 requests at once with a 50 MB prompt each (--ctx 256): 413 or 400, never
                    200 or 500; expert-serve's peak RSS stays below 1 GiB, its RSS comes back to
                    within 50 MiB of what it was, and a completion then works. The same for 12
                    bodies just under the limit the 413 names: 400 naming the prompt.
  daemon_restart    expertd SIGKILLed: /health 503 naming expertd within 2 s, completions 503;
                    expertd back on the same socket: /health 200 within 10 s, completions work;
                    with --reconnect-timeout 2, expert-serve exits 1 when expertd stays away.
  dropped_requests  20 non-streaming completions (6000 tokens, --ctx 8192) whose client closes
                    the connection mid-generation: each stops within 1 s (running back to 0), the
                    log and /metrics count only the tokens generated before, nothing leaks.
  protocol          a number beyond double's range, a negative Content-Length and malformed HTTP
                    are 400s; pipelined requests are answered in order; --api-key and
                    --api-key-file (401 invalid_api_key, /health exempt); --cors-origin;
                    Expect: 100-continue.

usage: serve_chaos.py --case NAME --bin BUILD/bin --gguf model-f32.gguf --workdir DIR
"""
import argparse
import glob
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

MODEL = "tiny"
CTX = 256
MiB = 1 << 20


# --- the harness (after tests/python/serve_test.py's) ---

def wait_for(what, predicate, timeout=20.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Http:
    """One request a connection, through http.client."""

    def __init__(self, port):
        self.port = port

    def request(self, method, path, body=None, headers=None, timeout=30):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            elif isinstance(body, str):
                body = body.encode()
            h = {"Content-Type": "application/json"} if body is not None else {}
            h.update(headers or {})
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            conn.close()

    def health(self):
        status, _, data = self.request("GET", "/health")
        assert status == 200, f"/health answered {status}: {data!r}"
        return json.loads(data)

    def complete(self, prompt="Once", max_tokens=4, headers=None, timeout=30):
        status, h, data = self.request("POST", "/v1/completions",
                                       {"prompt": prompt, "max_tokens": max_tokens,
                                        "ignore_eos": True}, headers, timeout)
        assert status == 200, f"a completion ({prompt!r}, {max_tokens} tokens): {status} {data!r}"
        answer = json.loads(data)
        tokens = answer["usage"]["completion_tokens"]
        assert tokens == max_tokens, f"a completion gave {tokens} tokens of {max_tokens}"
        return answer


class Raw:
    """A raw TCP connection: sends bytes as given, reads the answers one at a time."""

    def __init__(self, port, timeout=10.0, sock=None):
        self.sock = sock or socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, data):
        self.sock.sendall(data)

    def _fill(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no (whole) answer in time; got {self.buf[:300]!r}")
        self.sock.settimeout(left)
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError(f"the server closed the connection; got {self.buf[:300]!r}")
        self.buf += data

    def response(self, timeout=10.0):
        """The next answer: (status, headers with lower-case names, body)."""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in self.buf:
            self._fill(deadline)
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._fill(deadline)
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def closed_by_server(self, timeout=2.0):
        """Whether the server closes the connection (EOF or reset) within `timeout` s; what it
        sends meanwhile is kept."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._fill(deadline)
        except (EOFError, ConnectionResetError):
            return True
        except TimeoutError:
            return False

    def readable(self, timeout=0.0):
        return bool(self.buf) or bool(select.select([self.sock], [], [], timeout)[0])

    def close(self):
        self.sock.close()


def post_head(path, length, extra=""):
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def proc_status(pid):
    """/proc/PID/status's fields (VmRSS, VmHWM, Threads, ...)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            out[name] = value.strip()
    return out


def mem_bytes(pid, field):
    return int(proc_status(pid)[field].split()[0]) * 1024


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def metrics(h):
    status, _, data = h.request("GET", "/metrics")
    assert status == 200, f"/metrics: {status} {data[:300]!r}"
    values = {}
    for line in data.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


class Serve:
    """An expert-serve process: its port, an Http on it and its log."""

    def __init__(self, proc, port, log_path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.h = Http(port)

    def log(self):
        return open(self.log_path, encoding="utf-8", errors="replace").read()

    def wait_up(self, timeout=30.0):
        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"expert-serve exited {self.proc.returncode}: "
                                     f"{self.log()[-3000:]}")
            try:
                return self.h.health()["status"] == "ok"
            except (OSError, AssertionError, http.client.HTTPException):
                return False
        wait_for(f"expert-serve's /health ({os.path.basename(self.log_path)})", up, timeout,
                 step=0.05)
        return self


def start_expertd(args, sock, procs, log_name="expertd.log"):
    """expertd serving the fixture as MODEL on `sock` (16 MiB cache, no mlock), up when it
    returns; appended to `procs`. Its log is appended to (a restart keeps the first one's)."""
    log = open(os.path.join(args.workdir, log_name), "a")
    cmd = [os.path.join(args.bin, "expertd"), "--socket", sock, "--cache", "16MiB", "--no-mlock",
           "--model", f"{MODEL}={args.gguf}"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    procs.append(proc)

    def daemon_up():
        if proc.poll() is not None:
            raise AssertionError(f"expertd exited {proc.returncode}")
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(sock)
                return True
            except OSError:
                return False
    wait_for("expertd's socket", daemon_up)
    return proc


def start_serve(args, sock, procs, extra=(), name="expert-serve", ctx=CTX):
    """expert-serve --cpu for MODEL on a free port (not waited for: Serve.wait_up); appended to
    `procs`."""
    port = free_port()
    log_path = os.path.join(args.workdir, f"{name}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [os.path.join(args.bin, "expert-serve"), "--cpu", "--socket", sock, "--model", MODEL,
         "--port", str(port), "--ctx", str(ctx)] + list(extra), stdout=log, stderr=log)
    procs.append(proc)
    return Serve(proc, port, log_path)


def stop_all(procs):
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    procs.clear()


# --- slow_clients ---

SLOW_HEAD = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: one-byte-a-second\r\n"
             b"Accept: */*\r\n\r\n")


class SlowClients(threading.Thread):
    """`n` connections, each sending SLOW_HEAD one byte a second (never its end) for `duration`
    s; a connection the server cuts is replaced by a new one. `cuts` gets (seconds from the
    connection's first byte to the server's answer or close, the status line or how it ended)."""

    def __init__(self, port, n, duration):
        super().__init__(daemon=True)
        assert len(SLOW_HEAD) > duration + 2, "the slow head would be complete"
        self.port, self.n, self.duration = port, n, duration
        self.cuts = []
        self.opened = 0
        self.left_open = []  # seconds since the first byte of those still open at the end
        self.error = None

    def open(self, now):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.setblocking(False)
        self.opened += 1
        return {"sock": s, "sent": 0, "first": None, "next": now, "got": b""}

    def cut(self, slots, i, now, how):
        c = slots[i]
        line = c["got"].split(b"\r\n", 1)[0].decode("latin-1")
        self.cuts.append((now - c["first"] if c["first"] else None, line or how))
        c["sock"].close()
        slots[i] = self.open(now) if now < self.end - 1 else None

    def run(self):
        try:
            start = time.monotonic()
            self.end = start + self.duration
            slots = [self.open(start) for _ in range(self.n)]
            while True:
                now = time.monotonic()
                if now >= self.end:
                    break
                for i, c in enumerate(slots):
                    if c is None or c["next"] > now:
                        continue
                    try:
                        c["sock"].send(SLOW_HEAD[c["sent"]:c["sent"] + 1])
                    except (BrokenPipeError, ConnectionResetError):
                        self.cut(slots, i, now, "send failed")
                        continue
                    if c["first"] is None:
                        c["first"] = now
                    c["sent"] += 1
                    c["next"] += 1.0
                live = [c["sock"] for c in slots if c]
                nxt = min([c["next"] for c in slots if c] + [self.end])
                ready, _, _ = select.select(live, [], [], max(0.0, min(nxt, self.end) - now))
                now = time.monotonic()
                for i, c in enumerate(slots):
                    if c is None or c["sock"] not in ready:
                        continue
                    try:
                        data = c["sock"].recv(4096)
                    except ConnectionResetError:
                        self.cut(slots, i, now, "reset")
                        continue
                    except BlockingIOError:
                        continue
                    c["got"] += data
                    if not data or b"\r\n\r\n" in c["got"]:
                        self.cut(slots, i, now, "closed")
            now = time.monotonic()
            for c in slots:
                if c:
                    self.left_open.append(now - c["first"] if c["first"] else 0.0)
                    c["sock"].close()
        except BaseException as e:  # reported by the main thread
            self.error = e


def case_slow_clients(args, sock, procs):
    header_timeout = 10.0  # expert-serve's default --header-timeout
    start_expertd(args, sock, procs)
    serve = start_serve(args, sock, procs)
    capped = start_serve(args, sock, procs, ["--max-connections", "8"], "expert-serve-capped")
    serve.wait_up()
    capped.wait_up()
    h = serve.h
    h.complete()

    duration, n = 20.0, 50
    slow = SlowClients(serve.port, n, duration)
    slow.start()
    health_lat, complete_lat = [], []
    next_probe = time.monotonic()
    while slow.is_alive():
        t0 = time.monotonic()
        status, _, data = h.request("GET", "/health", timeout=5)
        health_lat.append(time.monotonic() - t0)
        assert status == 200 and json.loads(data)["status"] == "ok", \
            f"/health among the slow clients: {status} {data!r}"
        t0 = time.monotonic()
        h.complete(timeout=5)
        complete_lat.append(time.monotonic() - t0)
        next_probe += 0.5
        time.sleep(max(0.0, next_probe - time.monotonic()))
    slow.join(timeout=5)
    if slow.error:
        raise slow.error

    worst_h, worst_c = max(health_lat), max(complete_lat)
    print(f"{len(health_lat)} probes among {n} slow connections ({slow.opened} opened over "
          f"{duration:.0f} s): worst /health {worst_h * 1000:.0f} ms, worst completion "
          f"{worst_c * 1000:.0f} ms")
    assert len(health_lat) >= duration / 0.5 * 0.6, \
        f"only {len(health_lat)} probes in {duration} s (every 0.5 s planned)"
    assert worst_h < 1.0, f"/health took {worst_h:.3f} s among the slow clients (limit 1 s)"
    assert worst_c < 1.0, f"a 4-token completion took {worst_c:.3f} s among the slow clients"

    # Every slow connection was cut once its head was header_timeout old, not before, and with a
    # 408 (or closed), not answered otherwise.
    times = [t for t, _ in slow.cuts if t is not None]
    kinds = {}
    for _, how in slow.cuts:
        kinds[how] = kinds.get(how, 0) + 1
    print(f"cuts: {len(slow.cuts)} ({kinds}), {min(times):.2f} .. {max(times):.2f} s after the "
          f"first byte (--header-timeout {header_timeout:.0f}); still open at the end: "
          f"{len(slow.left_open)}, the oldest {max(slow.left_open, default=0):.2f} s")
    assert len(slow.cuts) >= n, \
        f"only {len(slow.cuts)} of the {n} slow connections were cut in {duration} s"
    bad = [(t, how) for t, how in slow.cuts
           if not (how.startswith("HTTP/1.1 408") or how in ("closed", "reset"))]
    assert not bad, f"slow connections answered otherwise than 408/close: {bad[:5]}"
    early = [t for t in times if t < header_timeout - 0.25]
    late = [t for t in times if t > header_timeout + 2.0]
    assert not early, f"{len(early)} slow heads cut before {header_timeout} s: {early[:5]}"
    assert not late, f"{len(late)} slow heads cut after more than {header_timeout} + 2 s: " \
        f"{late[:5]}"
    assert all(t <= header_timeout + 2.0 for t in slow.left_open), \
        f"slow connections open past the header timeout: {sorted(slow.left_open)[-5:]}"
    got_408 = sum(1 for _, how in slow.cuts if how.startswith("HTTP/1.1 408"))
    assert got_408 >= n // 2, f"most cut connections should have read the 408: {kinds}"

    # --max-connections 8: eight idle connections, the ninth is refused at once.
    time.sleep(0.3)  # the start's probe connections are closed by now
    idle = [Raw(capped.port) for _ in range(8)]
    time.sleep(0.3)
    refused = [i for i, c in enumerate(idle) if c.readable(0.0)]
    assert not refused, f"idle connections {refused} of 8 were answered (refused?) under the cap"
    t0 = time.monotonic()
    ninth = Raw(capped.port)
    status, headers, body = ninth.response(timeout=5)
    took = time.monotonic() - t0
    closed = ninth.closed_by_server(2.0)
    ninth.close()
    print(f"--max-connections 8: the 9th connection got {status} in {took * 1000:.0f} ms "
          f"(Retry-After {headers.get('retry-after')}), closed: {closed}")
    assert status == 503 and headers.get("retry-after") == "1", \
        f"the 9th connection: {status} {headers} {body!r}"
    assert took < 1.0, f"the 9th connection's 503 took {took:.3f} s"
    assert closed, "the refused connection was not closed"
    for c in idle:
        c.close()
    t0 = time.monotonic()

    def health_again():
        try:
            return capped.h.health()["status"] == "ok"
        except (OSError, AssertionError, http.client.HTTPException):
            return False
    wait_for("/health once the idle connections closed", health_again, timeout=2.0)
    print(f"--max-connections 8: /health answers again {time.monotonic() - t0:.3f} s after the "
          f"idle connections closed")


# --- big_prompts ---

def post_big(port, body, results, i):
    """POSTs `body` to /v1/completions, stopping to send once the server answers; results[i] =
    (status or what happened, bytes of the body sent, seconds, the answer's body)."""
    t0 = time.monotonic()
    sent = 0
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        raw = Raw(port, sock=s)
        s.sendall(post_head("/v1/completions", len(body)))
        view = memoryview(body)
        while sent < len(body):
            if select.select([s], [], [], 0)[0]:
                break  # an early answer (413)
            try:
                sent += s.send(view[sent:sent + MiB])
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
        status, _, data = raw.response(timeout=60)
        raw.close()
        results[i] = (status, sent, time.monotonic() - t0, data[:300])
    except Exception as e:
        results[i] = (f"{type(e).__name__}: {e}", sent, time.monotonic() - t0, b"")


def post_wave(port, body, n):
    """`n` clients POST `body` at once; their post_big results and the seconds all took."""
    results = [None] * n
    t0 = time.monotonic()
    threads = [threading.Thread(target=post_big, args=(port, body, results, i), daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, 60 - (time.monotonic() - t0)))
    return results, time.monotonic() - t0


def prompt_body(size):
    words = b"hello world "
    return b'{"prompt": "' + words * (size // len(words)) + b'", "max_tokens": 2}'


def case_big_prompts(args, sock, procs):
    start_expertd(args, sock, procs)
    serve = start_serve(args, sock, procs).wait_up()
    h, pid = serve.h, serve.proc.pid
    h.complete()
    h.complete(max_tokens=16)
    rss_before = mem_bytes(pid, "VmRSS")
    hwm_before = mem_bytes(pid, "VmHWM")
    print(f"expert-serve RSS before: {rss_before / MiB:.0f} MiB (VmHWM {hwm_before / MiB:.0f} MiB)")

    samples = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                samples.append(mem_bytes(pid, "VmRSS"))
            except (OSError, KeyError):
                return
            time.sleep(0.02)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def memory_after(what):
        """The peak stayed below 1 GiB, the RSS comes back to within 50 MiB of before (a moment
        for the last answers' buffers to be freed), and a completion works."""
        hwm = mem_bytes(pid, "VmHWM")
        peak = max(samples + [hwm])
        assert serve.proc.poll() is None, f"expert-serve exited {serve.proc.returncode}"
        try:
            wait_for("RSS to come back", lambda: mem_bytes(pid, "VmRSS") <= rss_before + 50 * MiB,
                     timeout=5.0, step=0.1)
        except AssertionError:
            pass
        rss = mem_bytes(pid, "VmRSS")
        print(f"after {what}: peak RSS {peak / MiB:.0f} MiB (VmHWM {hwm / MiB:.0f} MiB, sampled "
              f"{max(samples, default=0) / MiB:.0f} MiB, {len(samples)} samples so far); RSS "
              f"{rss / MiB:.0f} MiB ({(rss - rss_before) / MiB:+.0f} MiB)")
        assert peak < 1 << 30, \
            f"{what}: expert-serve's peak RSS was {peak / MiB:.0f} MiB (limit 1024 MiB)"
        assert rss <= rss_before + 50 * MiB, \
            f"{what}: RSS {rss_before / MiB:.0f} MiB before, {rss / MiB:.0f} MiB after (+50 MiB " \
            f"allowed)"
        t0 = time.monotonic()
        answer = h.complete()
        print(f"a completion right after: 200 in {(time.monotonic() - t0) * 1000:.0f} ms, "
              f"{answer['choices'][0]['text']!r}")
        assert h.health()["running"] == 0

    try:
        # 12 prompts of 50 MB: refused (413 from Content-Length, or 400), never read whole 12
        # times.
        n = 12
        body = prompt_body(50_000_000)
        results, took = post_wave(serve.port, body, n)
        statuses = [r[0] if r else "no answer" for r in results]
        print(f"{n} requests of {len(body) / 1e6:.1f} MB: {statuses} in {took:.2f} s; body bytes "
              f"sent before the answer: {[r[1] if r else None for r in results]}")
        print(f"first answer: {results[0] and results[0][3]!r}")
        assert all(s in (413, 400) for s in statuses), \
            f"50 MB prompts must get 413 or 400: {statuses}; " \
            f"bodies: {[r and r[3] for r in results]}"
        memory_after(f"{n} prompts of 50 MB")

        # Just under the body limit a 413 names: the prompt is still far more than --ctx 256
        # tokens can hold: a 400 naming the prompt; the memory goes back as well.
        m = re.search(rb"larger than (\d+) bytes", b"".join(r[3] for r in results if r))
        if not m:
            print("no 413 named the body limit: the requests just under it are not sent")
            return
        limit = int(m.group(1))
        under = prompt_body(limit - 64 * 1024)
        assert len(under) < limit
        results, took = post_wave(serve.port, under, n)
        statuses = [r[0] if r else "no answer" for r in results]
        print(f"{n} requests of {len(under) / 1e6:.2f} MB (the body limit {limit} bytes): "
              f"{statuses} in {took:.2f} s; first answer: {results[0] and results[0][3]!r}")
        assert all(s == 400 for s in statuses), \
            f"prompts under the body limit, over the context: {statuses}; " \
            f"{[r and r[3] for r in results]}"
        assert all(b'"param":"prompt"' in r[3] for r in results), [r[3] for r in results]
        memory_after(f"{n} prompts of {len(under) / 1e6:.2f} MB")
    finally:
        stop.set()
        sampler.join(timeout=2)


# --- daemon_restart ---

def case_daemon_restart(args, sock, procs):
    daemon = start_expertd(args, sock, procs)
    serve = start_serve(args, sock, procs).wait_up()
    h = serve.h
    h.complete()

    # expertd dies while expert-serve is idle.
    daemon.kill()
    daemon.wait(timeout=10)
    t0 = time.monotonic()

    def health_503():
        status, _, data = h.request("GET", "/health", timeout=5)
        return (status, data) if status == 503 else None
    status, data = wait_for("/health's 503 after expertd died", health_503, timeout=5.0)
    to_503 = time.monotonic() - t0
    j = json.loads(data)
    print(f"expertd SIGKILLed: /health 503 after {to_503:.3f} s: {j}")
    assert to_503 <= 2.0, f"/health turned 503 {to_503:.3f} s after expertd died (limit 2 s)"
    assert j["status"] != "ok" and "expertd" in j.get("reason", ""), f"/health's 503: {j}"
    status, headers, data = h.request("POST", "/v1/completions",
                                      {"prompt": "Once", "max_tokens": 4}, timeout=10)
    print(f"a completion without expertd: {status} {data[:200]!r}")
    assert status == 503 and headers.get("retry-after") == "1", \
        f"a completion without expertd: {status} {headers} {data!r}"
    status, _, data = h.request("GET", "/health?ready")
    assert status == 503, f"/health?ready without expertd: {status} {data!r}"

    # expertd comes back on the same socket.
    start_expertd(args, sock, procs)
    t1 = time.monotonic()

    def health_ok():
        try:
            status, _, data = h.request("GET", "/health", timeout=5)
        except OSError:
            return None
        return data if status == 200 else None
    data = wait_for("/health's 200 after expertd came back", health_ok, timeout=15.0, step=0.05)
    back = time.monotonic() - t1
    print(f"expertd restarted: /health 200 after {back:.3f} s: {data!r}")
    assert back <= 10.0, f"/health took {back:.3f} s to return to 200 (limit 10 s)"
    answer = h.complete()
    text = answer["choices"][0]["text"]
    print(f"a completion after the restart: {text!r}")
    assert text, f"an empty completion after the restart: {answer}"
    status, _, data = h.request("GET", "/health?ready")
    assert status == 200, f"/health?ready after the restart: {status} {data!r}"

    # --reconnect-timeout 2: expertd stays away, expert-serve exits 1.
    quick = start_serve(args, sock, procs, ["--reconnect-timeout", "2"],
                        "expert-serve-reconnect2").wait_up()
    quick.h.complete()
    daemon = [p for p in procs if p.args[0].endswith("expertd") and p.poll() is None][0]
    daemon.kill()
    daemon.wait(timeout=10)
    t2 = time.monotonic()
    try:
        rc = quick.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        raise AssertionError("expert-serve --reconnect-timeout 2 still runs 15 s after expertd "
                             "died")
    gone = time.monotonic() - t2
    print(f"--reconnect-timeout 2: expert-serve exited {rc} {gone:.3f} s after expertd died")
    assert rc == 1, f"expert-serve --reconnect-timeout 2 exited {rc}, not 1"
    assert gone <= 5.0, f"expert-serve --reconnect-timeout 2 took {gone:.3f} s to exit"
    assert "did not come back within 2 s" in quick.log(), quick.log()[-1000:]
    # The first one (--reconnect-timeout 60) waits on, answering 503.
    assert serve.proc.poll() is None, f"expert-serve (60 s) exited {serve.proc.returncode}"
    status, _, data = h.request("GET", "/health")
    assert status == 503, f"/health while expertd is away again: {status} {data!r}"


# --- dropped_requests ---

def case_dropped_requests(args, sock, procs):
    # A 200-token answer of the tiny model takes ~30 ms, less than a /health poll could catch
    # and far less than the 1 s bound: the requests here ask for 6000 tokens (some 5 s to
    # generate whole), so that one not stopped fails the bound.
    ctx, long_tokens, rounds = 8192, 6000, 20
    start_expertd(args, sock, procs)
    serve = start_serve(args, sock, procs, ["--parallel", "1"], ctx=ctx).wait_up()
    h, pid = serve.h, serve.proc.pid
    h.complete()
    before = metrics(h)
    fds_before, threads_before = open_fds(pid), int(proc_status(pid)["Threads"])
    body = json.dumps({"prompt": "Once", "max_tokens": long_tokens, "ignore_eos": True}).encode()

    stop_times = []
    for i in range(rounds):
        raw = Raw(serve.port)
        raw.send(post_head("/v1/completions", len(body)) + body)

        def running():
            assert not raw.readable(), \
                f"round {i}: the {long_tokens}-token request was answered before it was dropped"
            return h.health()["running"] >= 1
        wait_for(f"round {i}: the request to run", running, timeout=5.0, step=0.01)
        time.sleep(0.05)  # some tokens in: dropped mid-generation
        assert not raw.readable(), f"round {i}: the request was answered before it was dropped"
        raw.close()
        t0 = time.monotonic()
        wait_for(f"round {i}: running back to 0 after the client left",
                 lambda: h.health()["running"] == 0, timeout=5.0, step=0.01)
        stop_times.append(time.monotonic() - t0)
    worst = max(stop_times)
    print(f"{rounds} dropped requests: running back to 0 in {min(stop_times) * 1000:.0f} .. "
          f"{worst * 1000:.0f} ms")
    assert worst <= 1.0, f"a dropped request ran on {worst:.3f} s after its client left"

    stops = [(int(a), int(b)) for a, b in re.findall(
        r"the client left; stopped after (\d+) of (\d+) tokens", serve.log())]
    print(f"expert-serve's log: {len(stops)} stopped, after {[a for a, _ in stops]} tokens")
    assert len(stops) == rounds, f"{len(stops)} 'the client left' log lines for {rounds} drops"
    assert all(b == long_tokens and a < long_tokens for a, b in stops), stops
    assert sum(1 for a, _ in stops if a > 0) >= rounds // 2, \
        f"the requests were mostly dropped before their first token, not mid-generation: {stops}"

    answer = h.complete(max_tokens=8)
    after = metrics(h)
    fds_after, threads_after = open_fds(pid), int(proc_status(pid)["Threads"])
    generated = after["expert_serve_generated_tokens_total"] - \
        before["expert_serve_generated_tokens_total"]
    print(f"then a completion: {answer['choices'][0]['text']!r}; /metrics: running "
          f"{after['expert_serve_requests_running']:.0f}, queued "
          f"{after['expert_serve_requests_queued']:.0f}, {generated:.0f} tokens generated in all; "
          f"fds {fds_before} -> {fds_after}, threads {threads_before} -> {threads_after}")
    assert after["expert_serve_requests_running"] == 0, after
    assert after["expert_serve_requests_queued"] == 0, after
    assert generated == sum(a for a, _ in stops) + 8, \
        f"{generated} tokens generated, the log says {sum(a for a, _ in stops)} + 8"
    assert fds_after <= fds_before + 2, f"open fds {fds_before} -> {fds_after}"
    assert threads_after <= threads_before, f"threads {threads_before} -> {threads_after}"


# --- protocol ---

ORIGIN = "http://localhost:3000"


def check_error(what, got, status, code=None):
    st, headers, data = got
    assert st == status, f"{what}: {st} {data!r}, expected {status}"
    err = json.loads(data)["error"]
    assert err["message"] and err["type"], f"{what}: error body {data!r}"
    if code is not None:
        assert err["code"] == code, f"{what}: error code {err['code']!r}, expected {code!r}"
    print(f"ok: {what}: {st} {err['message']!r}")
    return headers, err


def case_protocol(args, sock, procs):
    start_expertd(args, sock, procs)
    key_file = os.path.join(args.workdir, "api-key")
    with open(key_file, "w") as f:
        f.write("file-key-7f3a\n")
    plain = start_serve(args, sock, procs)
    keyed = start_serve(args, sock, procs, ["--api-key", "secret", "--cors-origin", ORIGIN],
                        "expert-serve-key")
    filed = start_serve(args, sock, procs, ["--api-key-file", key_file], "expert-serve-keyfile")
    for s in (plain, keyed, filed):
        s.wait_up()
    h = plain.h

    # A number beyond double's range: 400, never 500.
    headers, err = check_error("a number beyond double's range",
                               h.request("POST", "/v1/completions",
                                         b'{"prompt": "hi", "max_tokens": 2, "x": 1e400}'), 400)
    assert err["type"] == "invalid_request_error", err

    # A negative Content-Length; malformed HTTP.
    for what, data in (("a negative Content-Length",
                        post_head("/v1/completions", -5) + b'{"prompt": "hi"}'),
                       ("a header line without a colon",
                        b"GET /health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n"),
                       ("a request line of garbage", b"\x01\x02\x03 what\r\n\r\n")):
        raw = Raw(plain.port)
        raw.send(data)
        status, _, body = raw.response(timeout=5)
        closed = raw.closed_by_server(3.0)
        raw.close()
        assert status == 400, f"{what}: {status} {body!r}"
        assert closed, f"{what}: the connection stays open after the 400"
        print(f"ok: {what}: 400 {body[:120]!r}, connection closed")
    assert h.health()["status"] == "ok"

    # Pipelined requests (one write): answered in order on the same connection, which stays open.
    tok = json.dumps({"content": "Hello"}).encode()
    comp = json.dumps({"prompt": "Once", "max_tokens": 16, "ignore_eos": True}).encode()
    raw = Raw(plain.port)
    raw.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" +
             post_head("/tokenize", len(tok)) + tok)
    first, second = raw.response(), raw.response()
    assert first[0] == 200 and json.loads(first[2])["status"] == "ok", f"1st: {first}"
    assert second[0] == 200 and json.loads(second[2])["tokens"], f"2nd: {second}"
    # A worker's answer first, then one the network thread gives at once: still in order.
    raw.send(post_head("/v1/completions", len(comp)) + comp +
             b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" +
             b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    third, fourth, fifth = raw.response(), raw.response(), raw.response()
    assert third[0] == 200 and json.loads(third[2])["usage"]["completion_tokens"] == 16, \
        f"3rd (completion): {third}"
    assert fourth[0] == 200 and json.loads(fourth[2])["status"] == "ok", f"4th (health) {fourth}"
    assert fifth[0] == 200 and json.loads(fifth[2])["data"][0]["id"] == MODEL, f"5th: {fifth}"
    assert not raw.closed_by_server(0.3), "the keep-alive connection was closed"
    raw.close()

    # A chunked body whose trailer (or chunk extension) never ends: Beast bounds the head, not
    # these lines; the connection's buffer is bounded, so 64 MB of it is refused, not held.
    rss0 = mem_bytes(plain.proc.pid, "VmRSS")
    for what, lead in (("an endless chunked trailer", b"0\r\nX-A: "),
                       ("an endless chunk extension", b"1;a=")):
        raw = Raw(plain.port)
        raw.send(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n" + lead)
        sent = 0
        try:
            for _ in range(64):
                raw.send(b"a" * (1 << 20))
                sent += 1
        except OSError:
            pass  # the server answered and closed
        grown = (mem_bytes(plain.proc.pid, "VmRSS") - rss0) >> 20
        raw.close()
        assert grown < 32, f"{what}: RSS grew {grown} MiB after {sent} MiB sent"
        print(f"ok: {what}: refused after at most {sent} MiB sent, RSS +{grown} MiB")
    assert h.health()["status"] == "ok"

    # A client that sends its request and closes its sending side counts as gone: its request
    # is cancelled, and the log says 499 (the client left), not a 500.
    raw = Raw(plain.port)
    raw.send(post_head("/v1/completions", len(comp)) + comp)
    raw.sock.shutdown(socket.SHUT_WR)
    raw.closed_by_server(5.0)
    raw.close()
    wait_for("the 499 in the log", lambda: "499" in plain.log(), timeout=5)
    assert ": 500 " not in plain.log(), plain.log()[-2000:]
    print("ok: a half-closed request is cancelled and logged 499, not 500")
    print("ok: pipelined /health + /tokenize, then completion + /health + /v1/models: answered "
          "in order on one connection")

    # Expect: 100-continue: the interim answer first, then the answer.
    raw = Raw(plain.port)
    raw.send(post_head("/v1/completions", len(comp), "Expect: 100-continue\r\n"))
    status, _, _ = raw.response(timeout=3)
    assert status == 100, f"Expect: 100-continue: first answer {status}"
    raw.send(comp)
    status, _, data = raw.response(timeout=10)
    raw.close()
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 16, \
        f"Expect: 100-continue: {status} {data!r}"
    print("ok: Expect: 100-continue: 100 Continue, then 200")

    # Without --cors-origin: no CORS headers, OPTIONS is 405.
    status, headers, _ = h.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and "access-control-allow-origin" not in headers, (status, headers)
    status, headers, data = h.request("OPTIONS", "/v1/completions",
                                      headers={"Origin": ORIGIN,
                                               "Access-Control-Request-Method": "POST"})
    assert status == 405, f"OPTIONS without --cors-origin: {status} {data!r}"
    print("ok: without --cors-origin: no CORS headers, OPTIONS 405")

    # --api-key secret: 401 without it or with another, 200 with it; /health exempt.
    k = keyed.h
    completion = {"prompt": "Once", "max_tokens": 2}
    for what, hdrs in (("no Authorization", {}),
                       ("a wrong key", {"Authorization": "Bearer wrong"}),
                       ("a longer wrong key", {"Authorization": "Bearer secret2"}),
                       ("not Bearer", {"Authorization": "Basic c2VjcmV0"})):
        headers, _ = check_error(f"--api-key, {what}",
                                 k.request("POST", "/v1/completions", completion, hdrs), 401,
                                 "invalid_api_key")
        assert headers.get("www-authenticate") == "Bearer", f"{what}: {headers}"
    check_error("--api-key, GET /v1/models without it", k.request("GET", "/v1/models"), 401,
                "invalid_api_key")
    check_error("--api-key, /metrics without it", k.request("GET", "/metrics"), 401,
                "invalid_api_key")
    good = {"Authorization": "Bearer secret"}
    k.complete(max_tokens=2, headers=good)
    status, _, _ = k.request("GET", "/v1/models", headers=good)
    assert status == 200, f"/v1/models with the key: {status}"
    status, _, data = k.request("GET", "/health")
    assert status == 200 and json.loads(data)["status"] == "ok", f"/health without key: {data!r}"
    print("ok: --api-key: 401 invalid_api_key with WWW-Authenticate: Bearer without the key, "
          "200 with it, /health exempt")

    # --cors-origin (on the same instance): its origin gets Access-Control-Allow-Origin, also on
    # a 401 and on a worker's answer; a preflight needs no key; other origins get nothing.
    status, headers, _ = k.request("GET", "/v1/models", headers={**good, "Origin": ORIGIN})
    assert status == 200 and headers.get("access-control-allow-origin") == ORIGIN, headers
    status, headers, _ = k.request("POST", "/v1/completions", completion,
                                   {**good, "Origin": ORIGIN})
    assert status == 200 and headers.get("access-control-allow-origin") == ORIGIN, headers
    status, headers, _ = k.request("POST", "/v1/completions", completion, {"Origin": ORIGIN})
    assert status == 401 and headers.get("access-control-allow-origin") == ORIGIN, headers
    status, headers, _ = k.request("GET", "/v1/models",
                                   headers={**good, "Origin": "http://evil.example"})
    assert status == 200 and "access-control-allow-origin" not in headers, headers
    status, headers, data = k.request("OPTIONS", "/v1/chat/completions",
                                      headers={"Origin": ORIGIN,
                                               "Access-Control-Request-Method": "POST",
                                               "Access-Control-Request-Headers":
                                               "authorization, content-type"})
    assert status == 204, f"CORS preflight: {status} {data!r}"
    assert "POST" in headers.get("access-control-allow-methods", ""), headers
    assert headers.get("access-control-allow-origin") == ORIGIN, headers
    status, headers, data = k.request("OPTIONS", "/v1/chat/completions",
                                      headers={"Origin": "http://evil.example",
                                               "Access-Control-Request-Method": "POST"})
    assert status == 405 and "access-control-allow-origin" not in headers, (status, headers)
    print(f"ok: --cors-origin {ORIGIN}: Allow-Origin on its answers (200, 401), preflight 204 "
          f"({headers.get('allow')!r} for others: 405)")

    # --api-key-file.
    f = filed.h
    check_error("--api-key-file, no Authorization",
                f.request("POST", "/v1/completions", completion), 401, "invalid_api_key")
    check_error("--api-key-file, --api-key's key",
                f.request("POST", "/v1/completions", completion, good), 401, "invalid_api_key")
    f.complete(max_tokens=2, headers={"Authorization": "Bearer file-key-7f3a"})
    assert f.health()["status"] == "ok"
    print("ok: --api-key-file: the file's key is 200, others 401, /health exempt")


CASES = {
    "slow_clients": case_slow_clients,
    "big_prompts": case_big_prompts,
    "daemon_restart": case_daemon_restart,
    "dropped_requests": case_dropped_requests,
    "protocol": case_protocol,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--bin", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    sock = os.path.join(args.workdir, "expertd.sock")
    procs = []
    t0 = time.monotonic()
    try:
        CASES[args.case](args, sock, procs)
    except BaseException:
        for path in sorted(glob.glob(os.path.join(args.workdir, "*.log"))):
            print(f"--- {os.path.basename(path)} (last 3000 bytes)", file=sys.stderr)
            print(open(path, errors="replace").read()[-3000:], file=sys.stderr)
        raise
    finally:
        stop_all(procs)
    print(f"serve_chaos {args.case}: all checks passed in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
