"""Where kvchat keeps things on disk: one ground-floor module, importing nothing of kvchat, so that the engine,
the app, the command line and the benchmarks all agree on every folder and no two of them spell one twice.

Each root honours its environment variable first (tests and bench runs point them at temporary folders), then the
platform's own folder (platformdirs: ~/.cache/kvchat and ~/.local/share/kvchat on Linux). The folders below a
root are not created here: whoever writes to one creates it.
"""
from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "kvchat"
CACHE_DIR_ENV = "KVCHAT_CACHE_DIR"
DATA_DIR_ENV = "KVCHAT_DATA_DIR"
LOG_DIR_ENV = "KVCHAT_LOG_DIR"
QUALITY_FILE_ENV = "KVCHAT_QUALITY_FILE"


def cache_root() -> Path:
    """What kvchat can rebuild: tokenizers built from GGUFs, saved conversation caches, bench models."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs
    return Path(platformdirs.user_cache_dir(APP_NAME))


def data_dir() -> Path:
    """What kvchat cannot rebuild: the conversation history."""
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs
    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def log_dir() -> Path:
    override = os.environ.get(LOG_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs
    return Path(platformdirs.user_log_dir(APP_NAME, appauthor=False))


def tokenizer_cache_dir() -> Path:
    """Tokenizers and chat templates built once from a GGUF's metadata, a folder per file."""
    return cache_root() / "tokenizers"


def kv_cache_dir() -> Path:
    """Saved conversation caches (warm conversations), under a disk budget."""
    return cache_root() / "kv"


def bench_models_dir() -> Path:
    """Random preset GGUFs that `kvchat bench` writes once and reuses."""
    return cache_root() / "bench-models"


def weight_fidelity_dir() -> Path:
    """Requantized copies `kvchat bench quality --weight-fidelity` compares."""
    return cache_root() / "weight-fidelity"


def ollama_links_dir() -> Path:
    """Named .gguf links to Ollama's suffix-less blobs, so that the loader accepts them."""
    return cache_root() / "ollama-links"


def conversion_cache_dir() -> Path:
    """Where versions before in-place GGUF reading kept fp32 copies: only ever removed."""
    return cache_root() / "models"


def quality_file() -> Path:
    """Measured cache-format quality, shown beside the formats."""
    override = os.environ.get(QUALITY_FILE_ENV)
    if override:
        return Path(override)
    return cache_root() / "quality.json"
