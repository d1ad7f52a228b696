"""kvchat: a desktop chat for local language models that shows and controls its KV cache.

Installed, everything lives under this one name: kvchat.engine (no Qt), kvchat.app (the window),
kvchat.kernels, kvchat.cli, kvchat.bench, kvchat.resources. In the source tree this file is the
repository root's: pyproject.toml maps the package `kvchat` onto the root folder, so app/, engine/ and the
others keep their places and import as kvchat.app, kvchat.engine.
"""
import os as _os
import sys as _sys

# Run from a checkout (`python -m kvchat.cli.main` in the repository root), Python puts the root on sys.path, where
# its folders pass for top-level packages: kernels/ for Hugging Face's `kernels`, which transformers imports. The
# root is this package's own folder and never a legitimate import path, so it leaves sys.path as kvchat comes in.
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _HERE]
del _os, _sys, _HERE
