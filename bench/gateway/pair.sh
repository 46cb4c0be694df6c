#!/usr/bin/env bash
# Two equiroute binaries on one load point, alternating: A, B, A, B, ... in the same minutes, so
# that the machine's drift (which on a shared VM moves the router share by more than most
# changes do) falls on both alike. Each round starts three 0 ms mocks (always A's: the mocks
# share the machine, and another build's mocks cost another CPU time) and the gateway with
# bench/gateway/equiroute.toml, warms up, then measures with oha and differences the
# gateway's `equiroute_router_microseconds` histogram scraped before and after, and the gateway
# process's CPU time (user + system, /proc/PID/stat) over the measured seconds.
# See bench/gateway/README.md ("Comparing two builds").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"

usage() {
    cat <<EOF
Usage: bench/gateway/pair.sh [options] BIN_A BIN_B

  --rounds N        rounds of A then B (default: 3)
  --seconds S       seconds measured per point (default: 10), after a 3 s warm-up
  --concurrency C   oha's concurrency (default: 64)
  --words W         words in the request's user message (default: 1, the benchmark's "hello";
                    W > 1 repeats an 11-word sentence)

Environment: OHA_BIN (default: oha on PATH, then ~/.cargo/bin/oha), BENCH_PORT_BASE (first of
4 loopback ports, default: 19100).
EOF
}

ROUNDS=3
SECONDS_PER_POINT=10
CONCURRENCY=64
WORDS=1
BINS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS="${2:?--rounds needs a number}"; shift ;;
        --seconds) SECONDS_PER_POINT="${2:?--seconds needs a number}"; shift ;;
        --concurrency) CONCURRENCY="${2:?--concurrency needs a number}"; shift ;;
        --words) WORDS="${2:?--words needs a number}"; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) BINS+=("$1") ;;
    esac
    shift
done
if [ "${#BINS[@]}" -ne 2 ]; then
    echo "pair.sh needs two binaries, BIN_A and BIN_B" >&2
    usage >&2
    exit 2
fi
check_binaries "${BINS[@]}"
check_positive ROUNDS SECONDS_PER_POINT CONCURRENCY WORDS
find_oha
BASE="${BENCH_PORT_BASE:-19100}"

start_work

python3 - "$WORDS" >"$WORK/body.json" <<'PY'
import json, sys
words = int(sys.argv[1])
sentence = "Which of these retrieval providers answers questions about Rust lifetimes best?".split()
text = "hello" if words == 1 else " ".join((sentence * (words // len(sentence) + 1))[:words])
print(json.dumps({"model": "chat", "messages": [{"role": "user", "content": text}]}))
PY
write_config "$BASE" "$WORK/equiroute.toml"
URL="http://127.0.0.1:$BASE/v1/chat/completions"

scrape() {
    curl -sf "http://127.0.0.1:$BASE/metrics" | grep '^equiroute_router_microseconds' >"$1"
}

point() { # BIN LABEL
    PIDS=()
    start_mocks "${BINS[0]}" mock-0ms.toml
    "$1" serve --config "$WORK/equiroute.toml" >"$WORK/serve.log" 2>&1 &
    PIDS+=($!)
    for i in 0 1 2 3; do wait_port $((BASE + i)); done
    local load=("$OHA" --no-tui -m POST -H content-type:application/json -D "$WORK/body.json" -c "$CONCURRENCY")
    "${load[@]}" -z 3s "$URL" >/dev/null
    local gw="${PIDS[3]}" cpu_before cpu_after
    scrape "$WORK/before"
    cpu_before=$(proc_ticks "$gw")
    "${load[@]}" -z "${SECONDS_PER_POINT}s" --output-format json "$URL" >"$WORK/oha.json"
    cpu_after=$(proc_ticks "$gw")
    scrape "$WORK/after"
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
    python3 - "$HERE" "$WORK" "$2" "$((cpu_after - cpu_before))" "$(getconf CLK_TCK)" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from report import bucket_quantile, histogram_delta, point  # the full run's parsers
work, label = sys.argv[2], sys.argv[3]
# The measured seconds alone: the scrape after minus the one before (warm-up excluded).
buckets, total, count = histogram_delta(*(open(f"{work}/{w}").read() for w in ("before", "after")),
                                        "equiroute_router_microseconds")
q = lambda p: f"{bucket_quantile(buckets, count, p):g}"  # noqa: E731
oha = point(work + "/oha.json")
# The gateway's user + system CPU over the measured seconds, per request answered then.
cpu_us = int(sys.argv[4]) / int(sys.argv[5]) * 1e6 / max(oha["requests"], 1)
row = (f"| {label} | {oha['rps']:,.0f} | {cpu_us:.0f} | {total / count:.1f} | "
       f"{100 * buckets.get(10.0, 0) / count:.1f}% | ≤ {q(0.5)} | ≤ {q(0.99)} |")
print(row)
with open(f"{work}/rows", "a") as rows:  # for the summary after the last round
    rows.write(row + "\n")
PY
}

echo "pair.sh: $ROUNDS rounds, c=$CONCURRENCY, ${SECONDS_PER_POINT} s points, a ${WORDS}-word prompt, 0 ms mocks"
echo "A = ${BINS[0]}"
echo "B = ${BINS[1]}"
echo "mocks: A's, for both"
echo
echo "| round | requests/s | gateway CPU µs/request | router share mean µs | share ≤ 10 µs | p50 bucket µs | p99 bucket µs |"
echo "|---|---|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
    point "${BINS[0]}" "$r A"
    point "${BINS[1]}" "$r B"
done
echo
python3 - "$HERE" "$WORK/rows" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from report import paired_summary
print(paired_summary(open(sys.argv[2]).read()))
PY
