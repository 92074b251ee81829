#!/usr/bin/env bash
# Set up (if needed), then run the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest -q "$@"
