#!/usr/bin/env bash
# Build a one-folder desktop bundle in dist/kvchat with PyInstaller (not part of `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
make venv
.venv/bin/pip install -q pyinstaller
.venv/bin/pyinstaller --noconfirm packaging/kvchat.spec
echo "bundle: dist/kvchat/kvchat   desktop entry: packaging/kvchat.desktop"
