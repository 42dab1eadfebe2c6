#!/usr/bin/env bash
# Set up (once) and start the PrefixLab desktop app on the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# Stop before Qt starts when it could not (no display, a library missing): say the fix.
.venv/bin/python -m app.desktop.qt_libs --check
exec .venv/bin/prefixlab "$@"
