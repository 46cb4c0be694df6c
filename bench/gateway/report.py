#!/usr/bin/env python3
"""The gateway benchmark's report: reads what run.sh recorded (runs.jsonl, oha's JSON per point,
Equiroute's /metrics scrapes) and writes results.json and results.md, printing the latter.

    report.py --point FILE.json            one line about one oha run (progress output)
    report.py --out DIR [--quick 0|1] [--rate N] [--meta JSON]
    report.py --tail --out DIR [--meta JSON]   the heavy-tailed profile (run.sh --profile heavy-tail)
"""

import argparse
import glob
import json
import os
import re
import sys

SYSTEMS = ["direct", "equiroute", "equiroute1", "nginx", "litellm"]
LABELS = {"direct": "direct (mock upstream)", "equiroute": "Equiroute (lqm-ts)",
          "equiroute1": "Equiroute (lqm-ts), worker_threads = 1",
          "nginx": "nginx (round-robin)", "litellm": "LiteLLM proxy (simple-shuffle)"}
MAX_P99_S = 1.0          # sustained throughput: p99 below 1 s ...
MAX_ERROR_RATE = 0.001   # ... and fewer than 0.1% errors
PHASES = ("latency", "throughput", "rate", "repeat")

# The project's targets.
TARGET_ADDED_P99_C1_US = 100.0
TARGET_RPS_VS_NGINX = 0.80
TARGET_LITELLM_OVER_EQR = 50.0
TARGET_RSS_MIB = 64.0
TARGET_ROUTER_P99_US = 10.0


def point(path):
    """The numbers of one oha run: latencies in ms, errors = non-2xx answers + transport errors."""
    with open(path) as f:
        d = json.load(f)
    codes = {int(k): v for k, v in (d.get("statusCodeDistribution") or {}).items()}
    transport = sum((d.get("errorDistribution") or {}).values())
    ok = sum(v for k, v in codes.items() if 200 <= k < 300)
    total = sum(codes.values()) + transport
    pct = d.get("latencyPercentiles") or {}
    ms = lambda k: None if pct.get(k) is None else pct[k] * 1000.0  # noqa: E731
    return {
        "p95_ms": ms("p95"),
        "requests": total,
        "errors": total - ok,
        "error_rate": (total - ok) / total if total else 1.0,
        "rps": d["summary"]["requestsPerSec"],
        "p50_ms": ms("p50"), "p90_ms": ms("p90"), "p99_ms": ms("p99"), "p99_9_ms": ms("p99.9"),
        "max_ms": None if d["summary"].get("slowest") is None else d["summary"]["slowest"] * 1000.0,
        "status_codes": {str(k): v for k, v in codes.items()},
        "transport_errors": d.get("errorDistribution") or {},
    }


def paired_summary(rows):
    """pair.sh's closing lines from its table rows ("| 2 B | 32,646 | 32 | 4.3 | 99.2% | ..."):
    each column's median for A and for B, how many rounds B served more requests/s, and the
    median of the rounds' paired differences (B - A), which the machine's drift between
    rounds moves less than it moves either median."""
    import statistics

    rounds = {}
    for line in rows.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or len(cells[0].split()) != 2:
            continue
        number, side = cells[0].split()
        rounds.setdefault(number, {})[side] = (
            float(cells[1].replace(",", "")), float(cells[2]), float(cells[3]),
            float(cells[4].rstrip("%")),
        )
    pairs = [(r["A"], r["B"]) for r in rounds.values() if "A" in r and "B" in r]
    if not pairs:
        return "no complete round: nothing to summarize"
    med = lambda side, k: statistics.median(p[side][k] for p in pairs)  # noqa: E731
    diffs = [b[0] - a[0] for a, b in pairs]
    rel = statistics.median((b[0] - a[0]) / a[0] for a, b in pairs)
    ahead = sum(d > 0 for d in diffs)
    return "\n".join([
        f"medians of {len(pairs)} rounds, A / B: {med(0, 0):,.0f} / {med(1, 0):,.0f} requests/s, "
        f"{med(0, 1):g} / {med(1, 1):g} µs of CPU per request, router share {med(0, 2):.1f} / "
        f"{med(1, 2):.1f} µs, {med(0, 3):.1f}% / {med(1, 3):.1f}% ≤ 10 µs",
        f"B served more requests/s in {ahead} of {len(pairs)} rounds; the rounds' paired "
        f"difference B - A: median {statistics.median(diffs):+,.0f} requests/s ({100 * rel:+.1f}%)",
    ])


