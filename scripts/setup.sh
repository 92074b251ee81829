#!/usr/bin/env bash
# Create .venv/ at the repository root and install Substation with everything it needs:
# PyTorch (CPU build), DaCe, Intel MKL (the BLAS the generated code links against), the test and
# Hugging Face extras. Re-running is cheap: it reinstalls only when the packaging files changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
  echo "substation needs Python >= 3.10 (found $("$PY" --version 2>&1))" >&2; exit 1
fi
if ! command -v "${CXX:-g++}" >/dev/null; then
  echo "a C++ compiler is needed: install g++ (e.g. apt-get install g++) or set CXX" >&2; exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
STAMP=.venv/.substation-installed
WANT="$( (cat setup.cfg setup.py pyproject.toml; command -v nvcc || true) | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # The CPU build of torch first, pinned: an open range would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  EXTRAS=test
  # With nvcc on the machine, also cuBLAS (PyPI) so CUDA builds compile and link (target: cuda).
  if command -v nvcc >/dev/null; then EXTRAS=test,cuda; fi
  .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
  echo "$WANT" > "$STAMP"
fi
