"""The model families kvchat runs: the one registry of architectures."""
from __future__ import annotations

from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


def check_architecture(arch: str, where: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {where}: kvchat runs the Llama family "
                             f"({', '.join(SUPPORTED_ARCHITECTURES)})")