def histogram(text, name):
    """Cumulative buckets {le: count} of a Prometheus histogram, plus its sum and count."""
    buckets, total, count = {}, 0.0, 0
    for line in text.splitlines():
        m = re.match(rf'^{name}_bucket\{{le="([^"]+)"\}} (\S+)$', line)
        if m:
            le = float("inf") if m.group(1) == "+Inf" else float(m.group(1))
            buckets[le] = buckets.get(le, 0) + int(float(m.group(2)))
        elif line.startswith(f"{name}_sum "):
            total += float(line.split()[1])
        elif line.startswith(f"{name}_count "):
            count += int(float(line.split()[1]))
    return buckets, total, count


def histogram_delta(before, after, name):
    """The histogram `name` over what happened between two scrapes (texts): the cumulative
    buckets, the sum and the count of `after` minus those of `before`."""
    (b0, s0, c0), (b1, s1, c1) = histogram(before, name), histogram(after, name)
    return {le: n - b0.get(le, 0) for le, n in b1.items()}, s1 - s0, c1 - c0


def bucket_quantile(buckets, count, q):
    """The smallest bucket bound holding at least q of the observations (an upper bound)."""
    for le in sorted(buckets):
        if count and buckets[le] >= q * count:
            return le
    return None


def histogram_summary(texts, name):
    """Mean, bucket-bound p50/p99 and the share at or under 10 µs of the histogram `name`
    summed over several scrapes."""
    buckets, total, count = {}, 0.0, 0
    for text in texts:
        b, s_, n = histogram(text, name)
        for k, v in b.items():
            buckets[k] = buckets.get(k, 0) + v
        total, count = total + s_, count + n
    return {
        "count": count,
        "mean_us": total / count if count else None,
        "p50_le_us": bucket_quantile(buckets, count, 0.50),
        "p99_le_us": bucket_quantile(buckets, count, 0.99),
        "share_le_10us": buckets.get(10.0, 0) / count if count else None,
        "buckets": {("+Inf" if k == float("inf") else k): v for k, v in sorted(buckets.items())},
    }


def summary_text(h):
    if not h["count"]:
        return "–"
    return (f"p99 ≤ {h['p99_le_us']:g} µs (bucket bound), p50 ≤ {h['p50_le_us']:g} µs, mean {h['mean_us']:.2f} µs, "
            f"{h['share_le_10us']:.2%} ≤ 10 µs, n = {h['count']:,}")


def attempts(text):
    out = {}
    for line in text.splitlines():
        m = re.match(r'^equiroute_attempts_total\{interface="[^"]*",provider="([^"]+)",status="([^"]+)"\} (\d+)$', line)
        if m:
            out[f"{m.group(1)}/{m.group(2)}"] = out.get(f"{m.group(1)}/{m.group(2)}", 0) + int(m.group(3))
    return out


def rss_growth(path):
    """Least-squares slope of VmRSS over the second half of the fixed-rate run (MiB per
    minute): the steady state. The first half holds connection set-up and the filling of
    bounded stores (Equiroute keeps at most server.max_pending_feedback = 32,768 request
    contexts for feedback: full after 32,768 / 2,000 ≈ 16 s), which is growth that stops."""
    if not os.path.exists(path):
        return None
    pts = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                pts.append((float(parts[0]), int(parts[1]) / 1024.0))
    half = pts[-1][0] / 2.0 if pts else 0.0
    pts = [p for p in pts if p[0] >= half]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
    return {"mib_per_min": slope * 60.0, "samples": n, "first_mib": pts[0][1], "last_mib": pts[-1][1],
            "seconds": pts[-1][0]}


def fmt_us(x):
    return "–" if x is None else f"{x:+,.0f}"


def fmt_ms(x):
    return "–" if x is None else f"{x:.2f}"


# RSS that still climbs by more than this over the fixed-rate run is not a steady state.
MAX_STEADY_GROWTH_MIB_PER_MIN = 2.0


