#!/usr/bin/env python3
"""The cache policies tried for issue 13 that are not in policy/policy.cc, on a routing trace.

docs/CACHE.md ("Every policy tried") quotes this script's output. It is a slow, plain-Python model
of `expert-tune simulate`: demand only, one global capacity, a layer's experts held while its
visit lasts, an incoming expert not admitted when it is worth less than every candidate. Its
`cyclic-visit` column is the C++ default (cyclic-hint without hints) to within 0.9 points on the
shared traces (it updates the statistics of a whole visit before choosing victims).

  scripts/policy-explore.py ../shared/traces/mixtral-8x7b-humaneval0.trace.jsonl [32,64,128,192]
"""
import json
import sys
from collections import OrderedDict, defaultdict


def load(path):
    recs = [json.loads(line) for line in open(path)]
    layers = max(r["layer"] for r in recs) + 1
    experts = max(e for r in recs for e in r["experts"]) + 1
    return [(r["layer"], r["experts"]) for r in recs], layers, experts


class Stats:
    """Online statistics every value-based policy below shares."""

    def __init__(self, L):
        self.L = L
        self.tok = 0
        self.cur = 0
        self.uses = defaultdict(int)
        self.luses = defaultdict(int)
        self.last = {}
        self.C = defaultdict(float)  # (layer, a, b): b used at the visit after one that used a
        self.N = defaultdict(float)
        self.lastset = {}

    def dist(self, layer):
        d = (layer - self.cur) % self.L
        return d if d else self.L


def p_cyclic(s, k, w=0.5, base=0.5):
    age = s.tok - s.last.get(k, -(10**9))
    rec = 0 if age > 60 else base**age
    lu = s.luses[k[0]]
    return w * rec + (1 - w) * (s.uses[k] / lu if lu else 0)


def p_markov(s, k, alpha=2.0):
    """P(b used at layer l's next visit | the set used at its last visit), smoothed to the share."""
    layer, b = k
    sh = (s.uses[k] + 0.5) / (s.luses[layer] + 4)
    prev = s.lastset.get(layer)
    if not prev:
        return sh
    return sum((s.C[(layer, a, b)] + alpha * sh) / (s.N[(layer, a)] + alpha) for a in prev) / len(prev)


def run_value(seq, L, cap, value, admit=True):
    """A value-based policy: evict the lowest value, refuse an incoming one worth less."""
    s = Stats(L)
    res = set()
    hits = n = 0
    for layer, ex in seq:
        if layer < s.cur:
            s.tok += 1
        s.cur = layer
        for e in ex:
            k = (layer, e)
            s.uses[k] += 1
            s.luses[layer] += 1
            s.last[k] = s.tok
        for e in ex:
            k = (layer, e)
            n += 1
            if k in res:
                hits += 1
                continue
            if len(res) < cap:
                res.add(k)
                continue
            cand = [x for x in res if not (x[0] == layer and x[1] in ex)]  # the visit is held
            if not cand:
                continue
            v = min(cand, key=lambda x: value(s, x))
            if admit and value(s, v) >= value(s, k):
                continue
            res.remove(v)
            res.add(k)
        prev = s.lastset.get(layer)
        if prev:
            for a in prev:
                s.N[(layer, a)] += 1
                for b in ex:
                    s.C[(layer, a, b)] += 1
        s.lastset[layer] = list(ex)
    return hits / n


def run_lru(seq, cap, admit_freq=False):
    """LRU; with admit_freq, TinyLFU-style: the incoming expert replaces the LRU victim only if it
    was used at least as often (exact counts stand in for the count-min sketch)."""
    c = OrderedDict()
    f = defaultdict(int)
    hits = n = 0
    for layer, ex in seq:
        for e in ex:
            k = (layer, e)
            n += 1
            f[k] += 1
            if k in c:
                hits += 1
                c.move_to_end(k)
                continue
            if len(c) >= cap:
                victim = next(iter(c))
                if admit_freq and f[victim] > f[k]:
                    continue
                c.popitem(last=False)
            c[k] = 1
    return hits / n


