"""`kvchat bench memory`: bytes the KV cache holds per token in each format, from the tensors held.

For each mode it fills a conversation's cache with --tokens tokens (K and V written through the cache
exactly as the model writes them; the values do not change the bytes), a block table per KV group
of the model (kv/layout.kv_groups: a hybrid model's sliding layers keep their window only), and reads
back the bytes of every page tensor and full-precision block, per layer. Reported per mode: bytes per token of the
pages (data + scales + zero points, the steady state), the metadata's share, the fixed
full-precision blocks of quantized components (the block being filled and the first block), the
ratio to fp16, and a check that the bytes held equal `kernels.bytes_per_block` times the blocks
held plus those fixed blocks.
"""
from __future__ import annotations

import argparse

import torch

from kvchat.engine.config import CacheConfig
from kvchat.engine.kv.layout import conversation_bytes, kv_groups
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.sequence import Sequence

MODES = {
    "fp32": CacheConfig(k_format="fp32", v_format="fp32"),
    "fp16": CacheConfig(k_format="fp16", v_format="fp16"),
    "bf16": CacheConfig(k_format="bf16", v_format="bf16"),
    "int8": CacheConfig(k_format="int8", v_format="int8"),
    "int8-token": CacheConfig(k_format="int8", v_format="int8", k_scheme="token"),
    "fp8": CacheConfig(k_format="fp8", v_format="fp8"),
    "fp8-token": CacheConfig(k_format="fp8", v_format="fp8", k_scheme="token"),
    "int4": CacheConfig(k_format="int4", v_format="int4"),
    "int4-token": CacheConfig(k_format="int4", v_format="int4", k_scheme="token"),
    "k-int8-v-int4": CacheConfig(k_format="int8", v_format="int4"),
    "int4-fp-layers-0-1": CacheConfig(k_format="int4", v_format="int4", full_precision_layers=(0, 1)),
}
TARGETS = {"int8": 0.57, "fp8": 0.57, "int4": 0.35}   # page bytes per token over fp16's, at most


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="default, a local HF folder, or a .gguf file")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens written into each cache")
    parser.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES),
                        help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--block-size", type=int, default=16)


def _model_config(model: str):
    from kvchat.engine.runtime.engine import read_model_config
    return read_model_config(model)


