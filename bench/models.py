"""What a benchmark runs on: a model spec resolved (a preset written once), its file, a prompt of n tokens."""
from __future__ import annotations

FALLBACK_TEXT = ("The library was quiet in the early morning, and the reading room smelled of old paper and "
                 "floor polish. ")


def resolve_model(spec: str) -> str:
    """A model spec as Engine.load takes it; preset:NAME:TYPE[:LAYERS] writes (once) and returns that GGUF (its first
    LAYERS layers where given: preset:gpt-oss-20b:MXFP4:4)."""
    if spec.startswith("preset:"):
        from kvchat.bench.gguf_writer import bench_model_path
        _, preset, qtype, *layers = spec.split(":")
        return str(bench_model_path(preset, qtype, int(layers[0]) if layers else None))
    return spec


def model_path(spec: str) -> str:
    from kvchat.engine.model.source import locate
    return str(locate(spec).path)


def history_ids(tokenizer, n: int) -> list[int]:
    """n token ids of a conversation's past: the shipped stream text, or prompt_ids' filler where it is missing."""
    try:
        from kvchat.engine.text.samples import load_tokens
        return load_tokens(tokenizer, "stream", n)
    except Exception:      # noqa: BLE001 - the shipped text is missing: the benchmark's own filler
        return prompt_ids(tokenizer, n)


def mode_list(names):
    """An argparse type: comma-separated cache modes, each one of names."""
    def parse(text: str) -> list[str]:
        import argparse
        got = [m for m in text.split(",") if m]
        if not got or any(m not in names for m in got):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(names)}")
        return got
    return parse


def prompt_ids(tokenizer, n: int) -> list[int]:
    try:
        from kvchat.engine.text.samples import load_text
        text = load_text("prose")
    except Exception:
        text = FALLBACK_TEXT * 200
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]
