#!/usr/bin/env python3
"""Reads what bench/peer/peer.sh's runs printed and turns it into results and tables.

  summarize.py record --kind expertd|llama.cpp|llama-feed --raw OUT --stats STATS [--field k=v ...]
      one JSON line for a run: decode (tg) and prefill (pp) tokens/s, bytes read per decoded
      token, the run's status (ok, timeout, oom, failed), the cgroup's peak, events and io, and
      the fields given
  summarize.py brief < LINE          one human line for a result
  summarize.py is-done RESULTS ID TG PP  exit 0 when RESULTS has an ok result for ID at TG/PP tokens
  summarize.py disk DISK_JSON        one line: the disk's rates (expert-bench storage --json)
  summarize.py ipc IPC_JSONL         one line: expert-bench ipc --json runs (shm p50 each, <= 3 us)
  summarize.py table [--disk DISK_JSON] [--ipc IPC_JSONL] RESULTS [...]
      the markdown tables (the last result of each run counts): every run; the fair table (both
      engines fed the same ids: expertd against llama.cpp's best fed config, with expertd's
      disk-bound fraction against the measured disk); llama-bench's own tg (its random ids) as a
      second llama.cpp figure; prefill; prefetch on/off

Standard library only: it runs under the device machine's python3 as it is.
"""
import argparse
import json
import sys
import time


def value(text):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def read_stats(path):
    stats = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, val = line.strip().partition(" ")
                if key:
                    stats[key] = value(val)
    except FileNotFoundError:
        pass
    return stats


def json_objects(path):
    """Every line of the file that parses as a JSON object (tools print other lines too)."""
    objs = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        objs.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    except FileNotFoundError:
        pass
    return objs


def parse_llama(path, rec):
    # llama-bench -o jsonl: one object per test, printed as each test ends (pp first, then tg).
    for o in json_objects(path):
        if "avg_ts" not in o:
            continue
        if o.get("n_prompt", 0) > 0 and o.get("n_gen", 0) == 0:
            rec["pp_tokens_per_s"] = o["avg_ts"]
        elif o.get("n_gen", 0) > 0 and o.get("n_prompt", 0) == 0:
            rec["tg_tokens_per_s"] = o["avg_ts"]
        for k in ("build_commit", "n_threads", "n_gpu_layers", "n_cpu_moe", "repack",
                  "load_mode", "flash_attn", "n_ubatch", "gpu_info", "cpu_info", "backends"):
            if k in o:
                rec.setdefault("llama", {})[k] = o[k]