def fill(cache: KVCache, seq: Sequence, num_tokens: int, seed: int = 0) -> None:
    """Write num_tokens of random K/V into every layer of seq (one group's sequence), through the pages' own write
    paths."""
    layout = seq.layout
    gen = torch.Generator().manual_seed(seed)
    done = 0
    while done < num_tokens:
        n = min(layout.block_size * 8, num_tokens - done)
        res = cache.reserve(seq, n, set())
        table = torch.tensor(seq.block_table, dtype=torch.long)
        slots = torch.arange(res.first_slot, res.first_slot + n)
        rows = table[slots // layout.block_size] * layout.block_size + slots % layout.block_size
        for pair in cache.components(layout):
            for comp in pair:
                x = torch.randn(n, layout.num_kv_heads, layout.head_dim, generator=gen)
                if comp.fmt.is_quantized:
                    comp.write(seq.seq_id, x, res.first_slot, seq.block_table)
                else:
                    comp.write_rows(x, rows)
        cache.commit(res, None)
        done += n


def measure(model_cfg, config: CacheConfig, num_tokens: int, model_dtype: str = "fp32") -> dict:
    cache = KVCache("cpu", 1 << 40)
    groups = kv_groups(model_cfg, config, model_dtype, "cpu")
    members = cache.open(groups).members
    for seq in members:
        fill(cache, seq, num_tokens)
    m = model_cfg
    blocks = len(members[0].block_table)      # the conversation's tokens: its first group keeps the most
    rows: dict[int, dict] = {}
    pages_total, tails_total, meta_total = 0, 0, 0
    for group, seq in zip(groups, members):
        for layer, pair in zip(group.layers, cache.components(seq.layout)):
            row = rows[layer] = {"layer": layer}
            for role, comp in zip(("k", "v"), pair):
                # bytes of the rows this group's blocks use in each page tensor, read from the tensors
                pages = {name: t[0].numel() * t.element_size() * len(seq.block_table) for name, t in comp.pages.items()}
                tail = sum(t.numel() * t.element_size() for t in (*comp.tails.values(), *comp.heads.values()))
                row[role] = {"format": comp.fmt.label, "bytes": sum(pages.values()) + tail, "data": pages["data"],
                             "scale": pages.get("scale", 0), "zero": pages.get("zero", 0), "tail": tail}
                pages_total += sum(pages.values())
                meta_total += pages.get("scale", 0) + pages.get("zero", 0)
                tails_total += tail
    layers = [rows[i] for i in sorted(rows)]
    blocks_bytes = sum(len(seq.block_table) * seq.layout.block_bytes for seq in members)
    fp16_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
    page_per_token = pages_total / (blocks * config.block_size)
    held = pages_total + tails_total
    return {
        "label": config.label(),
        "tokens": num_tokens,
        "blocks": blocks,
        "kv_bytes": held,
        "storage_bytes": cache.storage_bytes(),
        "page_bytes": pages_total,
        "metadata_bytes": meta_total,
        "tail_bytes": tails_total,
        "bytes_per_token": page_per_token,
        "bytes_per_token_per_layer": page_per_token / m.num_layers,
        "metadata_per_token": meta_total / (blocks * config.block_size),
        "metadata_fraction_of_fp16": meta_total / (blocks * config.block_size) / fp16_per_token,
        "ratio_to_fp16": page_per_token / fp16_per_token,
        "ratio_to_fp16_with_tail": held / (num_tokens * fp16_per_token),
        "matches_bytes_per_block": pages_total == blocks_bytes and held == conversation_bytes(m, config, num_tokens,
                                                                                          model_dtype, "cpu"),
        "per_layer": layers,
    }


def run(args) -> dict:
    model_cfg = _model_config(args.model)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    m = model_cfg
    result = {
        "model": args.model,
        "layers": m.num_layers, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "block_size": args.block_size,
        "fp16_bytes_per_token": 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2,
        "fixed_blocks": "quantized components hold two full-precision blocks (the block being filled and the "
                        "first block) in 16 bits (bf16 on the CPU, the model dtype on CUDA)",
        "modes": {},
    }
    for name in args.modes:
        config = MODES[name].with_(block_size=args.block_size)
        if any(i >= m.num_layers for i in config.full_precision_layers):
            continue
        result["modes"][name] = measure(m, config, args.tokens)
    checks = {}
    for name, limit in TARGETS.items():
        if name in result["modes"]:
            checks[f"{name} <= {limit}x fp16"] = result["modes"][name]["ratio_to_fp16"] <= limit
    checks["bytes held == bytes_per_block x blocks"] = all(r["matches_bytes_per_block"] for r in result["modes"].values())
    result["checks"] = checks
    return result


def summarize(result: dict) -> str:
    lines = [f"{result['model']}: {result['layers']} layers x {result['kv_heads']} KV heads x {result['head_dim']}, "
             f"block {result['block_size']}; fp16 = {result['fp16_bytes_per_token']:,} B/token",
             f"{'mode':<20}{'B/token':>9}{'per layer':>10}{'x fp16':>8}{'metadata':>10}{'meta/fp16':>10}{'fixed fp B':>12}"]
    for name, r in result["modes"].items():
        lines.append(f"{name:<20}{r['bytes_per_token']:>9.0f}{r['bytes_per_token_per_layer']:>10.1f}"
                     f"{r['ratio_to_fp16']:>8.3f}{r['metadata_per_token']:>10.1f}{r['metadata_fraction_of_fp16']:>10.2%}"
                     f"{r['tail_bytes']:>12,}")
    for what, ok in result["checks"].items():
        lines.append(f"{'PASS' if ok else 'FAIL'}  {what}")
    return "\n".join(lines)
