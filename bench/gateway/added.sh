#!/usr/bin/env bash
# What the gateway adds to the latency at a fixed rate (issue 45's bar 3: 5,000 requests/s
# against the 20 ms mocks, added p99 <= 1 ms): three 20 ms mocks and the gateway with
# bench/gateway/equiroute.toml, then, alternating, the first mock directly and the gateway at
# the same rate (oha -q RATE, latency correction on, so that a stall counts against the
# requests it delayed; the requests in flight at the end are waited for), each after a 3 s
# warm-up. Prints one row per point and the added p50 and p99 (gateway minus direct, in the
# same round). With --nginx, nginx (bench/gateway/nginx.conf, a worker per core) in front of the
# same mocks is measured in each round as well: what a plain reverse proxy adds on this machine
# at this rate, the control for the gateway's number. With --isolate the gateway (and nginx)
# run alone on the last CPU, oha and the mocks on the others.
# See bench/gateway/README.md ("Added latency at a fixed rate").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"

usage() {
    cat <<USAGE
Usage: bench/gateway/added.sh [options] BIN

  --rate R          requests per second (default: 5000)
  --rounds N        rounds of direct then gateway (default: 2)
  --seconds S       seconds measured per point (default: 15), after a 3 s warm-up
  --concurrency C   oha's connections (default: 256)
  --nginx           also measure nginx in front of the same mocks in each round (the control)
  --isolate         the gateway and nginx on the last CPU alone, oha and the mocks on the
                    others (taskset): the proxies' share without the load's preemptions

Environment: OHA_BIN (default: oha on PATH, then ~/.cargo/bin/oha), NGINX_BIN (default: nginx
on PATH, then /usr/sbin/nginx), BENCH_PORT_BASE (first of 5 loopback ports, default: 19500).
USAGE
}

RATE=5000
ROUNDS=2
SECONDS_PER_POINT=15
CONCURRENCY=256
NGINX=""
ISOLATE=""
BINS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rate) RATE="${2:?--rate needs a number}"; shift ;;
        --rounds) ROUNDS="${2:?--rounds needs a number}"; shift ;;
        --seconds) SECONDS_PER_POINT="${2:?--seconds needs a number}"; shift ;;
        --concurrency) CONCURRENCY="${2:?--concurrency needs a number}"; shift ;;
        --nginx) NGINX=$(find_nginx); [ -n "$NGINX" ] || { echo "--nginx: nginx not found (apt-get install -y nginx-light, or NGINX_BIN)" >&2; exit 2; } ;;
        --isolate) ISOLATE=1 ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) BINS+=("$1") ;;
    esac
    shift
done
[ "${#BINS[@]}" -eq 1 ] || { echo "added.sh needs one binary" >&2; usage >&2; exit 2; }
check_binaries "${BINS[@]}"
check_positive RATE ROUNDS SECONDS_PER_POINT CONCURRENCY
find_oha
BASE="${BENCH_PORT_BASE:-19500}"
BIN=${BINS[0]}
PIN=()
[ -z "$ISOLATE" ] || isolate_last_cpu

start_work
echo '{"model": "chat", "messages": [{"role": "user", "content": "hello"}]}' >"$WORK/body.json"
write_config "$BASE" "$WORK/equiroute.toml"
start_mocks "$BIN" mock-20ms.toml
"${PIN[@]}" "$BIN" serve --config "$WORK/equiroute.toml" >"$WORK/serve.log" 2>&1 &
PIDS+=($!)
for i in 0 1 2 3; do wait_port $((BASE + i)); done
TARGETS="direct gateway"
if [ -n "$NGINX" ]; then
    mkdir -p "$WORK/nginx"
    write_config "$BASE" "$WORK/nginx/nginx.conf" nginx.conf $((BASE + 4)) "$WORK/nginx"
    "${PIN[@]}" "$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" >"$WORK/nginx.log" 2>&1 &
    PIDS+=($!)
    wait_port $((BASE + 4))
    TARGETS="direct gateway nginx"
fi

point() { # URL OUT
    local load=("$OHA" --no-tui -m POST -H content-type:application/json -D "$WORK/body.json"
        -c "$CONCURRENCY" -q "$RATE" --latency-correction -w)
    "${load[@]}" -z 3s "$1" >/dev/null
    "${load[@]}" -z "${SECONDS_PER_POINT}s" --output-format json "$1" >"$2"
}

echo "added.sh: $RATE requests/s, c=$CONCURRENCY, ${SECONDS_PER_POINT} s points, 20 ms mocks, $BIN${NGINX:+, and $NGINX}${ISOLATE:+, the proxies alone on CPU $LAST_CPU}"
echo
echo "| round | target | requests/s | p50 ms | p99 ms | p99.9 ms | non-200 | added p50 ms | added p99 ms |"
echo "|---|---|---|---|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
    point "http://127.0.0.1:$((BASE + 1))/v1/chat/completions" "$WORK/direct.json"
    point "http://127.0.0.1:$BASE/v1/chat/completions" "$WORK/gateway.json"
    if [ -n "$NGINX" ]; then
        point "http://127.0.0.1:$((BASE + 4))/v1/chat/completions" "$WORK/nginx.json"
    fi
    python3 - "$WORK" "$r" $TARGETS <<'PY'
import json, sys
work, r, targets = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = {}
for target in targets:
    d = json.load(open(f"{work}/{target}.json"))
    p = d["latencyPercentiles"]
    codes = d["statusCodeDistribution"]
    other = sum(n for c, n in codes.items() if c != "200") + sum(d.get("errorDistribution", {}).values())
    rows[target] = (d["summary"]["requestsPerSec"], p["p50"] * 1e3, p["p99"] * 1e3, p["p99.9"] * 1e3, other)
for target, (rps, p50, p99, p999, other) in rows.items():
    added = ""
    if target != "direct":
        added = f" {p50 - rows['direct'][1]:+.2f} | {p99 - rows['direct'][2]:+.2f} |"
    else:
        added = " | |"
    print(f"| {r} | {target} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {p999:.2f} | {other} |{added}")
PY
done
