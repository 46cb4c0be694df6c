#!/usr/bin/env python3
"""The gateway soak: `equiroute serve` at a fixed request rate for a bounded time against a mock
upstream that plays every fault at random, sampled every 10 s, checked at the end.

See bench/soak/README.md for the method, the checks and their rules. Standard library only.

    bench/soak/soak.py [--duration 600] [--rate 40] [--backend file|redis] [--out DIR] ...
"""

import argparse
import http.client
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SAMPLE_S = 10.0
WORKERS = 64                 # client threads: bounds the requests in flight
MAX_QUEUED = 2000            # scheduled requests waiting for a thread; beyond, dropped and counted
CLIENT_TIMEOUT_S = 30.0      # no request of the soak may take longer (the deadline is 5 s)
STREAM_SHARE = 0.3           # share of chat requests sent with "stream": true
DUPLICATE_SHARE = 0.1        # share of answered requests whose feedback is posted twice
# Flatness: the last third's mean may exceed the middle third's by at most this much.
FLAT_REL = 0.10
FLAT_ABS = {"rss_mib": 2.0, "fds": 4.0, "state_mib": 1.0}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * len(v) + 0.5)) - 1))]


class Procs:
    """Every process the soak starts, each in its own process group, stopped on exit."""

    def __init__(self, logs):
        self.logs = logs
        self.procs = {}

    def start(self, name, argv):
        out = open(os.path.join(self.logs, f"{name}.out.log"), "ab")
        err = open(os.path.join(self.logs, f"{name}.err.log"), "ab")
        p = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        self.procs[name] = p
        return p

    def stop(self, name, sig=signal.SIGTERM, wait_s=20.0):
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return None if p is None else p.returncode
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return p.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            return p.wait()

    def stop_all(self):
        for name in list(self.procs):
            self.stop(name, wait_s=5.0)


def wait_http(port, path, seconds, proc):
    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            return False
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            c.close()
            if r.status < 500:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def redis_cmd(port, *args):
    """One Redis command over RESP; the raw reply, or None when Redis does not answer."""
    req = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(req.encode())
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if data.startswith(b"$"):
                    head, _, rest = data.partition(b"\r\n")
                    if len(rest) >= int(head[1:]) + 2:
                        break
                elif data.endswith(b"\r\n"):
                    break
            return data.decode(errors="replace")
    except OSError:
        return None