def rss_verdict(peak_mib, growth):
    if peak_mib > TARGET_RSS_MIB:
        return False
    return not (growth and growth["mib_per_min"] > MAX_STEADY_GROWTH_MIB_PER_MIN)


def rss_text(peak_mib, rate_point, growth):
    if peak_mib is None:
        return "–"
    text = f"{peak_mib:.1f} MiB peak"
    if rate_point:
        text += f" at {rate_point['rps']:,.0f} rps achieved"
    if growth:
        text += f"; {growth['mib_per_min']:,.1f} MiB/min over the second half ({growth['first_mib']:.1f} → {growth['last_mib']:.1f} MiB, at {growth['seconds']:.0f} s)"
        if growth["mib_per_min"] > MAX_STEADY_GROWTH_MIB_PER_MIN and peak_mib <= TARGET_RSS_MIB:
            left = (TARGET_RSS_MIB - growth["last_mib"]) / growth["mib_per_min"]
            text += f", over 64 MiB in about {left:.1f} more min"
    return text


def verdict(ok):
    return "n/a" if ok is None else ("**met**" if ok else "**MISSED**")


def build(out, quick, rate, meta):
    runs = []
    with open(os.path.join(out, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    res = {s: {"latency": {}, "throughput": {}, "rate": {}, "repeat": {}, "peak_rss_kib": {}, "missing": None,
               "failed_points": []} for s in SYSTEMS}
    for r in runs:
        s = res[r["system"]]
        if "missing" in r:
            s["missing"] = r["missing"]
        elif "peak_rss_kib" in r:
            s["peak_rss_kib"][r["phase"]] = r["peak_rss_kib"]
        elif "error" in r:
            s["failed_points"].append(f'{r["phase"]} c={r["concurrency"]}: {r["error"]}')
        else:
            p = point(os.path.join(out, r["file"]))
            p["cpu_s"] = r.get("cpu_s")
            p["busy_before_pct"] = r.get("busy_before_pct")
            p["foreign_cpu_pct"] = r.get("foreign_cpu_pct")
            p["cpu_us_per_request"] = (r["cpu_s"] * 1e6 / p["requests"]
                                       if r.get("cpu_s") is not None and p["requests"] else None)
            s[r["phase"]][r["concurrency"]] = p

    direct = res["direct"]["latency"]
    for name, s in res.items():
        s["added_us"] = {}
        for c, p in s["latency"].items():
            d = direct.get(c)
            if d and p["p50_ms"] is not None and d["p50_ms"] is not None:
                s["added_us"][c] = {"p50": (p["p50_ms"] - d["p50_ms"]) * 1000.0,
                                    "p99": (p["p99_ms"] - d["p99_ms"]) * 1000.0}
        sustained = [(p["rps"], c) for c, p in s["throughput"].items()
                     if p["p99_ms"] is not None and p["p99_ms"] < MAX_P99_S * 1000 and p["error_rate"] < MAX_ERROR_RATE]
        s["max_rps"], s["max_rps_concurrency"] = max(sustained) if sustained else (None, None)
        rss = [v for k, v in s["peak_rss_kib"].items() if k in ("latency", "throughput")]
        s["peak_rss_mib"] = max(rss) / 1024.0 if rss else None

    eq, ng, ll = res["equiroute"], res["nginx"], res["litellm"]
    ratio_rps = eq["max_rps"] / ng["max_rps"] if eq["max_rps"] and ng["max_rps"] else None
    eq16 = eq["added_us"].get(16, {}).get("p99")
    ll16 = ll["added_us"].get(16, {}).get("p99")
    ratio_p99 = ll16 / eq16 if ll16 is not None and eq16 is not None and eq16 > 0 else None

    rate_point = eq["rate"].get(128)
    rate_rss = eq["peak_rss_kib"].get("rate")
    rate_rss_mib = rate_rss / 1024.0 if rate_rss else None
    growth = rss_growth(os.path.join(out, "raw", "equiroute-rate-rss.txt"))

    # Equiroute's router-share and decision-time histograms, per phase and summed over every
    # instance that ran.
    def scrapes(system):
        """The /metrics texts of `system`'s instances, by phase."""
        texts = {}
        for path in sorted(glob.glob(os.path.join(out, "raw", f"{system}-*-metrics.txt"))):
            with open(path) as f:
                texts[os.path.basename(path)[len(system) + 1:-len("-metrics.txt")]] = f.read()
        return texts

    texts = scrapes("equiroute")
    att = {ph: attempts(t) for ph, t in texts.items()}
    decision = histogram_summary(texts.values(), "equiroute_decision_microseconds")
    router = histogram_summary(texts.values(), "equiroute_router_microseconds")
    router_by_phase = {ph: histogram_summary([t], "equiroute_router_microseconds") for ph, t in texts.items()}
    # The same with one event loop (equiroute1): no second loop to share locks and cache lines with.
    one_loop = {ph: histogram_summary([t], "equiroute_router_microseconds")
                for ph, t in scrapes("equiroute1").items()}
    dcount = router["count"]

    # The same system measured twice at c=1 (the direct upstream, first and last): how far
    # percentiles of two runs of one system lie apart on this machine -- the resolution of
    # every "added" number at c=1.
    again = res["direct"].get("repeat", {}).get(1)
    first = direct.get(1)
    aa = None
    if again and first:
        aa = {"p50_us": (again["p50_ms"] - first["p50_ms"]) * 1000.0,
              "p99_us": (again["p99_ms"] - first["p99_ms"]) * 1000.0}

    added_c1 = eq["added_us"].get(1, {}).get("p99")
    targets = [
        ("Equiroute added p99 at c=1 ≤ 100 µs", None if added_c1 is None else added_c1 <= TARGET_ADDED_P99_C1_US,
         "–" if added_c1 is None else f"{fmt_us(added_c1)} µs"),
        ("Equiroute sustained RPS ≥ 80% of nginx (0 ms upstream)",
         None if ratio_rps is None else ratio_rps >= TARGET_RPS_VS_NGINX,
         "–" if ratio_rps is None else f"{ratio_rps:.0%} ({eq['max_rps']:,.0f} / {ng['max_rps']:,.0f} rps)"),
        ("LiteLLM added p99 / Equiroute added p99 ≥ 50 at c=16",
         None if ratio_p99 is None else ratio_p99 >= TARGET_LITELLM_OVER_EQR,
         "–" if ratio_p99 is None else f"{ratio_p99:,.0f}× ({fmt_us(ll16)} µs / {fmt_us(eq16)} µs)"),
        (f"Equiroute peak RSS ≤ 64 MiB at {rate} rps with 3 providers",
         None if rate_rss_mib is None else rss_verdict(rate_rss_mib, growth),
         rss_text(rate_rss_mib, rate_point, growth)),
        ("router share (decision + bookkeeping) p99 ≤ 10 µs",
         None if router["p99_le_us"] is None else router["p99_le_us"] <= TARGET_ROUTER_P99_US,
         "–" if router["p99_le_us"] is None else summary_text(router)),
    ]
    if aa is not None and added_c1 is not None:
        targets[0] = (targets[0][0], targets[0][1],
                      f"{targets[0][2]} (the direct upstream against itself, first vs last run: "
                      f"p50 {fmt_us(aa['p50_us'])} µs, p99 {fmt_us(aa['p99_us'])} µs)")
    if eq16 is not None and eq16 <= 0 and ll16 is not None:
        targets[2] = (targets[2][0], True, f"∞ (Equiroute's added p99 {fmt_us(eq16)} µs is within noise; LiteLLM {fmt_us(ll16)} µs)")

    # ---- markdown
    md = []
    md.append("# Gateway benchmark" + (" (--quick smoke run: short points, not for conclusions)" if quick else ""))
    md.append("")
    md.append(f"Load: {meta.get('load_tool', 'oha')}, closed loop, {meta.get('duration_s')} s per point after "
              f"{meta.get('warmup_s')} s warm-up, {meta.get('cores')} cores shared by load generator, system and mocks; "
              f"CPU busy before start {meta.get('busy_pct_at_start')}%.")
    md.append("")
    md.append("Added latency = system percentile − direct percentile at the same concurrency (20 ms upstream), in µs. "
              "Max RPS: best closed-loop throughput against the 0 ms upstream whose p99 < 1 s and errors < 0.1% "
              "(concurrency in brackets). CPU µs / request: the system's user + system CPU time over that point's requests. Peak RSS: VmHWM summed over the system's processes, max over its runs.")
    md.append("")
    md.append("| system | c=1 added p50 / p99 | c=16 added p50 / p99 | c=64 added p50 / p99 | max RPS (0 ms) | CPU µs / request there | peak RSS MiB |")
    md.append("|---|---|---|---|---|---|---|")
    for name in SYSTEMS:
        s = res[name]
        if name != "direct" and s["missing"] and not s["latency"]:
            md.append(f"| {LABELS[name]} | missing: {s['missing']} | | | | | |")
            continue
        cells = []
        for c in (1, 16, 64):
            if name == "direct":
                p = s["latency"].get(c)
                cells.append("–" if not p else f"abs {fmt_ms(p['p50_ms'])} / {fmt_ms(p['p99_ms'])} ms")
            else:
                a = s["added_us"].get(c)
                cells.append("–" if not a else f"{fmt_us(a['p50'])} / {fmt_us(a['p99'])} µs")
        rps = "–" if s["max_rps"] is None else f"{s['max_rps']:,.0f} (c={s['max_rps_concurrency']})"
        if name == "direct" and s["max_rps"] is not None:
            rps += " one mock"
        rss = "–" if s["peak_rss_mib"] is None else f"{s['peak_rss_mib']:.1f}"
        cpu = s["throughput"].get(s["max_rps_concurrency"], {}).get("cpu_us_per_request")
        cpu = "–" if cpu is None else f"{cpu:,.0f}"
        md.append(f"| {LABELS[name]} | {' | '.join(cells)} | {rps} | {cpu} | {rss} |")
    md.append("")
    md.append(f"- Equiroute / nginx sustained RPS: {'–' if ratio_rps is None else f'{ratio_rps:.2f}'}")
    eq1 = res["equiroute1"]
    if eq1["max_rps"] and ng["max_rps"]:
        md.append(f"- Equiroute with worker_threads = 1 / nginx sustained RPS: {eq1['max_rps'] / ng['max_rps']:.2f} "
                  "(not the target's configuration, which is the default: one thread per core)")
    md.append(f"- LiteLLM / Equiroute added p99 at c=16: {targets[2][2]}")
    if rate_point:
        md.append(f"- Equiroute at a fixed {rate} rps (c=128, 20 ms upstream, 3 providers): {rate_point['rps']:,.0f} rps achieved, "
                  f"p50 {fmt_ms(rate_point['p50_ms'])} ms, p99 {fmt_ms(rate_point['p99_ms'])} ms, "
                  f"{rate_point['errors']} errors, RSS {rss_text(rate_rss_mib, None, growth)}")
    if dcount:
        md.append(f"- Equiroute router share (`equiroute_router_microseconds`: featurizing, eligibility, ranking, "
                  f"and the bookkeeping after each attempt and the answer), all runs: {targets[4][2]}; by phase: "
                  + "; ".join(f"{ph}: {summary_text(h)}" for ph, h in sorted(router_by_phase.items()) if h["count"]))
        md.append(f"- Of it, the decision (`equiroute_decision_microseconds`, eligibility + ranking), all runs: "
                  f"{summary_text(decision)}")
    if any(h["count"] for h in one_loop.values()):
        md.append("- The router share with one event loop (`worker_threads = 1`, not counted in the target), by phase: "
                  + "; ".join(f"{ph}: {summary_text(h)}" for ph, h in sorted(one_loop.items()) if h["count"]))
    if aa is not None:
        md.append(f"- A/A: the direct upstream measured at c=1 first and again last: p50 {fmt_us(aa['p50_us'])} µs, "
                  f"p99 {fmt_us(aa['p99_us'])} µs apart; added latencies at c=1 are only resolved to about that.")
    md.append("")
    md.append("## Targets")
    md.append("")
    md.append("| target | measured | verdict |")
    md.append("|---|---|---|")
    for name, ok, what in targets:
        md.append(f"| {name} | {what} | {verdict(ok)} |")
    md.append("")
    md.append("## Every point")
    md.append("")
    md.append("| system | phase | c | rps | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | errors / requests | CPU µs/req |")
    md.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in SYSTEMS:
        for phase in PHASES:
            for c, p in sorted(res[name].get(phase, {}).items()):
                md.append(f"| {name} | {phase} | {c} | {p['rps']:,.0f} | {fmt_ms(p['p50_ms'])} | {fmt_ms(p['p90_ms'])} | "
                          f"{fmt_ms(p['p99_ms'])} | {fmt_ms(p['p99_9_ms'])} | {fmt_ms(p['max_ms'])} | {p['errors']} / {p['requests']} | "
                          f"{'–' if p['cpu_us_per_request'] is None else format(p['cpu_us_per_request'], ',.0f')} |")
        for f in res[name]["failed_points"]:
            md.append(f"| {name} | {f} | | | | | | | | | |")
    md.append("")
    md.append("Peak RSS per run (MiB): " + "; ".join(
        f"{n} " + ", ".join(f"{ph} {kib / 1024:.1f}" for ph, kib in res[n]["peak_rss_kib"].items())
        for n in SYSTEMS if res[n]["peak_rss_kib"]))
    if att:
        md.append("")
        md.append("Equiroute attempts per provider: " + "; ".join(
            f"{phase}: " + ", ".join(f"{k} {v}" for k, v in sorted(a.items())) for phase, a in sorted(att.items())))
    busy = [f"{n} {ph} c={c} ({p.get('busy_before_pct')}% busy before, {p.get('foreign_cpu_pct')}% of a core during)"
            for n in SYSTEMS for ph in PHASES for c, p in sorted(res[n][ph].items())
            if (p.get("busy_before_pct") or 0) > 25 or (p.get("foreign_cpu_pct") or 0) > 20]
    if busy:
        md.append("")
        md.append("**Warning**: other processes used the CPU before or during these points (a build?); "
                  "their numbers are skewed, rerun on an idle machine: " + "; ".join(busy))
    missing = [(n, res[n]["missing"]) for n in SYSTEMS if res[n]["missing"]]
    if missing:
        md.append("")
        for n, why in missing:
            md.append(f"- **{n} missing**: {why}")
    text = "\n".join(md) + "\n"

    results = {"meta": meta, "quick": bool(quick), "systems": res, "ratios": {
        "equiroute_over_nginx_rps": ratio_rps, "litellm_over_equiroute_added_p99_c16": ratio_p99},
        "rate_run": {"target_rps": rate, "point": rate_point, "peak_rss_mib": rate_rss_mib, "rss_growth": growth},
        "decision_time": decision, "router_time": router, "router_time_by_phase": router_by_phase,
        "router_time_one_loop_by_phase": one_loop,
        "direct_a_a_c1_us": aa, "attempts": att,
        "targets": [{"target": n, "met": ok, "measured": w} for n, ok, w in targets]}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print(text)


TAIL_SYSTEMS = ["direct", "nginx", "litellm", "equiroute", "equiroute-hedge"]
TAIL_LABELS = {"direct": "direct (one mock)", "nginx": "nginx (round-robin)",
               "litellm": "LiteLLM proxy (simple-shuffle)", "equiroute": "Equiroute (lqm-ts), no hedging",
               "equiroute-hedge": "Equiroute (lqm-ts), hedging"}


def counter(text, name, label):
    """{label value: count} of a Prometheus counter, summed over its other labels."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            m = re.search(rf'{label}="([^"]+)"', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + int(float(line.split()[-1]))
    return out


def read_or_none(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def build_tail(out, meta):
    """The heavy-tailed profile: per system the end-to-end percentiles over the measured
    seconds, the errors, the chat calls the mocks received per request and Equiroute's hedges
    (both differenced between the end of the warm-up and the end of the point)."""
    with open(os.path.join(out, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    res = {s: {"point": None, "missing": None} for s in TAIL_SYSTEMS}
    for r in runs:
        s = res[r["system"]]
        if "missing" in r:
            s["missing"] = r["missing"]
        elif r.get("phase") == "tail" and "file" in r:
            s["point"] = point(os.path.join(out, r["file"]))
            s["point"]["busy_before_pct"] = r.get("busy_before_pct")
            s["point"]["foreign_cpu_pct"] = r.get("foreign_cpu_pct")
        elif "error" in r:
            s["missing"] = f'the point failed: {r["error"]}'
    for name, s in res.items():
        before, after = (read_or_none(os.path.join(out, "raw", f"{name}-tail-calls-{w}.txt")) for w in ("before", "after"))
        p = s["point"]
        if p and before and after and before.strip().isdigit() and after.strip().isdigit():
            s["upstream_calls"] = int(after) - int(before)
            s["calls_per_request"] = s["upstream_calls"] / p["requests"] if p["requests"] else None
        mb, ma = (read_or_none(os.path.join(out, "raw", f"{name}-tail-metrics-{w}.txt")) for w in ("before", "after"))
        if mb is not None and ma is not None:
            b, a = counter(mb, "equiroute_hedges_total", "event"), counter(ma, "equiroute_hedges_total", "event")
            s["hedges"] = {k: a.get(k, 0) - b.get(k, 0) for k in ("started", "won", "cancelled")}

    md = ["# Gateway benchmark: heavy-tailed upstreams", ""]
    md.append(f"Load: {meta.get('load_tool', 'oha')}, open loop at {meta.get('rate')} requests/s "
              f"(`-q`, `--latency-correction`, up to 64 in flight), {meta.get('duration_s')} s measured after a "
              f"{meta.get('warmup_s')} s warm-up at the same rate; {meta.get('cores')} cores shared by load generator, "
              f"system and mocks; CPU busy before start {meta.get('busy_pct_at_start')}%. Upstreams: three mocks, "
              "log-normal body p50 40 ms, p95 80 ms, Pareto tail of shape 1.5 beyond the p95 (`mock-tail.toml`).")
    md.append("")
    md.append("Latency is end to end, as the client saw it. Upstream calls per request: the chat calls the three "
              "mocks received during the measured seconds over the requests completed; extra calls = that − 1.")
    md.append("")
    md.append("| system | requests | p50 ms | p95 ms | p99 ms | p99.9 ms | max ms | errors | upstream calls per request | extra calls | hedges started / won / cancelled |")
    md.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in TAIL_SYSTEMS:
        s, p = res[name], res[name]["point"]
        if not p:
            md.append(f"| {TAIL_LABELS[name]} | missing: {s['missing'] or 'no point'} | | | | | | | | | |")
            continue
        cpr = s.get("calls_per_request")
        h = s.get("hedges")
        hedges = "–" if not h else f"{h['started']} / {h['won']} / {h['cancelled']}"
        calls = "–" if cpr is None else f"{cpr:.4f}"
        extra = "–" if cpr is None else f"{(cpr - 1) * 100:+.2f}%"
        md.append(f"| {TAIL_LABELS[name]} | {p['requests']:,} | {fmt_ms(p['p50_ms'])} | {fmt_ms(p['p95_ms'])} | "
                  f"{fmt_ms(p['p99_ms'])} | {fmt_ms(p['p99_9_ms'])} | {fmt_ms(p['max_ms'])} | "
                  f"{p['errors']} ({p['error_rate']:.2%}) | {calls} | {extra} | {hedges} |")
    busy = [f"{n} ({res[n]['point'].get('busy_before_pct')}% busy before, {res[n]['point'].get('foreign_cpu_pct')}% of a core during)"
            for n in TAIL_SYSTEMS if res[n]["point"] and ((res[n]["point"].get("busy_before_pct") or 0) > 25
                                                          or (res[n]["point"].get("foreign_cpu_pct") or 0) > 20)]
    if busy:
        md.append("")
        md.append("**Warning**: other processes used the CPU before or during these points (a build?); "
                  "their numbers are skewed: " + "; ".join(busy))
    text = "\n".join(md) + "\n"
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "profile": "heavy-tail", "systems": res}, f, indent=2, default=str)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--point")
    ap.add_argument("--out")
    ap.add_argument("--quick", type=int, default=0)
    ap.add_argument("--rate", type=int, default=2000)
    ap.add_argument("--meta", default="{}")
    ap.add_argument("--tail", action="store_true")
    a = ap.parse_args()
    if a.point:
        p = point(a.point)
        print(f"      {p['rps']:,.0f} rps, p50 {fmt_ms(p['p50_ms'])} ms, p99 {fmt_ms(p['p99_ms'])} ms, "
              f"errors {p['errors']}/{p['requests']}")
        return 0
    if not a.out:
        ap.error("--point or --out")
    if a.tail:
        build_tail(a.out, json.loads(a.meta))
        return 0
    build(a.out, a.quick, a.rate, json.loads(a.meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
