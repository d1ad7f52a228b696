"""The engine's options on the command line: argparse in, frozen configs out (chat, serve and benchmarks)."""
from __future__ import annotations

import argparse

from kvchat.engine.config import ACTIVATION_MODES, PREFILL_MODES, SPEC_METHODS, CacheConfig, ConfigError, EngineConfig, SamplingParams, SpeculativeConfig


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    # the defaults are the configs' own, so that a run without options is EngineConfig() (quick.covers reads them too)
    engine, cache = EngineConfig(), CacheConfig()
    p.add_argument("--model", default=engine.model, help="default, a local HF folder, or a .gguf file")
    p.add_argument("--device", default=engine.device)
    p.add_argument("--dtype", default=engine.dtype, choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--prefill", default=engine.prefill, choices=PREFILL_MODES,
                   help="the prompt's matrix products over packed weights: bf16 (oneDNN, about 5x fp32 on a CPU "
                        "with AMX), int8 (llama.cpp's rounding of the rows, no dequantized weights), fp32 (exact), "
                        "or auto (the fastest this CPU measured, once)")
    p.add_argument("--activations", default=engine.activations, choices=ACTIVATION_MODES,
                   help="decode activations over packed weights: int16 (exact to about 1e-5), or int8 (llama.cpp's "
                        "rounding: faster for several rows a step, less exact)")
    p.add_argument("--k-format", default=cache.k_format)
    p.add_argument("--v-format", default=cache.v_format)
    p.add_argument("--k-scheme", default=cache.k_scheme, choices=["channel", "token"])
    p.add_argument("--window", type=int, default=cache.window)
    p.add_argument("--sinks", type=int, default=cache.sinks)
    p.add_argument("--eviction", default=cache.eviction, choices=["window", "importance"],
                   help="which blocks leave once --window tokens are held: the oldest (window) or the least attended "
                        "(importance: keep what matters)")
    p.add_argument("--retrieval-blocks", type=int, default=cache.retrieval_blocks, metavar="K",
                   help="fetch what is needed: keep every block and read the sinks, the newest and the K blocks "
                        "each token's query may need most (Quest), per layer")
    p.add_argument("--block-size", type=int, default=cache.block_size)
    p.add_argument("--budget-mb", type=float, default=cache.budget_mb)
    p.add_argument("--overflow", default=cache.overflow, choices=["stop", "slide"])
    p.add_argument("--fp-layers", default=",".join(map(str, cache.full_precision_layers)),
                   help="comma-separated layers kept in full precision")
    spec = engine.speculative
    p.add_argument("--speculative", default=spec.method, choices=SPEC_METHODS,
                   help="speculative decoding: prompt lookup (the default), a draft model, or off")
    p.add_argument("--spec-tokens", type=int, default=spec.k, help="most draft tokens verified in one step")
    p.add_argument("--draft-model", default=None, help="the draft model (--speculative draft): a .gguf file or folder "
                                                       "of the same tokenizer, or 'self'")


def parse_fp_layers(text: str) -> tuple[int, ...]:
    """'0,1,29' -> (0, 1, 29); anything else is a ConfigError naming the option."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--fp-layers {text!r}: give comma-separated layer numbers, e.g. --fp-layers 0,1,29") from None


def cache_config(args) -> CacheConfig:
    layers = parse_fp_layers(args.fp_layers)
    return CacheConfig(k_format=args.k_format, v_format=args.v_format, k_scheme=args.k_scheme,
                       full_precision_layers=layers, window=args.window, sinks=args.sinks,
                       block_size=args.block_size, budget_mb=args.budget_mb, overflow=args.overflow,
                       eviction=args.eviction, retrieval_blocks=args.retrieval_blocks)


def speculative_config(args) -> SpeculativeConfig:
    """The speculative-decoding options; a bad value is a ConfigError naming the option."""
    try:
        return SpeculativeConfig(args.speculative, k=args.spec_tokens, draft_model=args.draft_model)
    except ConfigError as exc:
        text = str(exc)
        name = "--spec-tokens" if text.startswith("k=") else "--draft-model" if "draft model" in text else "--speculative"
        raise ConfigError(f"{name}: {text}") from None


def engine_config(args) -> EngineConfig:
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, cache=cache_config(args),
                        speculative=speculative_config(args), prefill=args.prefill, activations=args.activations)


def sampling_params(args) -> SamplingParams:
    """The chat options as SamplingParams; a bad value is a ConfigError naming the option (main prints it)."""
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_new_tokens=args.max_new_tokens, repetition_penalty=args.repetition_penalty,
                              seed=args.seed)
    except ConfigError as exc:
        name, _, advice = str(exc).partition("=")
        raise ConfigError(f"--{name.replace('_', '-')} {advice}") from None


