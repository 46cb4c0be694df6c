#!/usr/bin/env bash
# What callgrind does not count: the kernel's share of a request. Per binary, the gateway
# runs natively with bench/gateway/equiroute.toml against three 0 ms mocks (from the first
# binary); after a warm-up, `perf stat -p` counts the gateway's system calls (all of them, and
# the ones a request's path makes, by name), context switches (and among them the ones that
# preempted a gateway thread still runnable), CPU migrations, page faults and CPU time while oha
# sends --requests requests at concurrency --concurrency, and the router's share
# (`equiroute_router_microseconds`) of the same requests from /metrics. Prints them per request,
# one row per binary and round; rounds alternate the binaries, as pair.sh does.
# Needs perf (Debian's linux-perf) with the raw_syscalls, syscalls and sched tracepoints readable
# (`perf stat -e raw_syscalls:sys_enter true` tells); hardware counters are not needed.
# See bench/gateway/README.md ("System calls and wake-ups per request").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"

usage() {
    cat <<USAGE
Usage: bench/gateway/kernel.sh [options] BIN [BIN ...]

  --requests N      requests counted per binary and round (default: 20000), after 2000 warm-up
  --concurrency C   oha's concurrency (default: 16)
  --rounds R        rounds, each binary once per round (default: 1)
  --rate R          send at R requests/s (oha -q) instead of as fast as C connections can:
                    what a request costs when the gateway idles between requests
  --isolate         the gateway on the last CPU alone, oha and the mocks on the others
                    (taskset): what the benchmark's own processes add when they share its cores

Environment: OHA_BIN (default: oha on PATH, then ~/.cargo/bin/oha), BENCH_PORT_BASE (first of
4 loopback ports, default: 19300).
USAGE
}

REQUESTS=20000
CONCURRENCY=16
ROUNDS=1
RATE=""
ISOLATE=""
BINS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --requests) REQUESTS="${2:?--requests needs a number}"; shift ;;
        --concurrency) CONCURRENCY="${2:?--concurrency needs a number}"; shift ;;
        --rounds) ROUNDS="${2:?--rounds needs a number}"; shift ;;
        --rate) RATE="${2:?--rate needs a number}"; shift ;;
        --isolate) ISOLATE=1 ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) BINS+=("$1") ;;
    esac
    shift
done
[ "${#BINS[@]}" -ge 1 ] || { echo "kernel.sh needs at least one binary" >&2; usage >&2; exit 2; }
check_binaries "${BINS[@]}"
check_positive REQUESTS CONCURRENCY ROUNDS
PACE=()
if [ -n "$RATE" ]; then
    check_positive RATE
    PACE=(-q "$RATE")
fi
if ! command -v perf >/dev/null; then
    echo "perf is missing: apt-get install linux-perf" >&2
    exit 2
fi
if ! perf stat -e raw_syscalls:sys_enter true >/dev/null 2>&1; then
    echo "perf cannot read the raw_syscalls tracepoints here (run as root, or lower" \
        "/proc/sys/kernel/perf_event_paranoid)" >&2
    exit 2
fi
find_oha
BASE="${BENCH_PORT_BASE:-19300}"
PIN=()
[ -z "$ISOLATE" ] || isolate_last_cpu

# The system calls a request's path makes, counted by name besides all of them
# (raw_syscalls:sys_enter).
CALLS=(epoll_wait futex writev write sendto recvfrom read accept4 close)
EVENTS="raw_syscalls:sys_enter,context-switches,cpu-migrations,task-clock"
for c in "${CALLS[@]}"; do EVENTS="$EVENTS,syscalls:sys_enter_$c"; done
EVENTS="$EVENTS,page-faults"
# The switches away from a gateway thread that could still run (prev_state 0: preempted).
PREEMPTED=(-e sched:sched_switch --filter "prev_state == 0")

start_work
start_instant_upstreams "${BINS[0]}"

echo "kernel.sh: $REQUESTS requests at c=$CONCURRENCY${RATE:+, $RATE requests/s,} after 2000 warm-up, 0 ms mocks, perf stat -p on the gateway${ISOLATE:+, the gateway alone on CPU $LAST_CPU}"
echo
header="| round | binary | requests/s | CPU µs/request | user µs | kernel µs | router share: mean µs, ≤ 10 µs, p99 bucket | syscalls | context switches | preempted | migrations | page faults"
rule="|---|---|---|---|---|---|---|---|---|---|---|---"
for c in "${CALLS[@]}"; do
    header="$header | $c"
    rule="$rule|---"
