#!/usr/bin/env python3
"""expert-serve --parallel 4 batches sequences by expert (issue 25): a real expertd serving
FIXTURE/model-VARIANT.gguf and a real expert-serve (CPU engine). Four requests with different
prompts, sent at once, each get exactly the answer they get alone (expert-run's greedy tokens and
text, and expert-serve's own with --parallel 1), the server log shows steps with more than one
sequence, and the daemon counts fewer acquires for the four together than for the four alone.

usage: serve_batch_test.py --bin BUILD/bin --fixture DIR --variant f32 --workdir DIR
"""
import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import start_expertd, start_serve, stop_procs  # noqa: E402

MODEL = "fixture"
N = 12  # tokens per answer


def acquires(args, sock):
    out = subprocess.run([os.path.join(args.bin, "expertctl"), "status", "--socket", sock,
                          "--json"], capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)["acquires"]


def complete(h, prompt):
    status, _, data = h.request("POST", "/v1/completions",
                                {"model": MODEL, "prompt": prompt, "max_tokens": N,
                                 "temperature": 0, "ignore_eos": True})
    assert status == 200, f"prompt {prompt}: {status} {data!r}"
    j = json.loads(data)
    return j["choices"][0]["text"], j["usage"]["completion_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--variant", default="f32")
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    gguf = os.path.join(args.fixture, f"model-{args.variant}.gguf")
    vocab = json.load(open(os.path.join(args.fixture, "fixture.json")))["logits_shape"][1]
    # Four prompts of token ids, of different lengths.
    prompts = [[(s * 31 + i * 7 + 3) % vocab for i in range(4 + 2 * s)] for s in range(4)]
    sock = os.path.join(args.workdir, "expertd.sock")
    procs = []
    try:
        start_expertd(args, [f"{MODEL}={gguf}"], sock, procs)
        # Alone: expert-run, one process per prompt, and the daemon's acquires of its decode.
        alone = []
        for p in prompts:
            out = subprocess.run(
                [os.path.join(args.bin, "expert-run"), "--socket", sock, "--model", MODEL,
                 "--json", "--cpu", "--prompt-tokens", ",".join(map(str, p)), "--max-tokens",
                 str(N), "--ignore-eos"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            alone.append(json.loads(out.stdout))
        print(f"ok: expert-run alone: {[len(r['generated']) for r in alone]} tokens")

        # expert-run --batch-prompts: the four decoded together in one engine, the same ids.
        listing = os.path.join(args.workdir, "prompts.txt")
        with open(listing, "w") as f:
            f.write("# one prompt per line\n")
            for p in prompts:
                f.write(", ".join(map(str, p)) + "\n")
        out = subprocess.run(
            [os.path.join(args.bin, "expert-run"), "--socket", sock, "--model", MODEL, "--json",
             "--cpu", "--batch-prompts", listing, "--max-tokens", str(N), "--ignore-eos",
             "--prefill-chunk", "4"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        batch = json.loads(out.stdout)
        assert batch["prompt_tokens"] == prompts, batch["prompt_tokens"]
        for i, (ids, ref) in enumerate(zip(batch["generated"], alone)):
            assert ids == ref["generated"], f"--batch-prompts, prompt {i}: {ids}, alone {ref}"
        assert batch["rows_per_step"] > 1.0 and batch["rows"] == 4 * (N - 1), batch
        print(f"ok: expert-run --batch-prompts: the same ids, {batch['rows_per_step']:.2f} "
              f"sequences per step, {batch['experts_per_step']:.1f} experts acquired per step, "
              f"{batch['bytes_read_per_token'] / 1e3:.1f} kB read per token")
        # PROMPT | FEED lines: the ids fed instead of sampled (the same work however batched).
        with open(listing, "w") as f:
            for p, ref in zip(prompts, alone):
                f.write(", ".join(map(str, p)) + " | " + ", ".join(map(str, ref["generated"])) + "\n")
        out = subprocess.run(
            [os.path.join(args.bin, "expert-run"), "--socket", sock, "--model", MODEL, "--json",
             "--cpu", "--batch-prompts", listing], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        fed = json.loads(out.stdout)
        assert fed["fed"] and fed["rows"] == 4 * N and fed["rows_per_step"] > 1.0, fed
        assert fed["generated"] == [r["generated"] for r in alone], fed["generated"]
        print(f"ok: --batch-prompts PROMPT | FEED: {fed['rows']} ids fed, "
              f"{fed['rows_per_step']:.2f} sequences per step")
        bad = subprocess.run(
            [os.path.join(args.bin, "expert-run"), "--socket", sock, "--model", MODEL, "--cpu",
             "--batch-prompts", os.path.join(args.workdir, "nope.txt")],
            capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "nope.txt: cannot open it" in bad.stderr, bad.stderr

        # The server one sequence at a time, then four at once: the same answers.
        for parallel in (1, 4):
            port, h, log_path = start_serve(
                args, sock, MODEL, ["--ctx", "256", "--cpu", "--parallel", str(parallel),
                                    "--prefill-chunk", "4"], procs)
            health = h.health()
            assert health["parallel"] == parallel, health
            before = acquires(args, sock)
            if parallel == 1:
                got = [complete(h, p) for p in prompts]
            else:
                with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
                    got = list(pool.map(lambda p: complete(h, p), prompts))
            used = acquires(args, sock) - before
            for i, ((text, n), ref) in enumerate(zip(got, alone)):
                assert n == N, f"prompt {i}: {n} tokens"
                assert text == ref["text"], \
                    f"--parallel {parallel}, prompt {i}: {text!r}, alone {ref['text']!r}"
            print(f"ok: --parallel {parallel}: 4 answers equal expert-run's alone; "
                  f"{used} acquires")
            if parallel == 1:
                sequential = used
            else:
                log = open(log_path, encoding="utf-8", errors="replace").read()
                shared = [float(x) for x in re.findall(r"finish length, ([0-9.]+) sequences per "
                                                       r"step", log)]
                assert len(shared) == 4 and max(shared) > 1.0, \
                    f"no request shared its steps: {shared}\n{log[-2000:]}"
                assert used < sequential, \
                    f"4 at once acquired {used} experts, one at a time {sequential}"
                print(f"ok: together: {used} acquires < {sequential} one at a time; sequences "
                      f"per step {shared}")
            procs[-1].terminate()
            procs[-1].wait(timeout=20)
            procs.pop()
    finally:
        stop_procs(procs)


if __name__ == "__main__":
    main()