def parse_expertd(path, rec):
    objs = [o for o in json_objects(path) if "engine" in o and ("feed" in o or "tokens_per_s" in o)]
    if not objs:
        return
    o = objs[-1]
    pre = o.get("prefill", {})
    if pre.get("tokens_per_s"):
        rec["pp_tokens_per_s"] = pre["tokens_per_s"]
    rec["pp_bytes_read_per_token"] = pre.get("bytes_read_per_token")
    feed = o.get("feed")
    if feed is not None:
        # --feed-tokens: every id is one decode step from an empty context, as llama-feed's.
        if feed.get("tokens"):
            rec["tg_tokens_per_s"] = feed.get("tokens_per_s")
        rec["tg_bytes_read_per_token"] = feed.get("bytes_read_per_token")
        rec["expertd"] = {
            "engine_note": o.get("engine_note"),
            "fed": True,
            "feed_source": feed.get("source"),
            "decode_steps": feed.get("tokens"),
            "ms_per_token": feed.get("ms_per_token"),
            "stall_ms_per_token": feed.get("stall_ms_per_token"),
            "stall_ms_p50": feed.get("stall_ms_p50"),
            "stall_ms_p99": feed.get("stall_ms_p99"),
            "compute_ms_per_token": feed.get("compute_ms_per_token"),
            "gpu_wait_ms_per_token": feed.get("gpu_wait_ms_per_token"),
            "host_ms_per_token": feed.get("host_ms_per_token"),
            "streamed_bytes_per_token": feed.get("streamed_bytes_per_token"),
            "vram_copy_bytes": feed.get("vram_copy_bytes"),
            "vram_demand_copy_bytes": feed.get("vram_demand_copy_bytes"),
            "lookahead": o.get("prefetch_depth"),
            "prefill_bytes_read_per_token": pre.get("bytes_read_per_token"),
            "decode_bytes_read_per_token": feed.get("bytes_read_per_token"),
            "hits": feed.get("hits"),
            "reads_in_flight_mean": feed.get("reads_in_flight_mean"),
            "reads_in_flight_max": feed.get("reads_in_flight_max"),
            "disk_busy_fraction": feed.get("disk_busy_fraction"),
            "prefetch_loads": feed.get("prefetch_loads"),
            "prefetch_useful": feed.get("prefetch_useful"),
            "prefetch_precision": o.get("prefetch_precision"),
            "daemon_prefetch": o.get("daemon", {}).get("prefetch"),
        }
        return
    # Sampled decode (the `sampled` config, not comparable): expert-run's tokens/s counts the
    # first token, which comes from the prompt's logits with no decode step; tg counts decode
    # steps, so it is scaled by steps / tokens.
    gen = len(o.get("generated", []))
    steps = o.get("generation", {}).get("steps", 0)
    if gen > 0 and steps > 0:
        rec["tg_tokens_per_s"] = o["tokens_per_s"] * steps / gen
    rec["tg_bytes_read_per_token"] = o.get("generation", {}).get("bytes_read_per_token")
    rec["expertd"] = {
        "engine_note": o.get("engine_note"),
        "fed": False,
        "decode_steps": steps,
        "prefill_bytes_read_per_token": pre.get("bytes_read_per_token"),
        "decode_bytes_read_per_token": o.get("generation", {}).get("bytes_read_per_token"),
        "stall_ms_per_token": o.get("generation", {}).get("stall_ms_per_token"),
        "hits": o.get("hits"),
        "prefetch_depth": o.get("prefetch_depth"),
        "prefetch_precision": o.get("prefetch_precision"),
        "daemon_prefetch": o.get("daemon", {}).get("prefetch"),
    }


def parse_llama_feed(path, rec):
    objs = [o for o in json_objects(path) if o.get("tool") == "llama-feed"]
    if not objs:
        return
    o = objs[-1]
    if o.get("tg_tokens"):
        rec["tg_tokens_per_s"] = o.get("tg_tokens_per_s")
    if o.get("pp_tokens"):
        rec["pp_tokens_per_s"] = o.get("pp_tokens_per_s")
        rec["pp_bytes_read_per_token"] = o.get("pp_bytes_read", 0) / o["pp_tokens"]
    rec["tg_bytes_read_per_token"] = o.get("tg_bytes_read_per_token")
    rec["llama"] = {k: o.get(k) for k in (
        "build_commit", "n_vocab", "load_s", "load_bytes_read", "pp_bytes_read", "tg_bytes_read",
        "tg_ms_p50", "tg_ms_p99", "n_threads", "ngl", "ncmoe", "load_mode", "repack",
        "flash_attn", "n_batch", "n_ubatch") if k in o}


def read_ids(path):
    try:
        with open(path) as f:
            return [int(x) for x in f.read().replace(",", " ").split()]
    except (OSError, ValueError):
        return None


def check_fed_ids(path, rec):
    """expert-run echoes the ids it decoded: they must be the stream file's, the ones llama-feed
    reads (ids_match false in the results says the comparison is void)."""
    ids = next((o["feed"]["ids"] for o in reversed(json_objects(path))
                if isinstance(o.get("feed"), dict) and "ids" in o["feed"]), None)
    if ids is None or "stream_file" not in rec or "expertd" not in rec:
        return
    rec["expertd"]["ids_match_stream"] = ids == read_ids(rec["stream_file"])