done
echo "$header | (per request)"
echo "$rule|"
for round in $(seq "$ROUNDS"); do
    n=0
    for bin in "${BINS[@]}"; do
        n=$((n + 1))
        "${PIN[@]}" "$bin" serve --config "$WORK/equiroute.toml" >"$WORK/serve$n.log" 2>&1 &
        gw=$!
        PIDS+=("$gw")
        wait_port "$BASE" 200
        send 2000 >/dev/null
        perf stat -x, -e "$EVENTS" "${PREEMPTED[@]}" -p "$gw" -o "$WORK/perf$n.csv" &
        perf=$!
        sleep 0.5 # perf attaches to every thread before the load starts
        before=$(cut -d' ' -f14,15 "/proc/$gw/stat")
        curl -sf "http://127.0.0.1:$BASE/metrics" >"$WORK/metrics$n.before"
        send "$REQUESTS" "${PACE[@]}" --output-format json >"$WORK/oha$n.json"
        after=$(cut -d' ' -f14,15 "/proc/$gw/stat")
        curl -sf "http://127.0.0.1:$BASE/metrics" >"$WORK/metrics$n.after"
        kill -INT "$perf"
        wait "$perf" 2>/dev/null || true
        kill "$gw"
        wait "$gw" 2>/dev/null || true
        python3 - "$HERE" "$WORK/perf$n.csv" "$WORK/oha$n.json" "$REQUESTS" "$round" "$bin" "$before" "$after" "$(getconf CLK_TCK)" "$WORK/metrics$n" "${CALLS[@]}" <<'PY'
import csv, sys
sys.path.insert(0, sys.argv[1])
from report import bucket_quantile, histogram_delta, point  # the full run's parsers
path, oha, n, rnd, bin_ = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
(u0, s0), (u1, s1), tck = map(int, sys.argv[7].split()), map(int, sys.argv[8].split()), int(sys.argv[9])
metrics = sys.argv[10]
calls = sys.argv[11:]
counts = {}
for row in csv.reader(l for l in open(path) if l.strip() and not l.startswith("#")):
    try:
        # The filtered sched_switch (the preempted ones) is the only one of its name.
        counts[row[2]] = float(row[0])
    except (ValueError, IndexError):
        pass  # "<not counted>" or a short line
# The router share of the measured requests: the histogram after minus before.
buckets, total, count = histogram_delta(*(open(metrics + s).read() for s in (".before", ".after")),
                                        "equiroute_router_microseconds")
if count:
    p99 = bucket_quantile(buckets, count, 0.99)
    router = f"{total / count:.2f}, {buckets.get(10.0, 0) / count:.1%}, ≤ {p99:g}"
else:
    router = "–"

o = point(oha)
if o["errors"]:
    print(f"warning: {bin_} failed {o['errors']} of {o['requests']} requests", file=sys.stderr)
rps = o["rps"]
per = lambda k: counts.get(k, float("nan")) / n
cells = [f"{rps:,.0f}", f"{counts.get('task-clock', float('nan')) * 1e3 / n:.1f}",
         f"{(u1 - u0) / tck * 1e6 / n:.1f}", f"{(s1 - s0) / tck * 1e6 / n:.1f}", router,
         f"{per('raw_syscalls:sys_enter'):.2f}", f"{per('context-switches'):.2f}",
         f"{per('sched:sched_switch'):.2f}", f"{per('cpu-migrations'):.3f}", f"{per('page-faults'):.3f}"]
cells += [f"{per('syscalls:sys_enter_' + c):.2f}" for c in calls]
print(f"| {rnd} | {bin_} | " + " | ".join(cells) + " |")
PY
    done
done
echo
echo "CPU µs/request: the gateway's task-clock (every thread) over the requests; the warm-up is not"
echo "counted. User and kernel µs: /proc/PID/stat's utime and stime over the same requests (clock"
echo "ticks: coarse below some 10,000 requests). System calls: the gateway's, its upstream reads and"
echo "writes included, not the mocks' own. Preempted: the context switches away from a gateway"
echo "thread that could still run (sched_switch with prev_state 0), most of them to oha's and the"
echo "mocks' threads when they share the gateway's cores. Router share: equiroute_router_microseconds"
echo "over the same requests (/metrics before and after; the p99 is a bucket's upper bound)."
