#!/usr/bin/env bash
# Build a one-folder desktop bundle in dist/kvchat with PyInstaller (not part of `make test`), then
# check it: packaging/smoke_test.py starts it offscreen, sends one message and checks the reply.
set -euo pipefail
cd "$(dirname "$0")/.."
make package
.venv/bin/python packaging/smoke_test.py
echo "bundle: dist/kvchat/kvchat   desktop entry: resources/kvchat.desktop   icon: resources/kvchat.png"
