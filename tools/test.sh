#!/usr/bin/env bash
# Set up (once) and run the whole test suite, Qt offscreen.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
export QT_QPA_PLATFORM=offscreen
exec .venv/bin/python -m pytest "$@"
