#!/usr/bin/env bash
# Set up (if needed), then compile the bundled default config (BERT-base, B=8, L=128) and check the
# compiled layer against PyTorch: writes graphs, sources, libraries and report.json to out/bert-base/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/substation compile configs/bert-base.yaml --out out/bert-base "$@"
