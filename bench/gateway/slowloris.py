#!/usr/bin/env python3
"""One client cannot starve the rest: the load test of issue 41's bar 4.

Drives a running `equiroute serve` (started by slowloris.sh) on loopback:

- the normal client, 127.0.0.1, sends chat requests at a fixed rate from start to end, each
  on a new connection (so that it has to be admitted while the attack holds connections);
- the attacker, 127.0.0.2 (a separate process, so that its work does not delay the normal
  client's measurements), holds ATTACK_CONNECTIONS connections, each sending the headers of
  a 1 MiB body and most of the body, then stalling; a connection the gateway closes is opened
  again a second later (as `Retry-After: 1` says), until the attack ends and all are closed;
- the gateway's RSS is sampled from /proc every 50 ms.

Phases: PRE seconds of normal traffic (the pre-attack RSS is the median of the last second),
ATTACK seconds of attack, AFTER seconds after the attacker has closed everything. Prints a
table with the bars and exits 1 if one is missed. Bounded: at most ATTACK_CONNECTIONS + the
normal client's few connections, loopback only, about PRE + ATTACK + AFTER seconds.
"""

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import threading
import time

BODY_BYTES = 1 << 20  # the declared body: 1 MiB, the default server.max_body_bytes
SENT_BYTES = 1_000_000  # what arrives of it before the stall
CHUNK = b" " * 65536


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssSampler(threading.Thread):
    def __init__(self, pid, every=0.05):
        super().__init__(daemon=True)
        self.pid, self.every, self.samples, self.stop = pid, every, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), rss_bytes(self.pid)))
            time.sleep(self.every)

    def between(self, start, end):
        return [r for t, r in self.samples if start <= t <= end]


async def attacker_connection(host, port, stop, counts):
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {BODY_BYTES}\r\n\r\n"
    ).encode()
    while not stop.is_set():
        writer = None
        try:
            reader, writer = await asyncio.open_connection(
                host, port, local_addr=("127.0.0.2", 0)
            )
            counts["opened"] += 1
            writer.write(head)
            sent = 0
            while sent < SENT_BYTES and not stop.is_set():
                n = min(len(CHUNK), SENT_BYTES - sent)
                writer.write(CHUNK[:n])
                await writer.drain()
                sent += n
            # Stalled: wait for the gateway to answer or close (or the attack to end).
            closed = asyncio.ensure_future(reader.read(65536))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({closed, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if closed.done() and not closed.cancelled():
                status = closed.result()[9:12].decode(errors="replace") or "closed"
                counts[status] = counts.get(status, 0) + 1
            else:
                closed.cancel()
        except (ConnectionError, OSError):
            counts["reset"] = counts.get("reset", 0) + 1
        finally:
            if writer is not None:
                writer.close()
        if not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


def attacker(host, port, connections, seconds, done):
    async def main():
        stop = asyncio.Event()
        counts = {"opened": 0}
        tasks = [
            asyncio.ensure_future(attacker_connection(host, port, stop, counts))
            for _ in range(connections)
        ]
        await asyncio.sleep(seconds)
        stop.set()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        return counts

    done.put(asyncio.run(main()))


async def normal_request(host, port, body):
    started = time.monotonic()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\nconnection: close\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, local_addr=("127.0.0.1", 0)), 5
        )
        writer.write(request)
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        status = int(raw[9:12]) if raw.startswith(b"HTTP/1.1 ") else 0
    except (ConnectionError, OSError, asyncio.TimeoutError, ValueError):
        status = 0
    return started, time.monotonic() - started, status