def cmd_record(args):
    rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for f in args.field:
        k, _, v = f.partition("=")
        rec[k] = value(v)
    stats = read_stats(args.stats)
    {"expertd": parse_expertd, "llama.cpp": parse_llama,
     "llama-feed": parse_llama_feed}[args.kind](args.raw, rec)
    check_fed_ids(args.raw, rec)
    rc = stats.get("rc", -1)
    events = {k[len("event_"):]: v for k, v in stats.items() if k.startswith("event_")}
    if stats.get("timed_out") == 1:
        status = "timeout"
    elif events.get("oom_kill", 0) > 0:
        status = "oom"
    elif rc != 0:
        status = f"failed (exit {rc})"
    elif "tg_tokens_per_s" not in rec or "pp_tokens_per_s" not in rec:
        status = "failed (no figures in the output)"
    elif rec.get("expertd", {}).get("ids_match_stream") is False:
        status = "failed (expert-run decoded other ids than the stream file's)"
    else:
        status = "ok"
    rec["status"] = status
    rec["wall_s"] = stats.get("wall_s")
    rec["cgroup"] = {"memory_max": stats.get("cap"), "peak": stats.get("peak"), "events": events}
    # The whole run's reads from storage (io.stat: load, prefill and decode; expertd's O_DIRECT
    # reads and llama.cpp's page faults alike), where the cgroup had the io controller.
    for k in ("io_rbytes", "io_rios", "mem_anon_max", "mem_file_max"):
        if k in stats:
            rec["cgroup"][k] = stats[k]
    rec["raw"] = args.raw
    print(json.dumps(rec))


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def cmd_brief(_):
    r = json.loads(sys.stdin.read())
    peak = r.get("cgroup", {}).get("peak")
    mem = f", peak {peak / 2**30:.2f} GiB" if isinstance(peak, int) and peak >= 0 else ""
    oom = r.get("cgroup", {}).get("events", {}).get("oom_kill")
    per = r.get("tg_bytes_read_per_token")
    per_s = "" if per is None else f" ({per / 1e6:.1f} MB read per token)"
    print(f"{r['status']}: tg {fmt(r.get('tg_tokens_per_s'))} tokens/s{per_s}, "
          f"pp{r.get('pp_tokens')} {fmt(r.get('pp_tokens_per_s'))} tokens/s "
          f"({r.get('wall_s')} s{mem}{'' if oom is None else f', oom kills {oom}'})")


def load(paths):
    runs = {}
    for p in paths:
        with open(p) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    runs[r["id"]] = r  # the last result of a run counts
    return runs


def cmd_done(args):
    for r in load([args.results]).values():
        if (r["id"] == args.id and r["status"] == "ok" and r.get("tg_tokens") == args.tg
                and r.get("pp_tokens") == args.pp):
            return 0
    return 1


CONFIG_ORDER = ["expertd", "expertd-cpu", "expertd-d0", "expertd-cpu-d0", "feed-cuda-tier",
                "feed-cuda-all", "feed-cpu", "cuda-tier", "cuda-all", "cpu", "sampled",
                "sampled-cpu"]
STREAM_ORDER = ["random", "text", "llama-bench", "sampled"]
MODEL_NAMES = {
    "mixtral": "Mixtral-8x7B shape",
    "qwen3": "Qwen3-30B-A3B shape",
    "mixtral-llama": "Mixtral-8x7B (llama arch)",
    "ds3": "DeepSeek-V3 slice (6 blocks)",
}
SAMPLED = "sampled (not comparable: expertd samples its own tokens)"


def stream_of(r):
    # Results before issue 23 have no stream: expert-run sampled, llama-bench drew its own.
    if "stream" in r:
        return r["stream"]
    return "sampled" if r["config"].startswith("expertd") else "llama-bench"


def stream_label(s):
    return {"llama-bench": "llama-bench's own (random)", "sampled": SAMPLED}.get(s, s)


def is_expertd(r):
    return r["config"].startswith("expertd") or r["config"].startswith("sampled")


def is_prefetch_off(r):
    return "-d0" in r["config"]


