"""`kvchat bench attention`: how fast a decode step reads its KV cache (issue 43).

Per cache format, a conversation of N cached tokens is read (untimed), then --steps greedy decode steps are timed; at
two lengths, the short one and the long one, in interleaved runs. What the longer cache adds to a step is its
attention: `read_gb_s` = the bytes the extra tokens hold (the sessions' own `kv_bytes`, long less short)
over the extra milliseconds a step takes. The peer, measured in the same runs, is the machine's streaming read: the
same threads summing a buffer far larger than any cache (`stream_gb_s`); `ratio_vs_stream` = the attention's read
rate over it (1.0: the pages read as fast as memory streams). Medians over the runs, with min and max.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from kvchat.bench.models import history_ids, mode_list
from kvchat.engine.config import CacheConfig, EngineConfig

MODES = ("bf16", "int8", "int4", "fp8", "fp32")
STREAM_BYTES = 512 * 1024 * 1024


def _ints(text: str) -> list[int]:
    try:
        got = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: two token counts, e.g. 256,2048") from None
    if len(got) != 2 or min(got) < 16 or got[0] >= got[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: a short and a longer count, each at least 16, e.g. 256,2048")
    return got


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="default, a .gguf or HF folder, or preset:NAME:TYPE[:LAYERS]")
    parser.add_argument("--contexts", type=_ints, default=[256, 2048], help="the short and the long cache, in tokens")
    parser.add_argument("--modes", type=mode_list(MODES),
                        default=["bf16", "int8", "int4"], help=f"from: {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed at each length")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)


def _steps(engine, fmt: str, history: list[int], steps: int) -> tuple[float, float]:
    """The median seconds of a decode step after `history`, and the bytes the session's cache then holds."""
    from kvchat.engine.errors import UserError
    from kvchat.engine.runtime.overflow import BudgetFull
    session = engine.new_session(cache=CacheConfig(k_format=fmt, v_format=fmt, budget_mb=4096), prefix_cache=False)
    try:
        try:
            token = int(session.append(history, all_logits=False)[-1].argmax())
        except BudgetFull as exc:       # a cache past the model's context: the option's fault, one line
            raise UserError(f"--contexts: {exc}") from None
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            token = int(session.append([token], all_logits=False)[-1].argmax())
            times.append(time.perf_counter() - t0)
        return statistics.median(times), session.stats().kv_bytes
    finally:
        session.close()


def stream_read(buf) -> float:
    """GB/s of one pass summing buf (a tensor far larger than the caches) with torch's threads."""
    t0 = time.perf_counter()
    buf.sum()
    return buf.numel() * buf.element_size() / (time.perf_counter() - t0) / 1e9


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}


def run(args) -> dict:
    import torch

    from kvchat.bench.models import resolve_model
    from kvchat.engine import Engine
    if args.steps < 2 or args.runs < 1:
        raise SystemExit("kvchat bench attention: --steps at least 2, --runs at least 1")
    say = getattr(args, "progress", None) or (lambda *a: None)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    say(f"loading {args.model}")
    engine = Engine.load(EngineConfig(model=resolve_model(args.model), device="cpu", num_threads=threads))
    engine.runner.set_budget(max(engine.budget_mb, 4096))
    short, long = args.contexts
    ids = history_ids(engine.tokenizer, long)
    buf = torch.ones(STREAM_BYTES // 4)
    stream_read(buf)                                  # its pages touched once, untimed
    step: dict = {}
    held: dict = {}
    streams = []
    total, done = args.runs * len(args.modes) * 2, 0
    for _ in range(args.runs):                        # interleaved: each run visits every mode and both lengths
        for mode in args.modes:
            for n in (short, long):
                done += 1
                say(f"{mode}, {n:,} cached, {args.steps} steps", done, total)
                t, b = _steps(engine, mode, ids[:n], args.steps)
                step.setdefault((mode, n), []).append(t)
                held[(mode, n)] = b
        streams.append(stream_read(buf))
    del buf
    from kvchat.bench.speed import _kernels_label
    stream = _spread(streams)
    result = {"model": engine.model_name, "weights": engine.weights_label, "threads": threads,
              "kernels": _kernels_label(), "contexts": [short, long], "steps": args.steps, "runs": args.runs,
              "stream_gb_s": stream, "modes": {}}
    for mode in args.modes:
        s, l_ = statistics.median(step[(mode, short)]), statistics.median(step[(mode, long)])
        added = l_ - s
        extra = held[(mode, long)] - held[(mode, short)]           # the bytes the longer cache adds
        rate = extra / added / 1e9 if added > 0 else None
        result["modes"][mode] = {
            "step_ms": {str(short): _spread([x * 1e3 for x in step[(mode, short)]]),
                        str(long): _spread([x * 1e3 for x in step[(mode, long)]])},
            "bytes_per_token": extra / (long - short),
            "added_ms_per_1k_tokens": added * 1e3 / (long - short) * 1000,
            "read_gb_s": rate,
            "ratio_vs_stream": rate / stream["median"] if rate else None,
        }
    return result


def summarize(r: dict) -> str:
    short, long = r["contexts"]
    st = r["stream_gb_s"]
    lines = [f"{r['model']} ({r['weights']}), {r['threads']} threads, kernels {r['kernels']}: a decode step at "
             f"{short:,} and {long:,} cached tokens (medians of {r['runs']} runs of {r['steps']} steps); streaming "
             f"read {st['median']:.1f} GB/s ({st['min']:.1f}-{st['max']:.1f})"]
    for mode, m in r["modes"].items():
        a, b = m["step_ms"][str(short)], m["step_ms"][str(long)]
        rate = (f"the cache read at {m['read_gb_s']:.1f} GB/s = {m['ratio_vs_stream']:.2f}x streaming"
                if m["read_gb_s"] else "no cost measured (the longer steps were not slower)")
        lines.append(f"  {mode:<5} {a['median']:.2f} -> {b['median']:.2f} ms a step, "
                     f"{m['added_ms_per_1k_tokens']:.2f} ms per 1,000 cached tokens of "
                     f"{m['bytes_per_token'] / 1024:.1f} "
                     f"KiB each: {rate}")
    return "\n".join(lines)
