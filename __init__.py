"""kvchat: a desktop chat for local language models that shows and controls its KV cache.

Installed, everything lives under this one name: kvchat.engine (no Qt), kvchat.app (the window),
kvchat.kernels, kvchat.cli, kvchat.bench, kvchat.resources. In the source tree this file is the
repository root's: pyproject.toml maps the package `kvchat` onto the root folder, so app/, engine/ and the
others keep their places and import as kvchat.app, kvchat.engine. Nothing is imported here.
"""
