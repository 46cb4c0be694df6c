#!/usr/bin/env bash
# Instructions per request of one or more equiroute binaries, counted by callgrind: the same
# count for the same binary and load whatever else the machine does, so two builds compare on
# a busy machine where requests/s and CPU time do not (pair.sh). Three 0 ms mocks (run
# natively, from the first binary), then per binary the gateway under
# `valgrind --tool=callgrind` with bench/gateway/equiroute.toml: a warm-up, the counters
# zeroed, --requests requests at concurrency --concurrency, the counters dumped. Prints per
# binary the gateway's instructions per request (every thread: the runtime's, hyper's and the
# allocator's included; the kernel's not), and with --top K its K costliest functions by their
# own instructions, per request.
# See bench/gateway/README.md ("Instructions per request").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"

usage() {
    cat <<USAGE
Usage: bench/gateway/instructions.sh [options] BIN [BIN ...]

  --requests N      requests counted (default: 2000), after 300 warm-up requests
  --concurrency C   oha's concurrency (default: 16)
  --top K           also print each binary's K costliest functions (self, per request)
  --keep DIR        keep the callgrind outputs in DIR (callgrind_annotate reads them)

Environment: OHA_BIN (default: oha on PATH, then ~/.cargo/bin/oha), BENCH_PORT_BASE (first of
4 loopback ports, default: 19200).
USAGE
}

REQUESTS=2000
CONCURRENCY=16
TOP=0
KEEP=""
BINS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --requests) REQUESTS="${2:?--requests needs a number}"; shift ;;
        --concurrency) CONCURRENCY="${2:?--concurrency needs a number}"; shift ;;
        --top) TOP="${2:?--top needs a number}"; shift ;;
        --keep) KEEP="${2:?--keep needs a directory}"; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) BINS+=("$1") ;;
    esac
    shift
done
[ "${#BINS[@]}" -ge 1 ] || { echo "instructions.sh needs at least one binary" >&2; usage >&2; exit 2; }
check_binaries "${BINS[@]}"
check_positive REQUESTS CONCURRENCY
[[ "$TOP" =~ ^[0-9]+$ ]] || { echo "--top must be a number, got '$TOP'" >&2; exit 2; }
if ! command -v valgrind >/dev/null || ! command -v callgrind_control >/dev/null; then
    echo "valgrind is missing: apt-get install valgrind" >&2
    exit 2
fi
find_oha
BASE="${BENCH_PORT_BASE:-19200}"

start_work
[ -z "$KEEP" ] || mkdir -p "$KEEP"

start_instant_upstreams "${BINS[0]}"

echo "instructions.sh: $REQUESTS requests at c=$CONCURRENCY after 300 warm-up, 0 ms mocks, callgrind"
echo
echo "| binary | instructions/request |"
echo "|---|---|"
n=0
for bin in "${BINS[@]}"; do
    n=$((n + 1))
    out="$WORK/callgrind.$n"
    valgrind --tool=callgrind --callgrind-out-file="$out.%p" \
        "$bin" serve --config "$WORK/equiroute.toml" >"$WORK/serve$n.log" 2>&1 &
    gw=$!
    PIDS+=("$gw")
    wait_port "$BASE" 1200  # under callgrind the gateway starts in seconds
    send 300 >/dev/null
    callgrind_control --zero "$gw" >/dev/null 2>&1
    send "$REQUESTS" --output-format json >"$WORK/oha$n.json"
    callgrind_control --dump=measured "$gw" >/dev/null 2>&1
    kill "$gw"
    wait "$gw" 2>/dev/null || true
    # The dump after the zeroing: the file whose header names the "measured" trigger.
    dump=$(grep -l '^desc: Trigger: .*measured' "$out".* | head -1)
    ok=$(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d["statusCodeDistribution"].get("200", 0))' "$WORK/oha$n.json")
    [ "$ok" -eq "$REQUESTS" ] || echo "warning: $bin answered $ok of $REQUESTS requests with 200" >&2
    total=$(awk '/^(summary|totals):/ {print $2; exit}' "$dump")
    printf '| %s | %s |\n' "$bin" "$(python3 -c "print(f'{$total / $REQUESTS:,.0f}')")"
    if [ "$TOP" -gt 0 ]; then
        callgrind_annotate --inclusive=no --threshold=100 "$dump" 2>/dev/null |
            python3 -c '
import re, sys
top, n = int(sys.argv[1]), int(sys.argv[2])
ENTRY_FRAMES = ("backtrace", "libc-start", "libc_start", "below main", "clone.S", "start_thread",
                "thread_start", "vtable.shim", "lang_start", "::main ", ":main ", "0x0000")
shown = 0
for line in sys.stdin:
    m = re.match(r"^\s*([0-9,]+)\s+\([^)]*\)\s+(.*)$", line) or re.match(r"^\s*([0-9,]+)\s+(\S.*)$", line)
    if not m or "PROGRAM TOTALS" in line or ":" not in m.group(2):
        continue
    # The entry frames of threads, listed by callgrind_annotate with the costs of their callees.
    if any(f in m.group(2) for f in ENTRY_FRAMES):
        continue
    ir = int(m.group(1).replace(",", "")) / n
    print(f"    {ir:9,.0f}  {m.group(2)[:150]}")
    shown += 1
    if shown >= top:
        break
sys.stdin.read()  # the rest, so that callgrind_annotate is not cut off (pipefail)
' "$TOP" "$REQUESTS"
    fi
    [ -z "$KEEP" ] || cp "$dump" "$KEEP/$(basename "$bin").$n.callgrind"
done
