"""What a cache mode costs: top-1 agreement and KL against full precision on the loaded model.

Measured once per (model, mode) on a built-in text with `kvchat bench quality`'s own code, and kept
on disk (JSON in the user cache dir) so the dashboard can say it at once the next time. No Qt here:
the engine thread measures (bridge/measure.py); the window reads and writes the store.

A measurement is kept only when it measured: the budget held both sessions whole (a budget that
released or refused them gave 100 % / KL 0 once) and every token was compared with a non-empty cache. A window
mode reads more tokens than its window and sinks hold, so the window slides (read only up to the window it is
the same format without one); a window the model's context cannot slide is not measured.
The key holds what changes the result: the model file's weights, dtype and device, the mode and its
block size; the budget is not in it because a measurement that did not fit is never kept.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvchat.engine import paths
from kvchat.engine.config import CacheConfig

QUALITY_TOKENS = 256                    # 16 block-sized steps: seconds on a small model, and enough to see int4's cost
                                        # (a window mode reads this many past its window and sinks)
QUALITY_STEP = 16                       # block-aligned chunks: the attention the decode path sees (bench_quality)
QUALITY_TEXT = "prose"                  # resources/texts/prose.txt


@dataclass(frozen=True, slots=True)
class QualityResult:
    model: str
    mode: str                           # mode_key() of the cache config
    top1_agreement: float               # 0.0-1.0: the mode's next-token choice equals full precision's
    mean_kl: float                      # mean KL(full precision || mode) in nats per token
    tokens: int
    seconds: float


def mode_key(cache: CacheConfig) -> str:
    """The cache mode as the user reads it in the quality line."""
    key = cache.label()
    if cache.k_scheme != "channel" and "per-token" not in key:
        key += f" ({cache.k_scheme} keys)"
    if cache.full_precision_layers:
        key += f", full-precision layers {','.join(map(str, cache.full_precision_layers))}"
    return key


def result_key(cache: CacheConfig) -> str:
    """The mode as the measurement sees it: per-block key scales make the block size part of it."""
    return f"{mode_key(cache)} · blocks of {cache.block_size}"


def model_key(name: str, weights_label: str, dtype: str, device: str) -> str:
    """The model as the measurement sees it: the same name packed or dense, or on another device, differs."""
    return " · ".join(str(part) for part in (name, weights_label, dtype, device) if part)


def is_reference(cache: CacheConfig) -> bool:
    """The full-precision cache without a window is what every other mode is compared with."""
    return cache.k_format == "auto" and cache.v_format == "auto" and cache.window is None


def tokens_to_measure(cache: CacheConfig, num_tokens: int = QUALITY_TOKENS) -> int:
    """The text a measurement reads: num_tokens, past the window and its sinks for a window mode."""
    return num_tokens if cache.window is None else cache.window + cache.sinks + num_tokens


def covers(cache: CacheConfig, result: QualityResult) -> bool:
    """The result measured the mode: a window mode's read more tokens than the window and sinks hold (one that
    did not is the format's figure without the window)."""
    return cache.window is None or result.tokens > cache.window + cache.sinks


def store_path() -> Path:
    """KVCHAT_QUALITY_FILE if set (tests use it), else quality.json in the cache root (engine/paths.py)."""
    return paths.quality_file()


class QualityStore:
    """Measured results keyed by model name and mode; a damaged file counts as empty."""

    def __init__(self, path: Path | None = None):
        self.path = path or store_path()
        self._results: dict[str, dict] = {}
        try:
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
            self._results = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            pass

    @staticmethod
    def _key(model: str, mode: str) -> str:
        return f"{model} | {mode}"

    def get(self, model: str, mode: str) -> QualityResult | None:
        entry = self._results.get(self._key(model, mode))
        try:
            return QualityResult(**entry) if entry else None
        except TypeError:               # written by another version
            return None

    def put(self, result: QualityResult) -> None:
        self._results[self._key(result.model, result.mode)] = asdict(result)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._results, indent=1, sort_keys=True), encoding="utf-8")
            tmp.replace(self.path)
        except OSError:
            pass                        # kept in memory for this run; measured again next time


@dataclass(frozen=True, slots=True)
class QualityCancelled:
    """A measurement that gave way to a command, or failed (error says why); the mode is still not measured."""

    model: str
    mode: str
    error: str = ""