def proc_sample(pid):
    """(VmRSS in KiB, open file descriptors) of a live process."""
    rss = None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def scrape(port):
    """The gateway's /metrics as {name{labels}: value}."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def metric_sum(metrics, name, **labels):
    total = 0.0
    for key, value in metrics.items():
        if key == name or key.startswith(name + "{"):
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
    return total


class Load:
    """Drives the fixed rate: a scheduler thread enqueues each request at its time, client
    threads (keep-alive connections) send it, then post feedback for what was answered.
    Latency counts from the scheduled time, so a slow gateway cannot slow the load down."""

    def __init__(self, port, rate, seed):
        self.port = port
        self.rate = rate
        self.rng = random.Random(seed)
        self.jobs = queue.Queue()
        self.lock = threading.Lock()
        self.window = []              # (latency_s, streamed, outcome) since the last sample
        self.totals = {}
        self.feedback_ids = set()     # request ids whose first feedback was posted
        self.stop = threading.Event()
        self.threads = []

    def count(self, key, n=1):
        with self.lock:
            self.totals[key] = self.totals.get(key, 0) + n

    def scheduler(self, seconds):
        t0 = time.monotonic()
        i = 0
        while not self.stop.is_set():
            at = t0 + i / self.rate
            if at - t0 >= seconds:
                break
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if self.jobs.qsize() >= MAX_QUEUED:
                self.count("dropped_by_client")
            else:
                streamed = self.rng.random() < STREAM_SHARE
                self.jobs.put((at, streamed, self.rng.random(), self.rng.random() < DUPLICATE_SHARE))
            i += 1
        self.count("scheduled", i)

    def connection(self):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=CLIENT_TIMEOUT_S)

    def post(self, conn, path, body):
        """(status, headers, body text) or raises OSError/HTTPException."""
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r, r.read().decode(errors="replace")

    def worker(self):
        conn = self.connection()
        while True:
            job = self.jobs.get()
            if job is None:
                break
            at, streamed, quality, duplicate = job
            body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
            if streamed:
                body["stream"] = True
            try:
                status, r, text = self.post(conn, "/v1/chat/completions", body)
                rid = r.getheader("x-equiroute-request-id")
                if status == 200 and streamed:
                    # A committed stream is complete only with its [DONE].
                    outcome = "ok" if text.rstrip().endswith("data: [DONE]") else "stream_broken"
                elif status == 200:
                    outcome = "ok"
                else:
                    outcome = f"{status // 100}xx"
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = self.connection()
                status, rid, outcome = None, None, "transport_error"
            latency = time.monotonic() - at
            with self.lock:
                self.window.append((latency, streamed, outcome))
                self.totals[f"chat_{outcome}"] = self.totals.get(f"chat_{outcome}", 0) + 1
            if outcome == "ok" and rid:
                conn = self.feedback(conn, rid, quality, duplicate)

    def feedback(self, conn, rid, quality, duplicate):
        """Posts the answered request's score (and, for some, the same score again)."""
        for attempt, expect in enumerate(("accepted", "duplicate") if duplicate else ("accepted",)):
            key = "feedback_posted" if attempt == 0 else "feedback_repeat_posted"
            self.count(key)
            try:
                status, _, text = self.post(conn, "/v1/feedback",
                                            {"request_id": rid, "quality": round(quality, 3), "source": "api"})
                got = json.loads(text).get("status") if status == 200 else f"http_{status}"
            except (OSError, http.client.HTTPException, ValueError):
                conn.close()
                conn = self.connection()
                got = "transport_error"
            if attempt == 0:
                with self.lock:
                    if rid in self.feedback_ids:
                        self.totals["feedback_id_reused"] = self.totals.get("feedback_id_reused", 0) + 1
                    self.feedback_ids.add(rid)
            self.count(f"feedback_{'first' if attempt == 0 else 'repeat'}_{got}")
            if got != expect:
                self.count("feedback_unexpected")
        return conn

    def start(self, seconds):
        for _ in range(WORKERS):
            t = threading.Thread(target=self.worker, daemon=True)
            t.start()
            self.threads.append(t)
        self.sched = threading.Thread(target=self.scheduler, args=(seconds,), daemon=True)
        self.sched.start()

    def finish(self):
        """Waits for the schedule's end and every request in flight (bounded by the timeout)."""
        self.sched.join()
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join(CLIENT_TIMEOUT_S * 2 + 10)

    def take_window(self):
        with self.lock:
            w, self.window = self.window, []
            return w, dict(self.totals)


def write_configs(tmp, args, mock_port, gw_port, redis_port):
    profile = open(os.path.join(HERE, "mock.toml")).read()
    with open(os.path.join(tmp, "mock.toml"), "w") as f:
        f.write(profile)
    cfg = open(os.path.join(HERE, "equiroute.toml")).read()
    cfg = cfg.replace("@LISTEN@", f"127.0.0.1:{gw_port}").replace("@UPSTREAM@", f"127.0.0.1:{mock_port}")
    cfg = cfg.replace("@AUDIT@", os.path.join(tmp, "audit.jsonl"))
    if args.backend == "redis":
        state = f'[state]\nbackend = "redis"\nurl = "redis://127.0.0.1:{redis_port}/0"\nnamespace = "soak"\n'
    else:
        state = f'[state]\npath = "{os.path.join(tmp, "state.redb")}"\nsnapshot_interval_s = 5\n'
    cfg = cfg.replace("# @STATE@\n", state)
    path = os.path.join(tmp, "equiroute.toml")
    with open(path, "w") as f:
        f.write(cfg)
    return path


