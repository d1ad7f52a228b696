"""Terminal entry points: `kvchat chat`, `kvchat bench ...`, `kvchat estimate`, `kvchat info`."""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from .config import CacheConfig, ConfigError, EngineConfig, SamplingParams

BENCHES = {
    "speed": "engine.bench_speed",
    "memory": "engine.bench_memory",
    "quality": "engine.bench_quality",
    "passkey": "engine.bench_passkey",
    "kernels": "engine.bench_kernels",
}


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="default, a local HF folder, or a .gguf file")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--k-format", default="auto")
    p.add_argument("--v-format", default="auto")
    p.add_argument("--k-scheme", default="channel", choices=["channel", "token"])
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget-mb", type=float, default=1024.0)
    p.add_argument("--overflow", default="stop", choices=["stop", "slide"])
    p.add_argument("--fp-layers", default="", help="comma-separated layers kept in full precision")


def cache_config(args) -> CacheConfig:
    layers = tuple(int(x) for x in args.fp_layers.split(",") if x.strip())
    return CacheConfig(k_format=args.k_format, v_format=args.v_format, k_scheme=args.k_scheme,
                       full_precision_layers=layers, window=args.window, sinks=args.sinks,
                       block_size=args.block_size, budget_mb=args.budget_mb, overflow=args.overflow)


def engine_config(args) -> EngineConfig:
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, cache=cache_config(args))


def _print_stats(session) -> None:
    s = session.stats()
    print(f"[{s.cache_label}] tokens held {s.tokens_held} (evicted {s.tokens_evicted}), "
          f"KV {s.kv_bytes / 1024:.1f} KiB of {s.budget_bytes / 2**20:.0f} MiB, blocks {s.blocks_used}/{s.blocks_budget}, "
          f"tokens left {'unbounded (window)' if s.tokens_left < 0 else s.tokens_left}, "
          f"prefill {s.prefill_tok_s:.0f} tok/s, decode {s.decode_tok_s:.1f} tok/s, TTFT {s.ttft_s * 1000:.0f} ms")


def _stream(session, text: str, params: SamplingParams) -> None:
    from .events import TokenDelta, TurnFinished
    for event in session.send(text, params):
        if isinstance(event, TokenDelta):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, TurnFinished):
            print()
            if event.message:
                print(f"! {event.message}", file=sys.stderr)


def cmd_chat(args) -> int:
    from .engine import Engine
    from .loader import ModelLoadError
    try:
        engine = Engine.load(engine_config(args))
    except (ModelLoadError, ConfigError) as exc:
        print(f"kvchat: {exc}", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, repetition_penalty=args.repetition_penalty,
                            seed=args.seed)
    session = engine.new_session(system_prompt=args.system)
    if args.prompt is not None:
        try:
            _stream(session, args.prompt, params)
        except KeyboardInterrupt:           # Ctrl+C mid-reply: what came so far stays printed
            print("\n(stopped)", file=sys.stderr)
            return 130
        return 0
    print(f"kvchat: {engine.model_name} on {engine.device}, cache {session.cache_config.label()}. "
          f"Commands: /reset, /stats, /quit")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        cmd = line.strip()
        if cmd in ("/quit", "/exit"):
            return 0
        if cmd == "/reset":
            freed = session.reset()
            print(f"session reset: {freed / 1024:.1f} KiB of KV cache returned")
            continue
        if cmd == "/stats":
            _print_stats(session)
            continue
        if cmd:
            try:
                _stream(session, line, params)
            except KeyboardInterrupt:
                print("\n(stopped)")


def cmd_bench(args) -> int:
    module = importlib.import_module(BENCHES[args.bench])
    result = module.run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        summary = getattr(module, "summarize", None)
        print(summary(result) if summary else json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvchat", description="Chat with a local model and see its KV cache.")
    sub = parser.add_subparsers(dest="command")
    chat = sub.add_parser("chat", help="terminal chat")
    add_cache_arguments(chat)
    chat.add_argument("--prompt", default=None, help="send one message, print the reply and exit")
    chat.add_argument("--system", default=None)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--top-k", type=int, default=50)
    chat.add_argument("--repetition-penalty", type=float, default=1.1)
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--seed", type=int, default=None)
    chat.set_defaults(func=cmd_chat)
    from . import estimate
    plan = sub.add_parser("estimate", help="KV and weight memory of a model and context, before loading it")
    estimate.add_arguments(plan)
    plan.set_defaults(func=estimate.cmd_estimate)
    bench = sub.add_parser("bench", help="benchmarks (speed, memory, quality, passkey, kernels)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        p = bsub.add_parser(name)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
        p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
