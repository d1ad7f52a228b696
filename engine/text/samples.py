"""Texts shipped in resources/texts/ for the benchmarks and fidelity checks."""
from __future__ import annotations

from pathlib import Path

TEXTS_DIR = Path(__file__).resolve().parents[2] / "resources" / "texts"


def text_path(name: str) -> Path:
    """resources/texts/<name>.txt of this checkout (an editable install points here too)."""
    path = TEXTS_DIR / f"{name}.txt"
    if not path.is_file():
        available = ", ".join(sorted(p.stem for p in TEXTS_DIR.glob("*.txt"))) or "none"
        raise FileNotFoundError(f"no text {name!r} in {TEXTS_DIR} (available: {available})")
    return path


def load_text(name: str) -> str:
    return text_path(name).read_text(encoding="utf-8")


def load_tokens(tokenizer, name: str, num_tokens: int | None = None) -> list[int]:
    """The text's token ids (no special tokens), cut to num_tokens; fails if the text is shorter."""
    ids = tokenizer.encode(load_text(name), add_special_tokens=False)
    if num_tokens is not None:
        if len(ids) < num_tokens:
            raise ValueError(f"text {name!r} has {len(ids)} tokens, fewer than the {num_tokens} asked for")
        ids = ids[:num_tokens]
    return ids
