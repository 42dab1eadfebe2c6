#!/usr/bin/env bash
# Set up (once) and start the PrefixLab desktop app on the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/prefixlab "$@"
