#!/usr/bin/env bash
# The scaling set of `substation bench` (issue 7, part 3): BERT-large at B=8, L=128, and BERT-base at
# B=8 with L in {64, 128, 256, 512}. Writes out/bench/<name>-b<B>-l<L>.json and .png, and the bench text
# output next to them (.txt). Extra arguments go to every run (e.g. --repeats 10 or --no-compile).
# Takes roughly 15-30 minutes on a 2-core machine (each run compiles Substation and torch.compile cold).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT:-out/bench}"
mkdir -p "$OUT"

run() {  # run CONFIG B L [args...]
    local config="$1" b="$2" l="$3"
    shift 3
    local name
    name="$(basename "$config" .yaml)"
    name="${name%%-b[0-9]*}-b${b}-l${l}"
    echo "== $name" >&2
    "$PY" -m substation bench "$config" --batch-size "$b" --seq-len "$l" \
        --json "$OUT/$name.json" --plot "$OUT/$name.png" "$@" | tee "$OUT/$name.txt"
}

run bert-large-b8-l512 8 128 "$@"
for l in 64 128 256 512; do
    run bert-base 8 "$l" "$@"
done
echo "wrote $OUT/" >&2
