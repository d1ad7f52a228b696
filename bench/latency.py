"""`kvchat bench latency`: how long a chat in memory makes its user wait for the next answer (issue 43).

A conversation of N cached tokens (prose, read untimed), then a message of --message-tokens tokens: the time from
handing the message over to its last row's logits (the first answer token is chosen from them), kvchat beside
llama.cpp on the same GGUF and the same token ids. Each run starts a fresh conversation (kvchat's prefix cache off,
llama.cpp reset), so neither side finds the message already read. Per cache mode, kvchat's format beside llama.cpp's
(bf16 / f16, int8 / q8_0, int4 / q4_0; llama.cpp's f16 with and without flash attention, the faster counted, its
quantized V with flash attention as it requires: bench/llamacpp.py), per N, interleaved runs; reported as medians with
min and max, and `ratio_vs_llamacpp` = kvchat's time over llama.cpp's (at most 1.0: kvchat answers no later).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from kvchat.bench import llamacpp
from kvchat.bench.models import history_ids, mode_list
from kvchat.engine.config import CacheConfig, EngineConfig

MODES = {"bf16": ("bf16", 1), "int8": ("int8", 8), "int4": ("int4", 2)}    # kvchat format, llama.cpp ggml type
CONTEXTS = (1024, 4096, 7168)


def _ints(text: str) -> list[int]:
    try:
        got = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated token counts, e.g. 1024,4096") from None
    if not got or min(got) < 16:
        raise argparse.ArgumentTypeError(f"{text!r}: each count at least 16")
    return got



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="default, a .gguf or HF folder, or preset:NAME:TYPE[:LAYERS]")
    parser.add_argument("--contexts", type=_ints, default=list(CONTEXTS), help="cached tokens before the message")
    parser.add_argument("--message-tokens", type=int, default=24)
    parser.add_argument("--modes", type=mode_list(MODES),
                        default=["bf16", "int8"], help=f"from: {', '.join(MODES)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-llamacpp", action="store_true")



def _kvchat_once(engine, fmt: str, history: list[int], message: list[int]) -> float:
    session = engine.new_session(cache=CacheConfig(k_format=fmt, v_format=fmt, budget_mb=4096), prefix_cache=False)
    try:
        session.append(history, all_logits=False)
        t0 = time.perf_counter()
        session.append(message, all_logits=False)
        return time.perf_counter() - t0
    finally:
        session.close()


def _llamacpp_once(llm, history: list[int], message: list[int]) -> float:
    llm.reset()
    llm.eval(history)
    t0 = time.perf_counter()
    llm.eval(message)
    return time.perf_counter() - t0


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}


def run(args) -> dict:
    import torch

    from kvchat.bench.models import model_path, resolve_model
    from kvchat.engine import Engine
    say = getattr(args, "progress", None) or (lambda *a: None)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    spec = resolve_model(args.model)
    path = model_path(spec)
    say(f"loading {args.model}")
    engine = Engine.load(EngineConfig(model=spec, device="cpu", num_threads=threads))
    engine.runner.set_budget(max(engine.budget_mb, 4096))
    longest = max(args.contexts)
    ids = history_ids(engine.tokenizer, longest + args.message_tokens)
    message_at = {n: ids[n:n + args.message_tokens] for n in args.contexts}
    peers = {}
    if not args.no_llamacpp and path and str(path).endswith(".gguf"):
        for mode in args.modes:
            got = llamacpp.open_peers(str(path), threads, longest + args.message_tokens + 16, MODES[mode][1])
            if got:
                peers[mode] = got
    times: dict = {}
    say("warming")
    for mode in args.modes:
        _kvchat_once(engine, MODES[mode][0], ids[:64], ids[64:64 + args.message_tokens])
        for llm in peers.get(mode, {}).values():
            _llamacpp_once(llm, ids[:64], ids[64:64 + args.message_tokens])
    total = args.runs * len(args.modes) * len(args.contexts)
    done = 0
    for _ in range(args.runs):                       # interleaved: each run visits every mode and length
        for mode in args.modes:
            for n in args.contexts:
                done += 1
                say(f"{mode}, {n:,} cached + {args.message_tokens}", done, total)
                times.setdefault(("kvchat", mode, n), []).append(
                    _kvchat_once(engine, MODES[mode][0], ids[:n], message_at[n]))
                for fa, llm in peers.get(mode, {}).items():
                    times.setdefault(("llamacpp", mode, n), {}).setdefault(fa, []).append(
                        _llamacpp_once(llm, ids[:n], message_at[n]))
    from kvchat.bench.speed import _kernels_label
    result = {"model": engine.model_name, "weights": engine.weights_label, "path": str(path), "threads": threads,
              "kernels": _kernels_label(), "message_tokens": args.message_tokens, "runs": args.runs,
              "llamacpp": sorted(peers), "modes": {}}
    for mode in args.modes:
        rows = {}
        for n in args.contexts:
            row = {"kvchat_s": _spread(times[("kvchat", mode, n)])}
            if ("llamacpp", mode, n) in times:
                by_config = times[("llamacpp", mode, n)]
                fa, best = llamacpp.fastest(by_config)
                row["llamacpp_s"] = _spread(best)
                row["llamacpp_config"] = llamacpp.label(fa)
                row["llamacpp_by_config"] = {llamacpp.label(k): _spread(v) for k, v in by_config.items()}
                row["ratio_vs_llamacpp"] = row["kvchat_s"]["median"] / row["llamacpp_s"]["median"]
            rows[str(n)] = row
        result["modes"][mode] = rows
    return result


def summarize(r: dict) -> str:
    lines = [f"{r['model']} ({r['weights']}), {r['threads']} threads: a {r['message_tokens']}-token message after N "
             f"cached tokens, seconds to its logits (medians of {r['runs']})"]
    for mode, rows in r["modes"].items():
        for n, row in rows.items():
            k = row["kvchat_s"]
            line = f"  {mode:<5} {int(n):>6,} cached: kvchat {k['median']:.3f} s ({k['min']:.3f}-{k['max']:.3f})"
            if "llamacpp_s" in row:
                p = row["llamacpp_s"]
                line += (f", llama.cpp {p['median']:.3f} s ({p['min']:.3f}-{p['max']:.3f}, {row['llamacpp_config']}) = "
                         f"{row['ratio_vs_llamacpp']:.2f}x")
            lines.append(line)
    return "\n".join(lines)