MIN_SAMPLES_FLAT = 9         # fewer samples (a run under 90 s): flatness is not judged


def thirds_check(samples, key):
    """(middle-third mean, last-third mean, flat?) over the samples."""
    vals = [s[key] for s in samples if s[key] is not None]
    if len(vals) < MIN_SAMPLES_FLAT:
        return None, None, True
    n = len(vals)
    mid = vals[n // 3: 2 * n // 3]
    last = vals[2 * n // 3:]
    m, l = sum(mid) / len(mid), sum(last) / len(last)
    return m, l, l <= m * (1 + FLAT_REL) + FLAT_ABS[key]


def slope_per_min(samples, key):
    """Least-squares slope of key over the second half of the run, per minute."""
    pts = [(s["t_s"], s[key]) for s in samples if s[key] is not None]
    pts = pts[len(pts) // 2:]
    if len(pts) < 2:
        return 0.0
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return 0.0 if den == 0 else 60 * sum((p[0] - mx) * (p[1] - my) for p in pts) / den


def svg_plot(samples, restarts, title, path):
    """Four stacked panels over time: RSS, descriptors, state size, latency p50/p99."""
    panels = [("gateway RSS (MiB)", [("rss_mib", "#1f77b4")]),
              ("open file descriptors", [("fds", "#2ca02c")]),
              ("state size (MiB)", [("state_mib", "#9467bd")]),
              ("chat latency of the window (ms): p50, p99", [("p50_ms", "#1f77b4"), ("p99_ms", "#d62728")])]
    W, PH, L, R, T = 760, 150, 70, 20, 40
    H = T + len(panels) * (PH + 40) + 30
    tmax = max([s["t_s"] for s in samples] + [SAMPLE_S])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           f'font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{W / 2}" y="22" font-size="14" text-anchor="middle">{title}</text>']
    for i, (label, series) in enumerate(panels):
        y0 = T + i * (PH + 40) + 15
        vals = [s[k] for k, _ in series for s in samples if s.get(k) is not None]
        vmax = max(vals + [1e-9]) * 1.15
        x = lambda t: L + (W - L - R) * t / tmax
        y = lambda v: y0 + PH - PH * v / vmax
        out.append(f'<text x="{L}" y="{y0 - 4}" font-size="12">{label}</text>')
        out.append(f'<rect x="{L}" y="{y0}" width="{W - L - R}" height="{PH}" fill="none" stroke="#999"/>')
        for k in range(5):
            v = vmax * k / 4
            out.append(f'<line x1="{L - 4}" x2="{L}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#999"/>'
                       f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
        for t in restarts:
            out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{y0}" y2="{y0 + PH}" stroke="#ff7f0e" stroke-dasharray="4 3"/>')
        for key, colour in series:
            pts = " ".join(f"{x(s['t_s']):.1f},{y(s[key]):.1f}" for s in samples if s.get(key) is not None)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        ticks = max(1, int(tmax // 60) // 10 + 1)
        for m in range(0, int(tmax // 60) + 1, ticks):
            out.append(f'<text x="{x(m * 60):.1f}" y="{y0 + PH + 14}" text-anchor="middle">{m} min</text>')
    if restarts:
        out.append(f'<text x="{L}" y="{H - 8}" fill="#ff7f0e">dashed: redis-server killed (restarted empty after the outage)</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--rate", type=float, default=40, help="chat requests per second (default 40)")
    ap.add_argument("--backend", choices=("file", "redis"), default="file")
    ap.add_argument("--redis-restarts", type=int, default=3, help="redis-server kills (backend redis)")
    ap.add_argument("--redis-outage", type=float, default=5, help="seconds Redis stays down each time")
    ap.add_argument("--seed", type=int, default=1, help="the load's random choices")
    ap.add_argument("--out", default=None, help="output directory (default target/soak-BACKEND)")
    ap.add_argument("--bin", default=os.environ.get("EQUIROUTE_BIN", os.path.join(ROOT, "target/release/equiroute")))
    args = ap.parse_args()
    if not (1 <= args.duration <= 24 * 3600):
        sys.exit("--duration: seconds from 1 to 86400")
    if not (0.1 <= args.rate <= 1000):
        sys.exit("--rate: requests per second from 0.1 to 1000")
    if not os.access(args.bin, os.X_OK):
        sys.exit(f"no binary at {args.bin}: cargo build --release -p equiroute (or EQUIROUTE_BIN)")
    redis_bin = shutil.which("redis-server")
    if args.backend == "redis" and not redis_bin:
        sys.exit("--backend redis needs redis-server on PATH (apt-get install redis-server)")
    out = args.out or os.path.join(ROOT, "target", f"soak-{args.backend}")
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    for f in os.listdir(logs):
        os.remove(os.path.join(logs, f))
    tmp = tempfile.mkdtemp(prefix="equiroute-soak-")
    procs = Procs(logs)
    mock_port, gw_port = free_port(), free_port()
    redis_port = free_port() if args.backend == "redis" else None
    if redis_port == 6379:
        redis_port = free_port()
    cfg = write_configs(tmp, args, mock_port, gw_port, redis_port)
    shutil.copy(cfg, os.path.join(out, "equiroute.toml"))
    shutil.copy(os.path.join(tmp, "mock.toml"), os.path.join(out, "mock.toml"))

    def redis_start():
        return procs.start("redis", [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--dir", tmp])

    samples, restarts, failures = [], [], []
    try:
        mock = procs.start("mock", [args.bin, "mock-upstream", "--listen", f"127.0.0.1:{mock_port}",
                                    "--profile", os.path.join(tmp, "mock.toml")])
        if not wait_http(mock_port, "/_stats", 15, mock):
            sys.exit(f"the mock upstream did not start: {logs}/mock.err.log")
        if redis_port:
            r = redis_start()
            end = time.time() + 10
            while redis_cmd(redis_port, "PING") is None and time.time() < end and r.poll() is None:
                time.sleep(0.1)
        check = subprocess.run([args.bin, "check-config", cfg], capture_output=True, text=True)
        if check.returncode != 0:
            sys.exit(f"check-config refused the soak config:\n{check.stdout}{check.stderr}")
        gw = procs.start("gateway", [args.bin, "serve", "--config", cfg])
        if not wait_http(gw_port, "/healthz", 30, gw):
            sys.exit(f"the gateway did not start: {logs}/gateway.err.log")
        print(f"soak: {args.duration:.0f} s at {args.rate:g} chat requests/s ({STREAM_SHARE:.0%} streamed), "
              f"backend {args.backend}, gateway pid {gw.pid} on 127.0.0.1:{gw_port}, mock on {mock_port}"
              + (f", redis on {redis_port}" if redis_port else "") + f"; out: {out}", flush=True)
        restart_at = []
        if redis_port and args.redis_restarts > 0:
            restart_at = [args.duration * (k + 1) / (args.redis_restarts + 1) for k in range(args.redis_restarts)]
        load = Load(gw_port, args.rate, args.seed)
        t0 = time.monotonic()
        load.start(args.duration)
        next_sample = SAMPLE_S
        redis_down_until = None
        header = (f"{'t':>5} {'RSS MiB':>8} {'fds':>5} {'state MiB':>9} {'p50 ms':>7} {'p99 ms':>7} "
                  f"{'ok':>5} {'broken':>6} {'4xx':>4} {'5xx':>4} {'xport':>5} {'fb acc/posted':>14}")
        print(header, flush=True)
        while True:
            now = time.monotonic() - t0
            if restart_at and now >= restart_at[0] and redis_down_until is None:
                restart_at.pop(0)
                procs.stop("redis", sig=signal.SIGKILL)
                restarts.append(round(now, 1))
                redis_down_until = now + args.redis_outage
                print(f"      redis-server killed at {now:.0f} s (back, empty, in {args.redis_outage:g} s)", flush=True)
            if redis_down_until is not None and now >= redis_down_until:
                redis_start()
                redis_down_until = None
            if now >= next_sample:
                if gw.poll() is not None:
                    failures.append(f"the gateway exited with status {gw.returncode} at {now:.0f} s")
                    break
                samples.append(take_sample(load, gw, gw_port, tmp, args, redis_port, next_sample))
                print_sample(samples[-1], flush=True)
                next_sample += SAMPLE_S
                if next_sample > args.duration + SAMPLE_S / 2:
                    break
            time.sleep(0.05)
        if redis_down_until is not None:
            redis_start()
        load.stop.set()
        load.finish()
        # The requests still in flight at the end are in the totals, not in a sample (the
        # clients have closed their connections by then).
        time.sleep(1)
        final_metrics = scrape(gw_port) if gw.poll() is None else {}
        with open(os.path.join(out, "metrics-final.txt"), "w") as f:
            f.write("\n".join(f"{k} {v:g}" for k, v in sorted(final_metrics.items())) + "\n")
        state_export = None
        rc = procs.stop("gateway", sig=signal.SIGTERM, wait_s=30)
        if rc != 0:
            failures.append(f"the gateway exited with status {rc} after SIGTERM (0 expected)")
        if args.backend == "file":
            exp = subprocess.run([args.bin, "state", "export", "--config", cfg], capture_output=True, text=True)
            if exp.returncode == 0:
                state_export = json.loads(exp.stdout)
            else:
                failures.append(f"state export failed: {exp.stderr.strip()}")
        _, totals = load.take_window()
        summary = summarise(args, samples, totals, final_metrics, state_export, restarts, logs, failures)
        summary["config"] = {"duration_s": args.duration, "rate": args.rate, "backend": args.backend,
                             "stream_share": STREAM_SHARE, "duplicate_share": DUPLICATE_SHARE,
                             "seed": args.seed, "workers": WORKERS, "redis_restarts": restarts,
                             "redis_outage_s": args.redis_outage if redis_port else None,
                             "binary": args.bin}
        write_outputs(out, args, samples, restarts, summary)
        return 0 if summary["passed"] else 1
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def take_sample(load, gw, gw_port, tmp, args, redis_port, t):
    window, totals = load.take_window()
    rss_kib, fds = proc_sample(gw.pid)
    if args.backend == "file":
        p = os.path.join(tmp, "state.redb")
        state = os.path.getsize(p) if os.path.exists(p) else 0
    else:
        info = redis_cmd(redis_port, "INFO", "memory") or ""
        m = re.search(r"used_memory:(\d+)", info)
        state = int(m.group(1)) if m else None
    try:
        metrics = scrape(gw_port)
    except (OSError, http.client.HTTPException):
        metrics = {}
    lat = [w[0] * 1000 for w in window]
    count = lambda o: sum(1 for w in window if w[2] == o)
    return {
        "t_s": round(t, 1),
        "rss_mib": round(rss_kib / 1024, 2),
        "fds": fds,
        "state_mib": None if state is None else round(state / 2**20, 3),
        "requests": len(window),
        "p50_ms": None if not lat else round(percentile(lat, 0.50), 1),
        "p99_ms": None if not lat else round(percentile(lat, 0.99), 1),
        "ok": count("ok"), "stream_broken": count("stream_broken"), "4xx": count("4xx"),
        "5xx": count("5xx"), "transport_error": count("transport_error"),
        "feedback_posted": totals.get("feedback_posted", 0),
        "feedback_accepted_client": totals.get("feedback_first_accepted", 0),
        "feedback_accepted_metric": metric_sum(metrics, "equiroute_feedback_total", outcome="accepted"),
        "redis_up": metric_sum(metrics, "equiroute_state_redis_up") if redis_port else None,
    }


def print_sample(s, flush=True):
    state = "-" if s["state_mib"] is None else f"{s['state_mib']:.2f}"
    p50 = "-" if s["p50_ms"] is None else f"{s['p50_ms']:.0f}"
    p99 = "-" if s["p99_ms"] is None else f"{s['p99_ms']:.0f}"
    print(f"{s['t_s']:>4.0f}s {s['rss_mib']:>8.1f} {s['fds']:>5} {state:>9} {p50:>7} {p99:>7} "
          f"{s['ok']:>5} {s['stream_broken']:>6} {s['4xx']:>4} {s['5xx']:>4} {s['transport_error']:>5} "
          f"{int(s['feedback_accepted_metric']):>6}/{s['feedback_posted']:<7}", flush=flush)


def summarise(args, samples, totals, metrics, export, restarts, logs, failures):
    checks = []

    def check(name, ok, detail):
        checks.append({"check": name, "passed": bool(ok), "detail": detail})

    panics = []
    for name in os.listdir(logs):
        with open(os.path.join(logs, name), errors="replace") as f:
            panics += [f"{name}: {l.strip()}" for l in f if "panicked" in l]
    check("no panic", not panics, "no 'panicked' line in any process's output" if not panics else "; ".join(panics[:3]))
    check("the gateway ran to the end and stopped cleanly", not failures, "; ".join(failures) or "exit status 0 after SIGTERM")
    posted = totals.get("feedback_posted", 0)
    acc_client = totals.get("feedback_first_accepted", 0)
    acc_metric = metric_sum(metrics, "equiroute_feedback_total", outcome="accepted")
    dup_posted = totals.get("feedback_repeat_posted", 0)
    dup_client = totals.get("feedback_repeat_duplicate", 0)
    dup_metric = metric_sum(metrics, "equiroute_feedback_total", outcome="duplicate")
    unknown = metric_sum(metrics, "equiroute_feedback_total", outcome="unknown")
    check("no lost feedback", posted > 0 and acc_client == posted and acc_metric == posted and unknown == 0,
          f"{posted} scores posted for answered requests, {acc_client} answered `accepted`, "
          f"equiroute_feedback_total{{outcome=accepted}} = {acc_metric:.0f}, unknown = {unknown:.0f}")
    check("no feedback counted twice", dup_client == dup_posted and dup_metric == dup_posted
          and totals.get("feedback_id_reused", 0) == 0,
          f"{dup_posted} scores posted a second time, {dup_client} answered `duplicate`, "
          f"equiroute_feedback_total{{outcome=duplicate}} = {dup_metric:.0f}")
    if export is not None:
        # Every accepted score is in the saved state once: the quality heads' observation counts.
        n = count_quality_observations(export)
        if n is not None:
            check("the saved state holds every accepted score once", n == acc_metric,
                  f"quality observations in `state export` = {n}, accepted = {acc_metric:.0f}")
    # Flatness: the last third of the samples against the middle third (the first third holds
    # the connection set-up and the bounded stores filling).
    flat = {}
    for key, label in (("rss_mib", "memory flat"), ("fds", "descriptors flat"), ("state_mib", "state size flat")):
        m, l, ok = thirds_check(samples, key)
        flat[key] = {"middle_third_mean": m, "last_third_mean": l, "flat": ok,
                     "slope_per_min_second_half": round(slope_per_min(samples, key), 4)}
        if m is not None:
            unit = {"rss_mib": " MiB", "fds": "", "state_mib": " MiB"}[key]
            check(label, ok, f"last third mean {l:.2f}{unit} vs middle third {m:.2f}{unit} "
                  f"(allowed: +{FLAT_REL:.0%} + {FLAT_ABS[key]:g}{unit}); second-half slope "
                  f"{flat[key]['slope_per_min_second_half']:+.3f}{unit}/min")
        else:
            checks.append({"check": label, "passed": True,
                           "detail": f"not judged: fewer than {MIN_SAMPLES_FLAT} samples (a run under 90 s)"})
    lat = [s["p99_ms"] for s in samples if s["p99_ms"] is not None]
    chat_total = sum(v for k, v in totals.items() if k.startswith("chat_"))
    summary = {
        "passed": all(c["passed"] for c in checks),
        "checks": checks,
        "totals": totals,
        "chat_requests": chat_total,
        "flatness": flat,
        "peak_rss_mib": max((s["rss_mib"] for s in samples), default=None),
        "peak_fds": max((s["fds"] for s in samples), default=None),
        "final_state_mib": samples[-1]["state_mib"] if samples else None,
        "window_p99_ms": {"min": min(lat, default=None), "median": percentile(lat, 0.5), "max": max(lat, default=None)},
        "metrics": {k: v for k, v in metrics.items() if k.startswith(("equiroute_requests_total", "equiroute_attempts_total",
                                                                         "equiroute_feedback_total", "equiroute_fallbacks_total",
                                                                         "equiroute_breaker_transitions_total", "equiroute_state_"))},
    }
    return summary


def count_quality_observations(export):
    """Sum of the quality heads' observation counts (`heads.heads[i].count`, one head per
    provider) in a state export, or None when the export holds no heads."""
    total, found = 0, False

    def walk(node):
        nonlocal total, found
        if isinstance(node, dict):
            heads = node.get("heads")
            if isinstance(heads, dict) and isinstance(heads.get("heads"), list):
                for h in heads["heads"]:
                    if isinstance(h, dict) and isinstance(h.get("count"), int):
                        total += h["count"]
                        found = True
            for k, v in node.items():
                if k != "heads":
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(export)
    return total if found else None


def write_outputs(out, args, samples, restarts, summary):
    keys = list(samples[0].keys()) if samples else []
    with open(os.path.join(out, "samples.csv"), "w") as f:
        f.write(",".join(keys) + "\n")
        for s in samples:
            f.write(",".join("" if s[k] is None else str(s[k]) for k in keys) + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"summary": summary, "samples": samples}, f, indent=1)
    title = (f"Equiroute soak: {args.duration / 60:.0f} min at {args.rate:g} chat req/s, every upstream fault "
             f"at random, backend {args.backend}")
    svg_plot(samples, restarts, title, os.path.join(out, f"soak-{args.backend}.svg"))
    t = summary["totals"]
    lines = [f"# Soak: {args.duration:.0f} s, {args.rate:g} chat requests/s, backend {args.backend}", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'pass' if c['passed'] else 'FAIL'} | {c['detail']} |" for c in summary["checks"]]
    lines += ["", "| measure | value |", "|---|---|",
              f"| chat requests | {summary['chat_requests']} (ok {t.get('chat_ok', 0)}, stream broken {t.get('chat_stream_broken', 0)}, "
              f"4xx {t.get('chat_4xx', 0)}, 5xx {t.get('chat_5xx', 0)}, transport errors {t.get('chat_transport_error', 0)}, "
              f"dropped by the client {t.get('dropped_by_client', 0)}) |",
              f"| feedback posted / accepted | {t.get('feedback_posted', 0)} / {t.get('feedback_first_accepted', 0)} |",
              f"| peak RSS | {summary['peak_rss_mib']} MiB |",
              f"| peak open descriptors | {summary['peak_fds']} |",
              f"| final state size | {summary['final_state_mib']} MiB |",
              f"| p99 of the 10 s windows | min {summary['window_p99_ms']['min']} ms, median {summary['window_p99_ms']['median']} ms, max {summary['window_p99_ms']['max']} ms |"]
    if restarts:
        lines.append(f"| redis-server killed at | {', '.join(f'{r:.0f} s' for r in restarts)} |")
    lines.append("")
    lines.append("RESULT: " + ("PASS" if summary["passed"] else "FAIL"))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print()
    print(text)
    print(f"written: {out}/samples.csv, summary.json, summary.md, soak-{args.backend}.svg, logs/")


if __name__ == "__main__":
    sys.exit(main())
