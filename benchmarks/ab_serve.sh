#!/usr/bin/env bash
# A/B of `ladle bench serve` between two commits of this repository, interleaved on one machine:
#   benchmarks/ab_serve.sh BASE_COMMIT OUT.jsonl ROUNDS [extra `ladle serve` flags for the B side...]
# Each round starts `ladle serve` from a worktree of BASE_COMMIT (A), runs the benchmark, stops it, then does the
# same from this working tree (B, with the extra flags); every run appends one JSON line to OUT.jsonl (its
# `commit` tells A from B). Interleaving spreads a noisy machine's drift over both sides.
set -euo pipefail
base=$1 out=$2 rounds=$3
shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
python=$here/.venv/bin/python
tree=$(mktemp -d /tmp/ladle-ab-XXXXXX)
git -C "$here" worktree add --detach "$tree" "$base" >/dev/null
trap 'git -C "$here" worktree remove --force "$tree"' EXIT
bench=(--dataset chat --num-prompts 64 --input-len 64 --output-len 16 --max-concurrency 8 --out "$out")

run() {  # run SOURCE_TREE [serve flags...]
    local source=$1 port=18000 grpc_port=18051 log
    shift
    log=$(mktemp)
    (cd "$source" && PYTHONPATH="$source:$source/clients" exec "$python" -m ladle_cli serve --port $port \
        --grpc-port $grpc_port --device cpu "$@" >"$log" 2>&1) &
    local server=$!
    until grep -q "ladle serve: ready" "$log"; do
        kill -0 $server 2>/dev/null || { tail -20 "$log"; exit 1; }  # it ended (a port in use, say)
        sleep 0.5
    done
    (cd "$source" && PYTHONPATH="$source:$source/clients" "$python" -m ladle_cli bench serve \
        --base-url "http://127.0.0.1:$port/v1" "${bench[@]}")
    kill -INT $server
    wait $server || true
    rm -f "$log"
}

for _ in $(seq "$rounds"); do
    run "$tree"
    run "$here" "$@"
done