def run_quota(seq, L, cap, p=p_cyclic):
    """Per-layer quotas: cap / L slots per layer, the experts of highest p kept within a layer."""
    q = [cap // L + (1 if layer < cap % L else 0) for layer in range(L)]
    s = Stats(L)
    res = defaultdict(set)
    hits = n = 0
    for layer, ex in seq:
        if layer < s.cur:
            s.tok += 1
        s.cur = layer
        for e in ex:
            k = (layer, e)
            s.uses[k] += 1
            s.luses[layer] += 1
            s.last[k] = s.tok
        for e in ex:
            n += 1
            if e in res[layer]:
                hits += 1
                continue
            if len(res[layer]) < q[layer]:
                res[layer].add(e)
                continue
            cand = [x for x in res[layer] if x not in ex]
            if not cand:
                continue
            v = min(cand, key=lambda x: p(s, (layer, x)))
            if p(s, (layer, v)) >= p(s, (layer, e)):
                continue
            res[layer].remove(v)
            res[layer].add(e)
    return hits / n


def run_adaptive(seq, L, cap, weights=(0.0, 0.25, 0.5, 0.75, 1.0), window=256):
    """ARC-like adaptation of cyclic's recency weight: shadow caches of each weight run beside the
    real one; every `window` accesses the real one takes the weight whose shadow hit most."""
    shadows = [_Cache(cap) for _ in weights]
    real = _Cache(cap)
    s = Stats(L)
    w = 0.5
    scores = [0] * len(weights)
    hits = n = 0
    for layer, ex in seq:
        if layer < s.cur:
            s.tok += 1
        s.cur = layer
        for e in ex:
            k = (layer, e)
            s.uses[k] += 1
            s.luses[layer] += 1
            s.last[k] = s.tok
        for e in ex:
            k = (layer, e)
            n += 1
            for i, sw in enumerate(weights):
                scores[i] += shadows[i].access(s, k, ex, lambda s_, x, sw=sw: p_cyclic(s_, x, sw) / s_.dist(x[0]))
            hits += real.access(s, k, ex, lambda s_, x: p_cyclic(s_, x, w) / s_.dist(x[0]))
            if n % window == 0:
                w = weights[max(range(len(weights)), key=lambda i: scores[i])]
                scores = [0] * len(weights)
    return hits / n


def run_sticky(seq, L, E, cap, mix=1.0, buckets=3, alpha=4.0):
    """Per-expert reuse: P(used at the next visit | visits since its last use, 0..buckets), counted
    per expert and smoothed toward its layer's rate for that bucket; mixed with cyclic's p."""
    s = Stats(L)
    res = set()
    hits = n = 0
    last_visit = {}
    visits = defaultdict(int)
    cx = defaultdict(float)
    nx = defaultdict(float)
    cl = defaultdict(float)
    nl = defaultdict(float)

    def bucket(k, now):
        lv = last_visit.get(k)
        return buckets if lv is None else min(now - lv - 1, buckets)

    def value(s_, k):
        b = bucket(k, visits[k[0]] + 1)
        prior = (cl[(k[0], b)] + 1) / (nl[(k[0], b)] + 4)
        p = (cx[(k, b)] + alpha * prior) / (nx[(k, b)] + alpha)
        return (mix * p + (1 - mix) * p_cyclic(s_, k)) / s_.dist(k[0])

    for layer, ex in seq:
        if layer < s.cur:
            s.tok += 1
        s.cur = layer
        for e in range(E):
            k = (layer, e)
            b = bucket(k, visits[layer])
            cx[(k, b)] += e in ex
            nx[(k, b)] += 1
            cl[(layer, b)] += e in ex
            nl[(layer, b)] += 1
        for e in ex:
            k = (layer, e)
            s.uses[k] += 1
            s.luses[layer] += 1
            s.last[k] = s.tok
            last_visit[k] = visits[layer]
        visits[layer] += 1
        for e in ex:
            k = (layer, e)
            n += 1
            if k in res:
                hits += 1
                continue
            if len(res) < cap:
                res.add(k)
                continue
            cand = [x for x in res if not (x[0] == layer and x[1] in ex)]
            if not cand:
                continue
            v = min(cand, key=lambda x: value(s, x))
            if value(s, v) >= value(s, k):
                continue
            res.remove(v)
            res.add(k)
    return hits / n


class _Cache:
    def __init__(self, cap):
        self.cap = cap
        self.res = set()

    def access(self, s, k, ex, value):
        if k in self.res:
            return 1
        if len(self.res) < self.cap:
            self.res.add(k)
            return 0
        cand = [x for x in self.res if not (x[0] == k[0] and x[1] in ex)]
        if not cand:
            return 0
        v = min(cand, key=lambda x: value(s, x))
        if value(s, v) < value(s, k):
            self.res.remove(v)
            self.res.add(k)
        return 0


def main():
    seq, L, E = load(sys.argv[1])
    caps = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "32,64,128,192").split(",")]

    def expected_next(s, k):  # 1 / E[layers to next use], geometric in p
        p = max(p_cyclic(s, k), 1e-3)
        return 1.0 / (s.dist(k[0]) + L * (1 / p - 1))

    def least_stale(s, k):  # tokens since last use, then distance
        return -(s.tok - s.last.get(k, -(10**9))) * 1000 - s.dist(k[0])

    policies = [
        ("cyclic-visit", lambda c: run_value(seq, L, c, lambda s, k: p_cyclic(s, k) / s.dist(k[0]))),
        ("recency-0.3", lambda c: run_value(seq, L, c, lambda s, k: p_cyclic(s, k, 0.3) / s.dist(k[0]))),
        ("recency-0.7", lambda c: run_value(seq, L, c, lambda s, k: p_cyclic(s, k, 0.7) / s.dist(k[0]))),
        ("half-life-2", lambda c: run_value(seq, L, c, lambda s, k: p_cyclic(s, k, 0.5, 0.7) / s.dist(k[0]))),
        ("adaptive-arc", lambda c: run_adaptive(seq, L, c)),
        ("markov", lambda c: run_value(seq, L, c, lambda s, k: p_markov(s, k) / s.dist(k[0]))),
        ("markov-mix", lambda c: run_value(
            seq, L, c, lambda s, k: (0.5 * p_cyclic(s, k) + 0.5 * p_markov(s, k)) / s.dist(k[0]))),
        ("per-expert-reuse", lambda c: run_sticky(seq, L, E, c)),
        ("per-expert-mix", lambda c: run_sticky(seq, L, E, c, mix=0.5)),
        ("expected-next-use", lambda c: run_value(seq, L, c, expected_next)),
        ("least-stale", lambda c: run_value(seq, L, c, least_stale, admit=False)),
        ("tinylfu", lambda c: run_lru(seq, c, admit_freq=True)),
        ("quota", lambda c: run_quota(seq, L, c)),
    ]
    print("policy             " + " ".join(f"{c:>7}" for c in caps))
    print("lru                " + " ".join(f"{100 * run_lru(seq, c):6.1f}%" for c in caps), flush=True)
    for name, f in policies:
        print(f"{name:<18} " + " ".join(f"{100 * f(c):6.1f}%" for c in caps), flush=True)


if __name__ == "__main__":
    main()