async def normal_client(host, port, rate, seconds):
    body = json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
    ).encode()
    results, pending = [], set()
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        pending.add(asyncio.ensure_future(normal_request(host, port, body)))
        n += 1
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        done = {p for p in pending if p.done()}
        results += [p.result() for p in done]
        pending -= done
    if pending:
        results += await asyncio.gather(*pending)
    return results


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pid", type=int, required=True, help="the gateway's pid, for its RSS")
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--rate", type=float, default=100.0, help="normal requests per second")
    p.add_argument("--pre", type=float, default=5.0)
    p.add_argument("--attack", type=float, default=15.0)
    p.add_argument("--after", type=float, default=30.0)
    p.add_argument("--json", help="write the numbers here too")
    a = p.parse_args()
    host = "127.0.0.1"

    sampler = RssSampler(a.pid)
    sampler.start()
    t0 = time.monotonic()
    attack_start, attack_end = t0 + a.pre, t0 + a.pre + a.attack
    done = multiprocessing.Queue()

    def launch():
        delay = attack_start - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        proc = multiprocessing.Process(
            target=attacker, args=(host, a.port, a.connections, a.attack, done)
        )
        proc.start()
        return proc

    holder = {}
    launcher = threading.Thread(target=lambda: holder.update(proc=launch()), daemon=True)
    launcher.start()
    results = asyncio.run(normal_client(host, a.port, a.rate, a.pre + a.attack + a.after))
    launcher.join()
    counts = done.get(timeout=30)
    holder["proc"].join(timeout=10)
    sampler.stop.set()
    sampler.join()

    during = [r for r in results if attack_start <= r[0] <= attack_end]
    ok = [r for r in during if r[2] == 200]
    success = len(ok) / len(during) if during else 0.0
    p50 = percentile([r[1] for r in ok], 0.50) * 1000
    p99 = percentile([r[1] for r in ok], 0.99) * 1000
    pre_rss = statistics.median(sampler.between(attack_start - 1.0, attack_start))
    peak = max(sampler.between(attack_start, attack_end + 2.0))
    last_t, last_rss = sampler.samples[-1]
    after_s = last_t - attack_end
    statuses = {}
    for r in during:
        statuses[r[2]] = statuses.get(r[2], 0) + 1

    mib = 1 << 20
    rows = [
        ("normal client (127.0.0.1) success during the attack",
         f"{success * 100:.2f} % ({len(ok)}/{len(during)})", ">= 99 %", success >= 0.99),
        ("normal client p50", f"{p50:.1f} ms", "", None),
        ("normal client p99", f"{p99:.1f} ms", "< 100 ms", p99 < 100),
        ("gateway RSS before the attack", f"{pre_rss / mib:.1f} MiB", "", None),
        ("gateway RSS peak during the attack", f"{peak / mib:.1f} MiB", "<= 256 MiB", peak <= 256 * mib),
        (f"gateway RSS {after_s:.0f} s after the attack", f"{last_rss / mib:.1f} MiB",
         f"<= {pre_rss * 1.2 / mib:.1f} MiB (pre + 20 %)", last_rss <= pre_rss * 1.2),
    ]
    print()
    print(f"attacker (127.0.0.2): {a.connections} connections, {a.attack:.0f} s, "
          f"{SENT_BYTES} of {BODY_BYTES} body bytes each then a stall; reconnects after 1 s")
    print(f"attacker's connections: {json.dumps(counts, sort_keys=True)}")
    print(f"normal client's statuses during the attack: {json.dumps(statuses, sort_keys=True)}")
    print()
    print(f"| {'measure':<52} | {'value':<22} | {'bar':<28} | ok   |")
    print(f"|{'-' * 54}|{'-' * 24}|{'-' * 30}|------|")
    for name, value, bar, passed in rows:
        mark = "" if passed is None else ("yes" if passed else "NO")
        print(f"| {name:<52} | {value:<22} | {bar:<28} | {mark:<4} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({
                "success": success, "requests_during_attack": len(during),
                "p50_ms": p50, "p99_ms": p99, "rss_pre": pre_rss, "rss_peak": peak,
                "rss_after": last_rss, "after_s": after_s, "attacker": counts,
                "statuses": statuses, "rss_samples": sampler.samples,
            }, f)
    sys.exit(0 if all(r[3] is not False for r in rows) else 1)


if __name__ == "__main__":
    main()