def describe(r):
    c = r["config"]
    if is_expertd(r):
        engine = ("CPU engine" if "-cpu" in c else f"VRAM tier {r.get('vram_experts')} experts")
        depth = r.get("daemon_depth", "auto")
        prefetch = "prefetch off (depth 0)" if str(depth) == "0" else f"prefetch {depth}"
        what = "sampled decode, " if c.startswith("sampled") else ""
        return (f"expertd + expert-run: {what}cache {r.get('cache_mib', 0) / 1024:.1f} GiB, "
                f"{engine}, {prefetch}")
    tool = "llama-feed" if c.startswith("feed-") else "llama-bench"
    if c.endswith("cpu"):
        return f"{tool}, llama.cpp CPU-only build"
    return (f"{tool}, llama.cpp CUDA -ngl 99 -ncmoe {r.get('ncmoe')} "
            f"({r.get('vram_experts')} experts in VRAM)")


def cell(r, key):
    x = r.get(key)
    if x is not None:
        return fmt(x)
    return "timeout" if r["status"] == "timeout" else ("OOM" if r["status"] == "oom" else "–")


def mb(x, digits=1):
    return "–" if x is None else f"{x / 1e6:.{digits}f}"


def disk_rate(disk):
    """The disk's O_DIRECT read rate in bytes/s: the best raw method of expert-bench storage."""
    if not disk:
        return None
    gbps = disk.get("raw_gbps") or disk.get("expertd_gbps")
    return gbps * 1e9 if gbps else None


def busy_rate(r):
    """The rate expertd's reads reached while the disk was busy in a fed run, bytes/s: bytes per
    token x tokens/s / the fraction of the time reads were in flight. The disk did at least that."""
    e = r.get("expertd") or {}
    per, tps, busy = r.get("tg_bytes_read_per_token"), r.get("tg_tokens_per_s"), e.get(
        "disk_busy_fraction")
    if not e.get("fed") or per is None or not tps or not busy or busy < 0.05:
        return None
    return per * tps / busy


def session_rate(runs, probe):
    """The disk rate the disk-bound fraction divides by: the probe's, or, where an expertd run of
    the same results sustained more while busy (the probe ran beside other I/O, or at a queue depth
    the disk does not peak at), that run's. Returns (bytes/s, the run's id or None)."""
    top = max(((busy_rate(r), r["id"]) for r in runs.values() if busy_rate(r)), default=None)
    if top and (probe is None or top[0] > probe):
        return top
    return (probe, None)


def disk_bound_fraction(r, rate):
    """Of a decoded token's time, the share the disk needs to read its bytes at the measured rate:
    (bytes per token / disk bytes per s) / (s per token)."""
    per, tps = r.get("tg_bytes_read_per_token"), r.get("tg_tokens_per_s")
    if per is None or not tps or not rate:
        return None
    return (per / rate) * tps


def best(rs, key):
    return max((r for r in rs if r.get(key) is not None), key=lambda r: r[key], default=None)


def ratio(a, b):
    return f"**{a / b:.2f}×**" if a is not None and b else "–"


def cmd_table(args):
    runs = load(args.results)
    disk = None
    if args.disk:
        with open(args.disk) as f:
            disk = json.load(f)
    probe = disk_rate(disk)
    rate, rate_from = session_rate(runs, probe)
    keys = sorted({(r["model"], r["cap_gib"]) for r in runs.values()},
                  key=lambda k: (list(MODEL_NAMES).index(k[0]) if k[0] in MODEL_NAMES else 9, k[1]))
    pp = sorted({r.get("pp_tokens") for r in runs.values()})
    pp_name = f"pp{pp[0]}" if len(pp) == 1 else "pp"
    if disk:
        print(f"Disk: {disk_line(disk)} (expert-bench storage, caches dropped). MB = 10^6 bytes.")
        print()
    if args.ipc:
        print(f"Shared-memory round trips on this machine (expert-bench ipc): {ipc_line(args.ipc)}.")
        print()
    if rate_from:
        print(f"Disk-bound fractions below use {rate / 1e9:.2f} GB/s: the rate {rate_from}'s reads "
              f"sustained while the disk was busy, above the probe's "
              f"{'–' if probe is None else f'{probe / 1e9:.2f} GB/s'} (the disk did at least that).")
        print()
    print(f"| model | cap | stream | tool / config | tg tokens/s | MB read per decoded token "
          f"| {pp_name} tokens/s | status, wall, peak |")
    print("|---|---:|---|---|---:|---:|---:|---|")
    for model, cap in keys:
        rs = [r for r in runs.values() if r["model"] == model and r["cap_gib"] == cap]
        rs.sort(key=lambda r: (order(STREAM_ORDER, stream_of(r)), order(CONFIG_ORDER, r["config"])))
        for r in rs:
            peak = r.get("cgroup", {}).get("peak")
            peak_s = f", {peak / 2**30:.1f} GiB" if isinstance(peak, int) and peak >= 0 else ""
            cap_s = f"{cap} GiB" + (" (uncapped)" if r.get("uncapped") == 1 else "")
            beside = ", beside a llama.cpp build" if r.get("build_running") == 1 else ""
            io = r.get("cgroup", {}).get("io_rbytes")
            io_s = f", {io / 1e9:.1f} GB read in all" if io is not None else ""
            print(f"| {MODEL_NAMES.get(model, model)} | {cap_s} | {stream_label(stream_of(r))} | "
                  f"{describe(r)} | {cell(r, 'tg_tokens_per_s')} | "
                  f"{mb(r.get('tg_bytes_read_per_token'))} | {cell(r, 'pp_tokens_per_s')} | "
                  f"{r['status']}, {r.get('wall_s')} s{peak_s}{io_s}{beside} |")
    fair_table(runs, keys, rate)
    bench_table(runs, keys)
    prefill_table(runs, keys, pp_name)
    prefetch_table(runs, keys)
    return 0


