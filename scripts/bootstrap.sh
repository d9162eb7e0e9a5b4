#!/usr/bin/env bash
# Sets up .venv (Python 3.12, the one megatron-core wants) with megamoe_train installed from this
# checkout, its C++ extension built, and the test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "bootstrap: Python 3.12 not found (install it, e.g. with pyenv)" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
# Build tools first so the extension builds against this venv (no isolated build env).
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-build-isolation -e '.[test,plot]'
.venv/bin/python -c 'import megamoe_train, megamoe_train._C; print("bootstrap: megamoe_train ready in .venv")'
