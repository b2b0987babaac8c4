#!/usr/bin/env python3
"""Reads what bench/peer/peer.sh's runs printed and turns it into results and tables.

  summarize.py record --kind expertd|llama.cpp --raw OUT --stats STATS [--field k=v ...]
      one JSON line for a run: decode (tg) and prefill (pp) tokens/s, the run's status (ok,
      timeout, oom, failed), the cgroup's peak and events, and the fields given
  summarize.py brief < LINE          one human line for a result
  summarize.py is-done RESULTS ID TG PP  exit 0 when RESULTS has an ok result for ID at TG/PP tokens
  summarize.py table RESULTS [...]   the markdown tables (the last result of each run counts)

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
    objs = [o for o in json_objects(path) if "tokens_per_s" in o]
    if not objs:
        return
    o = objs[-1]
    gen = len(o.get("generated", []))
    steps = o.get("generation", {}).get("steps", 0)
    # expert-run's tokens/s counts the first token, which comes from the prompt's logits with no
    # decode step; llama-bench's tg counts decode steps. Both are wall-clock over the same steps.
    if gen > 0 and steps > 0:
        rec["tg_tokens_per_s"] = o["tokens_per_s"] * steps / gen
    pre = o.get("prefill", {})
    if pre.get("tokens_per_s"):
        rec["pp_tokens_per_s"] = pre["tokens_per_s"]
    rec["expertd"] = {
        "engine_note": o.get("engine_note"),
        "decode_steps": steps,
        "prefill_bytes_read_per_token": pre.get("bytes_read_per_token"),
        "decode_bytes_read_per_token": o.get("generation", {}).get("bytes_read_per_token"),
        "stall_ms_per_token": o.get("generation", {}).get("stall_ms_per_token"),
        "hits": o.get("hits"),
        "prefetch_depth": o.get("prefetch_depth"),
        "prefetch_precision": o.get("prefetch_precision"),
        "daemon_prefetch": o.get("daemon", {}).get("prefetch"),
    }


def cmd_record(args):
    rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for f in args.field:
        k, _, v = f.partition("=")
        rec[k] = value(v)
    stats = read_stats(args.stats)
    (parse_expertd if args.kind == "expertd" else parse_llama)(args.raw, rec)
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
    else:
        status = "ok"
    rec["status"] = status
    rec["wall_s"] = stats.get("wall_s")
    rec["cgroup"] = {"memory_max": stats.get("cap"), "peak": stats.get("peak"), "events": events}
    rec["raw"] = args.raw
    print(json.dumps(rec))


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def cmd_brief(_):
    r = json.loads(sys.stdin.read())
    peak = r.get("cgroup", {}).get("peak")
    mem = f", peak {peak / 2**30:.2f} GiB" if isinstance(peak, int) and peak >= 0 else ""
    oom = r.get("cgroup", {}).get("events", {}).get("oom_kill")
    print(f"{r['status']}: tg {fmt(r.get('tg_tokens_per_s'))} tokens/s, "
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


CONFIG_ORDER = ["expertd", "expertd-cpu", "expertd-d0", "expertd-cpu-d0", "cuda-tier", "cuda-all",
                "cpu"]
MODEL_NAMES = {
    "mixtral": "Mixtral-8x7B shape",
    "qwen3": "Qwen3-30B-A3B shape",
    "mixtral-llama": "Mixtral-8x7B (llama arch)",
    "ds3": "DeepSeek-V3 slice (6 blocks)",
}


def describe(r):
    c = r["config"]
    if c.startswith("expertd"):
        engine = ("CPU engine" if c.startswith("expertd-cpu")
                  else f"VRAM tier {r.get('vram_experts')} experts")
        depth = r.get("daemon_depth", "auto")
        prefetch = "prefetch off (depth 0)" if str(depth) == "0" else f"prefetch {depth}"
        return (f"expertd + expert-run: cache {r.get('cache_mib', 0) / 1024:.1f} GiB, {engine}, "
                f"{prefetch}")
    if c == "cpu":
        return "llama.cpp, CPU-only build"
    return (f"llama.cpp CUDA, -ngl 99 -ncmoe {r.get('ncmoe')} "
            f"({r.get('vram_experts')} experts in VRAM)")


def cell(r, key):
    x = r.get(key)
    if x is not None:
        return fmt(x)
    return "timeout" if r["status"] == "timeout" else ("OOM" if r["status"] == "oom" else "–")


def cmd_table(args):
    runs = load(args.results)
    keys = sorted({(r["model"], r["cap_gib"]) for r in runs.values()},
                  key=lambda k: (list(MODEL_NAMES).index(k[0]) if k[0] in MODEL_NAMES else 9, k[1]))
    pp = sorted({r.get("pp_tokens") for r in runs.values()})
    pp_name = f"pp{pp[0]}" if len(pp) == 1 else "pp"
    print(f"| model | cap | tool / config | tg tokens/s | {pp_name} tokens/s | status, wall, peak |")
    print("|---|---:|---|---:|---:|---|")
    summary = []
    prefetch = []
    for model, cap in keys:
        rs = [r for r in runs.values() if r["model"] == model and r["cap_gib"] == cap]
        rs.sort(key=lambda r: CONFIG_ORDER.index(r["config"]) if r["config"] in CONFIG_ORDER else 9)
        for r in rs:
            peak = r.get("cgroup", {}).get("peak")
            peak_s = f", {peak / 2**30:.1f} GiB" if isinstance(peak, int) and peak >= 0 else ""
            cap_s = f"{cap} GiB" + (" (uncapped)" if r.get("uncapped") == 1 else "")
            beside = ", beside a llama.cpp build" if r.get("build_running") == 1 else ""
            print(f"| {MODEL_NAMES.get(model, model)} | {cap_s} | {describe(r)} | "
                  f"{cell(r, 'tg_tokens_per_s')} | {cell(r, 'pp_tokens_per_s')} | "
                  f"{r['status']}, {r.get('wall_s')} s{peak_s}{beside} |")
        ours = [r for r in rs if r["config"].startswith("expertd")]
        theirs = [r for r in rs if r["tool"] == "llama.cpp"]
        if ours:
            summary.append((model, cap, ours[0], theirs))
        on = [r for r in ours if not r["config"].endswith("-d0")]
        off = [r for r in ours if r["config"].endswith("-d0")]
        if on and off:
            prefetch.append((model, cap, on[0], off[0]))
    print()
    print(f"| model | cap | expertd tg | llama.cpp best tg (config) | tg ratio | expertd {pp_name} "
          f"| llama.cpp best {pp_name} (config) | {pp_name} ratio |")
    print("|---|---:|---:|---|---:|---:|---|---:|")
    for model, cap, ours, theirs in summary:
        row = [MODEL_NAMES.get(model, model), f"{cap} GiB"]
        for key in ("tg_tokens_per_s", "pp_tokens_per_s"):
            best = max((r for r in theirs if r.get(key) is not None), key=lambda r: r[key],
                       default=None)
            mine = ours.get(key)
            row.append(fmt(mine))
            row.append("–" if best is None else f"{fmt(best[key])} ({best['config']})")
            ratio = mine / best[key] if mine is not None and best is not None and best[key] else None
            row.append("–" if ratio is None else f"**{ratio:.2f}×**")
        print("| " + " | ".join(row) + " |")
    if prefetch:
        prefetch_table(prefetch)
    return 0


def prefetch_table(pairs):
    """Prefetch on (the daemon's default) against off (depth 0), in the same runs' decode."""
    def mb(r, key):
        x = r.get("expertd", {}).get(key)
        return None if x is None else x / 1e6

    print()
    print("| model | cap | tg on / off | on ÷ off | decode MB read per token on / off "
          "| stall ms per token on / off | engine hint precision | auto at the end: depth, disk busy, bar |")
    print("|---|---:|---|---:|---|---|---:|---|")
    for model, cap, on, off in pairs:
        a, b = on.get("tg_tokens_per_s"), off.get("tg_tokens_per_s")
        ratio = f"**{a / b:.2f}×**" if a is not None and b else "–"
        stall = [r.get("expertd", {}).get("stall_ms_per_token") for r in (on, off)]
        print(f"| {MODEL_NAMES.get(model, model)} | {cap} GiB | {cell(on, 'tg_tokens_per_s')} / "
              f"{cell(off, 'tg_tokens_per_s')} | {ratio} | {fmt(mb(on, 'decode_bytes_read_per_token'), 0)}"
              f" / {fmt(mb(off, 'decode_bytes_read_per_token'), 0)} | {fmt(stall[0], 1)} / "
              f"{fmt(stall[1], 1)} | {fmt(on.get('expertd', {}).get('prefetch_precision'), 3)} | "
              f"{auto_state(on)} |")


def auto_state(r):
    d = r.get("expertd", {}).get("daemon_prefetch") or {}
    if "prefetch_depth_now" not in d:
        return "–"
    busy = d.get("disk_busy", -1)
    busy_s = "unmeasured" if busy is None or busy < 0 else f"{busy:.2f}"
    return f"{d['prefetch_depth_now']}, {busy_s}, {fmt(d.get('prefetch_auto_need'))}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--kind", required=True, choices=["expertd", "llama.cpp"])
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
    t.add_argument("results", nargs="+")
    args = ap.parse_args()
    return {"record": cmd_record, "brief": cmd_brief, "is-done": cmd_done,
            "table": cmd_table}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