def order(names, x):
    return names.index(x) if x in names else len(names)


def in_cell(runs, model, cap):
    return [r for r in runs.values() if r["model"] == model and r["cap_gib"] == cap]


def fair_table(runs, keys, rate):
    """Both engines fed the same ids: expertd (prefetch on) against llama.cpp's best fed config."""
    print()
    print("Fed decode: both engines decode the same ids, one position at a time from an empty "
          "context. MB/token: expertd's reads (the daemon's counters), llama-feed's "
          "/proc/self/io read_bytes (mmap faults). Disk-bound fraction: (MB per token ÷ disk "
          "MB/s) ÷ (s per token).")
    print()
    print("| model | cap | stream | expertd tg tok/s | expertd MB/token | llama.cpp best fed tg "
          "(config) | llama.cpp MB/token | ratio | expertd disk-bound fraction "
          "| reads in flight mean/max | disk busy |")
    print("|---|---:|---|---:|---:|---|---:|---:|---:|---|---:|")
    for model, cap in keys:
        rs = in_cell(runs, model, cap)
        streams = sorted({stream_of(r) for r in rs if stream_of(r) in ("random", "text")},
                         key=lambda s: order(STREAM_ORDER, s))
        rows = [(s, [r for r in rs if stream_of(r) == s]) for s in streams]
        sampled = [r for r in rs if stream_of(r) == "sampled" and is_expertd(r)]
        if sampled:
            rows.append(("sampled", sampled))
        for s, srs in rows:
            # The default config; a lookahead sweep's runs (expertd-lN) are in the full table.
            ours = next((r for r in srs if r["config"] in ("expertd", "expertd-cpu")),
                        next((r for r in srs if is_expertd(r) and not is_prefetch_off(r)), None))
            theirs = [r for r in srs if r["config"].startswith("feed-")]
            top = best(theirs, "tg_tokens_per_s")
            e = (ours or {}).get("expertd", {})
            mine = (ours or {}).get("tg_tokens_per_s")
            frac = disk_bound_fraction(ours, rate) if ours else None
            flight = (f"{fmt(e.get('reads_in_flight_mean'), 1)} / {e.get('reads_in_flight_max')}"
                      if e.get("reads_in_flight_mean") is not None else "–")
            row = [MODEL_NAMES.get(model, model), f"{cap} GiB", stream_label(s),
                   cell(ours, "tg_tokens_per_s") if ours else "–",
                   mb((ours or {}).get("tg_bytes_read_per_token")),
                   "–" if top is None else f"{fmt(top['tg_tokens_per_s'])} ({top['config']})",
                   mb((top or {}).get("tg_bytes_read_per_token")),
                   # Sampled decode is never set against llama.cpp: other input, other work.
                   "–" if s == "sampled" else ratio(mine, (top or {}).get("tg_tokens_per_s")),
                   fmt(frac), flight, fmt(e.get("disk_busy_fraction"))]
            print("| " + " | ".join(row) + " |")


