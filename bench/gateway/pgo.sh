#!/usr/bin/env bash
# A profile-guided build of `equiroute`: builds the binary instrumented (-Cprofile-generate),
# runs it as a gateway in front of three 0 ms mocks while oha sends it unstreamed and streamed
# chat requests (the training), merges the profile with llvm-profdata and builds again with
# -Cprofile-use. The compiler then lays the request path's code out by how often it ran, and
# inlines along the paths taken. Prints the optimized binary's path.
# Needs llvm-profdata of the LLVM that rustc was built with (`rustc -vV`: LLVM 22 for rustc
# 1.95; Debian: apt-get install llvm-22). Two full release builds: about 15 minutes on 2 cores.
# See bench/gateway/README.md ("A profile-guided build").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"

usage() {
    cat <<USAGE
Usage: bench/gateway/pgo.sh [options]

  --requests N      unstreamed chat requests of the training (default: 200000); a tenth as
                    many streamed ones follow
  --target DIR      cargo's target directories go under DIR (default: target/pgo); the
                    optimized binary is DIR/use/release/equiroute

Environment: LLVM_PROFDATA (default: llvm-profdata-N for rustc's LLVM major N, then
llvm-profdata), OHA_BIN (default: oha on PATH, then ~/.cargo/bin/oha), BENCH_PORT_BASE (first
of 4 loopback ports, default: 19400).
USAGE
}

REQUESTS=200000
CONCURRENCY=16
TARGET="$ROOT/target/pgo"
while [ $# -gt 0 ]; do
    case "$1" in
        --requests) REQUESTS="${2:?--requests needs a number}"; shift ;;
        --target) TARGET="${2:?--target needs a directory}"; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
check_positive REQUESTS
find_oha
major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
PROFDATA="${LLVM_PROFDATA:-$(command -v "llvm-profdata-$major" || command -v llvm-profdata || true)}"
[ -x "$PROFDATA" ] || {
    echo "llvm-profdata not found: rustc uses LLVM $major (Debian: apt-get install llvm-$major), or set LLVM_PROFDATA" >&2
    exit 2
}
BASE="${BENCH_PORT_BASE:-19400}"
mkdir -p "$TARGET"
TARGET=$(cd "$TARGET" && pwd)
PROFILES="$TARGET/profiles"
rm -rf "$PROFILES"
mkdir -p "$PROFILES"

echo "pgo.sh: 1/4 the instrumented build ($TARGET/generate)"
RUSTFLAGS="-Cprofile-generate=$PROFILES" CARGO_TARGET_DIR="$TARGET/generate" \
    cargo build --release -p equiroute --manifest-path "$ROOT/Cargo.toml"
GEN="$TARGET/generate/release/equiroute"
# RUSTFLAGS instrument the build scripts and proc macros too, and they wrote profiles while
# they ran: only the training's are kept.
rm -f "$PROFILES"/*.profraw

echo "pgo.sh: 2/4 the training: $REQUESTS unstreamed chat requests at c=16, $((REQUESTS / 10)) streamed"
start_work
start_instant_upstreams "$GEN"
"$GEN" serve --config "$WORK/equiroute.toml" >"$WORK/serve.log" 2>&1 &
gw=$!
PIDS+=("$gw")
wait_port "$BASE" 200
send "$REQUESTS" >/dev/null
echo '{"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hello"}]}' >"$WORK/body.json"
send $((REQUESTS / 10)) >/dev/null
curl -sf "http://127.0.0.1:$BASE/metrics" >/dev/null
# A stop the gateway handles: it returns from main, which writes its profile.
kill -TERM "$gw"
wait "$gw" 2>/dev/null || true
# The mocks (the same instrumented binary) are killed outright: their profile would be theirs.
for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
PIDS=()
ls "$PROFILES"/*.profraw >/dev/null 2>&1 || { echo "the training wrote no profile (see $WORK/serve.log)" >&2; exit 1; }

echo "pgo.sh: 3/4 merging the profile with $PROFDATA"
"$PROFDATA" merge -o "$TARGET/merged.profdata" "$PROFILES"

echo "pgo.sh: 4/4 the optimized build ($TARGET/use)"
RUSTFLAGS="-Cprofile-use=$TARGET/merged.profdata" CARGO_TARGET_DIR="$TARGET/use" \
    cargo build --release -p equiroute --manifest-path "$ROOT/Cargo.toml"
echo "$TARGET/use/release/equiroute"
