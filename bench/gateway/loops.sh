#!/usr/bin/env bash
# One event loop against two, per policy: what the second loop costs a request. Each round
# runs, for each policy, the gateway with bench/gateway/equiroute.toml (its policy replaced)
# with `server.worker_threads = 1`, then with 2, against three 0 ms mocks, and measures
# requests/s (oha, c = 64) and the gateway process's CPU time per request (user + system,
# /proc/PID/stat) over the measured seconds. A policy that keeps no learning state
# (`static`) is the control: what two loops cost without the learning they share.
# Prints one row per point, then per policy the medians and the median of the rounds' paired
# differences (two loops minus one). See bench/gateway/README.md ("One loop or two").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"

usage() {
    cat <<USAGE
Usage: bench/gateway/loops.sh [options] BIN

  --rounds N        rounds (default: 4), each policy with one loop then two
  --seconds S       seconds measured per point (default: 10), after a 3 s warm-up
  --policies LIST   comma-separated policy names (default: lqm-ts,static)

Environment: OHA_BIN (default: oha on PATH, then ~/.cargo/bin/oha), BENCH_PORT_BASE (first of
4 loopback ports, default: 19700).
USAGE
}

ROUNDS=4
SECONDS_PER_POINT=10
POLICIES=lqm-ts,static
BINS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS="${2:?--rounds needs a number}"; shift ;;
        --seconds) SECONDS_PER_POINT="${2:?--seconds needs a number}"; shift ;;
        --policies) POLICIES="${2:?--policies needs a list}"; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) BINS+=("$1") ;;
    esac
    shift
done
[ "${#BINS[@]}" -eq 1 ] || { echo "loops.sh needs one binary" >&2; usage >&2; exit 2; }
check_binaries "${BINS[@]}"
check_positive ROUNDS SECONDS_PER_POINT
find_oha
BASE="${BENCH_PORT_BASE:-19700}"
BIN=${BINS[0]}

start_work
start_instant_upstreams "$BIN"
IFS=, read -r -a POLICY_LIST <<<"$POLICIES"
for p in "${POLICY_LIST[@]}"; do
    [[ "$p" =~ ^[a-z0-9-]+$ ]] || { echo "--policies: '$p' is not a policy name" >&2; exit 2; }
    for t in 1 2; do
        sed -e "s|^listen = .*|&\nworker_threads = $t|" -e "s|^policy = .*|policy = { name = \"$p\" }|" \
            "$WORK/equiroute.toml" >"$WORK/$p-$t.toml"
        "$BIN" check-config "$WORK/$p-$t.toml" >"$WORK/check.log" 2>&1 \
            || { echo "--policies: the gateway refused '$p':" >&2; cat "$WORK/check.log" >&2; exit 2; }
    done
done

point() { # POLICY LOOPS ROUND
    "$BIN" serve --config "$WORK/$1-$2.toml" >"$WORK/serve.log" 2>&1 &
    local gw=$!
    wait_port "$BASE"
    local load=("$OHA" --no-tui -m POST -H content-type:application/json -D "$WORK/body.json" -c 64)
    "${load[@]}" -z 3s "$URL" >/dev/null
    local before after
    before=$(proc_ticks "$gw")
    "${load[@]}" -z "${SECONDS_PER_POINT}s" --output-format json "$URL" >"$WORK/oha.json"
    after=$(proc_ticks "$gw")
    kill "$gw" 2>/dev/null || true
    wait "$gw" 2>/dev/null || true
    python3 - "$HERE" "$WORK" "$1" "$2" "$3" "$((after - before))" "$(getconf CLK_TCK)" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from report import point
work, policy, loops, r = sys.argv[2:6]
oha = point(work + "/oha.json")
cpu_us = int(sys.argv[6]) / int(sys.argv[7]) * 1e6 / max(oha["requests"], 1)
print(f"| {r} | {policy} | {loops} | {oha['rps']:,.0f} | {cpu_us:.1f} |")
with open(f"{work}/rows", "a") as rows:
    rows.write(f"{r}\t{policy}\t{loops}\t{oha['rps']}\t{cpu_us}\n")
PY
}

echo "loops.sh: $ROUNDS rounds, c=64, ${SECONDS_PER_POINT} s points, 0 ms mocks, $BIN"
echo
echo "| round | policy | event loops | requests/s | gateway CPU µs/request |"
echo "|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
    for p in "${POLICY_LIST[@]}"; do
        point "$p" 1 "$r"
        point "$p" 2 "$r"
    done
done
echo
python3 - "$WORK/rows" <<'PY'
import statistics, sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().split("\n") if line]
print("| policy | requests/s, 1 loop / 2 (medians) | CPU µs/request, 1 loop / 2 (medians) | "
      "2 loops minus 1, median of the paired differences: requests/s, CPU µs |")
print("|---|---|---|---|")
for policy in dict.fromkeys(r[1] for r in rows):
    at = {(r[0], r[2]): (float(r[3]), float(r[4])) for r in rows if r[1] == policy}
    rounds = sorted({k[0] for k in at})
    one = [at[(r, "1")] for r in rounds]
    two = [at[(r, "2")] for r in rounds]
    med = statistics.median
    d_rps = med([b[0] - a[0] for a, b in zip(one, two)])
    d_cpu = med([b[1] - a[1] for a, b in zip(one, two)])
    print(f"| {policy} | {med([a[0] for a in one]):,.0f} / {med([b[0] for b in two]):,.0f} | "
          f"{med([a[1] for a in one]):.1f} / {med([b[1] for b in two]):.1f} | "
          f"{d_rps:+,.0f}, {d_cpu:+.1f} |")
PY