def bench_table(runs, keys):
    """llama-bench's own tg (ids it draws itself, once per model and cap): a second llama.cpp
    figure beside llama-feed's on the random stream and expertd's."""
    rows = []
    for model, cap in keys:
        rs = in_cell(runs, model, cap)
        bench = [r for r in rs if r["config"] in ("cuda-tier", "cuda-all", "cpu")]
        if not bench:
            continue
        top = best(bench, "tg_tokens_per_s")
        fed = best([r for r in rs if r["config"].startswith("feed-") and stream_of(r) == "random"],
                   "tg_tokens_per_s")
        ours = next((r for r in rs if is_expertd(r) and not is_prefetch_off(r)
                     and stream_of(r) == "random"), None)
        per = {c: next((r for r in bench if r["config"] == c), None)
               for c in ("cuda-tier", "cuda-all", "cpu")}
        io = (top or {}).get("cgroup", {}).get("io_rbytes")
        rows.append([MODEL_NAMES.get(model, model), f"{cap} GiB"]
                    + [cell(r, "tg_tokens_per_s") if r else "–" for r in per.values()]
                    + ["–" if top is None else f"{fmt(top['tg_tokens_per_s'])} ({top['config']})",
                       "–" if io is None else f"{io / 1e9:.1f}",
                       "–" if fed is None else f"{fmt(fed['tg_tokens_per_s'])} ({fed['config']})",
                       cell(ours, "tg_tokens_per_s") if ours else "–",
                       ratio((ours or {}).get("tg_tokens_per_s"),
                             (top or {}).get("tg_tokens_per_s"))])
    if not rows:
        return
    print()
    print("llama-bench's own tg (ids it draws itself: std::rand() % n_vocab), a second llama.cpp "
          "figure; GB read: the whole run's (io.stat: load, pp and tg, and the binaries and CUDA "
          "libraries, about 0.4 GB after the page cache is dropped).")
    print()
    print("| model | cap | llama-bench tg cuda-tier | cuda-all | cpu | best (config) | its GB read "
          "(whole run) | llama-feed random tg best (config) | expertd random tg "
          "| expertd ÷ llama-bench best |")
    print("|---|---:|---:|---:|---:|---|---|---|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def prefill_table(runs, keys, pp_name):
    """Prefill of the same prompt ids (llama-bench: its own random ids of the same count); each
    side's best over the cell's runs."""
    print()
    print(f"| model | cap | expertd {pp_name} | llama-feed {pp_name} best (config) | ratio "
          f"| llama-bench {pp_name} best (config) | ratio |")
    print("|---|---:|---:|---|---:|---|---:|")
    for model, cap in keys:
        rs = in_cell(runs, model, cap)
        ours = best([r for r in rs if is_expertd(r)], "pp_tokens_per_s")
        fed = best([r for r in rs if r["config"].startswith("feed-")], "pp_tokens_per_s")
        bench = best([r for r in rs if r["config"] in ("cuda-tier", "cuda-all", "cpu")],
                     "pp_tokens_per_s")
        mine = (ours or {}).get("pp_tokens_per_s")
        row = [MODEL_NAMES.get(model, model), f"{cap} GiB", fmt(mine)]
        for top in (fed, bench):
            row.append("–" if top is None else f"{fmt(top['pp_tokens_per_s'])} ({top['config']})")
            row.append(ratio(mine, (top or {}).get("pp_tokens_per_s")))
        print("| " + " | ".join(row) + " |")


def prefetch_table(runs, keys):
    """Prefetch on (the daemon's default) against off (depth 0), on the same fed stream."""
    pairs = []
    for model, cap in keys:
        rs = in_cell(runs, model, cap)
        for s in sorted({stream_of(r) for r in rs}, key=lambda s: order(STREAM_ORDER, s)):
            ours = [r for r in rs if is_expertd(r) and stream_of(r) == s]
            on = [r for r in ours if not is_prefetch_off(r)]
            off = [r for r in ours if is_prefetch_off(r)]
            if on and off:
                pairs.append((model, cap, s, on[0], off[0]))
    if not pairs:
        return

    def ex(r, key):
        return r.get("expertd", {}).get(key)

    print()
    print("| model | cap | stream | tg on / off | on ÷ off | decode MB read per token on / off "
          "| stall ms per token on / off | engine hint precision | auto at the end: depth, disk busy, bar |")
    print("|---|---:|---|---|---:|---|---|---:|---|")
    for model, cap, s, on, off in pairs:
        a, b = on.get("tg_tokens_per_s"), off.get("tg_tokens_per_s")
        print(f"| {MODEL_NAMES.get(model, model)} | {cap} GiB | {stream_label(s)} | "
              f"{cell(on, 'tg_tokens_per_s')} / {cell(off, 'tg_tokens_per_s')} | {ratio(a, b)} | "
              f"{mb(on.get('tg_bytes_read_per_token'), 0)} / "
              f"{mb(off.get('tg_bytes_read_per_token'), 0)} | "
              f"{fmt(ex(on, 'stall_ms_per_token'), 1)} / {fmt(ex(off, 'stall_ms_per_token'), 1)} | "
              f"{fmt(ex(on, 'prefetch_precision'), 3)} | {auto_state(on)} |")


def auto_state(r):
    d = r.get("expertd", {}).get("daemon_prefetch") or {}
    if "prefetch_depth_now" not in d:
        return "–"
    busy = d.get("disk_busy", -1)
    busy_s = "unmeasured" if busy is None or busy < 0 else f"{busy:.2f}"
    return f"{d['prefetch_depth_now']}, {busy_s}, {fmt(d.get('prefetch_auto_need'))}"


def disk_line(disk):
    return (f"best raw O_DIRECT {disk.get('raw_gbps', 0):.2f} GB/s ({disk.get('raw_method')}), "
            f"expertd {disk.get('expertd_gbps', 0):.2f} GB/s")


def ipc_line(path):
    """The runs of expert-bench ipc --json in a file: shm p50 each, the worst p99, RPC's p50."""
    runs = list(json_objects(path))
    runs = [r for r in runs if r.get("benchmark") == "ipc"]
    if not runs:
        return "no expert-bench ipc results"
    p50 = [r["shm_rtt_us_p50"] for r in runs]
    within = sum(1 for v in p50 if v <= 3.0)
    shm = ", ".join(f"{v:.2f}" for v in p50)
    worst = max(r["shm_rtt_us_p99"] for r in runs)
    rpc = ", ".join(f"{r['rpc_rtt_us_p50']:.0f}" for r in runs)
    return (f"shm round trip p50 {shm} us (p99 at most {worst:.2f}), {within} of {len(runs)} runs "
            f"<= 3 us; RPC p50 {rpc} us")


def cmd_ipc(args):
    print(ipc_line(args.ipc_jsonl))
    return 0


def cmd_disk(args):
    with open(args.disk_json) as f:
        print(disk_line(json.load(f)))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--kind", required=True, choices=["expertd", "llama.cpp", "llama-feed"])
    r.add_argument("--raw", required=True)
    r.add_argument("--stats", required=True)
    r.add_argument("--field", action="append", default=[])
    sub.add_parser("brief")
    d = sub.add_parser("is-done")
    d.add_argument("results")
    d.add_argument("id")
    d.add_argument("tg", type=int)
    d.add_argument("pp", type=int)
    t = sub.add_parser("table")
    t.add_argument("--disk", help="expert-bench storage --json of the disk (peer.sh's disk step)")
    t.add_argument("--ipc", help="expert-bench ipc --json lines (peer.sh's ipc step)")
    t.add_argument("results", nargs="+")
    k = sub.add_parser("disk")
    k.add_argument("disk_json")
    i = sub.add_parser("ipc")
    i.add_argument("ipc_jsonl")
    args = ap.parse_args()
    return {"record": cmd_record, "brief": cmd_brief, "is-done": cmd_done,
            "table": cmd_table, "disk": cmd_disk, "ipc": cmd_ipc}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
