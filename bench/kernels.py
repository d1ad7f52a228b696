"""`kvchat bench kernels`: Triton decode attention over paged K/V pages, measured on CUDA.

For each batch, context and cache format (kvchat's own K and V recipes) on a Llama-3-8B-like
attention layer (Hq 32, Hkv 8, head_dim 128, block 16) it reports the kernel time (CUDA events,
median), the bytes it must read, the achieved GB/s, that rate as a fraction of a device-to-device
copy measured in the same run, and the time with a shuffled block table over a contiguous one.

Copy bandwidth counts the bytes a copy moves (read + written, 2 x N for N bytes), the usual
definition, so the fraction compares the kernel's read rate with what the memory really sustains.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from kernels import bytes_per_block, page_format, triton_available

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
FORMATS = ("fp16", "bf16", "int8", "fp8", "int4")
TARGETS = {   # what an H100/H200 should reach; checked at the largest batch and context measured
    "fraction_of_copy_min": 0.65,
    "int8_over_fp16_max": 0.65,
    "int4_over_fp16_max": 0.45,
    "paged_over_contiguous_max": 1.15,
}
_STORE_CHUNK = 2048           # blocks quantized per store call while filling the cache
_L2_FLUSH_BYTES = 256 << 20   # larger than any L2, so no repeat reads warm pages from cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvchat bench kernels` (and of `python -m bench.kernels`)."""
    parser.add_argument("--batches", type=_int_list, default=[1, 64], help="comma-separated batch sizes")
    parser.add_argument("--contexts", type=_int_list, default=[1024, 8192], help="comma-separated context lengths")
    parser.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS), help="comma-separated formats")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per measurement (median reported)")
    if "--json" not in parser._option_string_actions:    # the CLI may already give every bench --json
        parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _median_ms(fn, repeats: int, flush: torch.Tensor) -> float:
    fn()                                                     # compile / warm up
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _pages(fmt, num_blocks: int, device) -> list:
    """Random K or V pages of one layer, quantized by the store kernel: [data, scale, zero]."""
    from kernels import store_blocks
    shapes = fmt.shapes(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    pages = {k: torch.empty((num_blocks, *shape), dtype=dtype, device=device) for k, (shape, dtype) in shapes.items()}
    for first in range(0, num_blocks, _STORE_CHUNK):
        ids = torch.arange(first, min(first + _STORE_CHUNK, num_blocks), dtype=torch.int32, device=device)
        src = torch.randn(len(ids), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16, device=device)
        store_blocks(src, ids, pages["data"], pages.get("scale"), pages.get("zero"), fmt)
    return [pages["data"], pages.get("scale"), pages.get("zero")]


def _measure(fmt_name: str, batch: int, context: int, repeats: int, flush: torch.Tensor, device) -> dict:
    from kernels import paged_decode_attention
    k_fmt, v_fmt = page_format(fmt_name, "k"), page_format(fmt_name, "v")
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_pages, v_pages = _pages(k_fmt, num_blocks, device), _pages(v_fmt, num_blocks, device)
    q_dtype = torch.bfloat16 if fmt_name == "bf16" else torch.float16
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=q_dtype, device=device)
    contiguous = torch.arange(num_blocks, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    shuffled = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    zeros = torch.zeros(batch, dtype=torch.int32, device=device)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)

    def attend(table):
        return lambda: paged_decode_attention(q, *k_pages, *v_pages, table, seq_lens, zeros, zeros, inv_freq,
                                              HEAD_DIM ** -0.5, k_fmt, v_fmt)

    paged_ms = _median_ms(attend(shuffled), repeats, flush)
    contiguous_ms = _median_ms(attend(contiguous), repeats, flush)
    page_bytes = num_blocks * (bytes_per_block(k_fmt, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
                               + bytes_per_block(v_fmt, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    bytes_read = page_bytes + q.numel() * q.element_size() + shuffled.numel() * 4
    src = torch.empty(bytes_read, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), repeats, flush)
    kernel_gbps = bytes_read / paged_ms / 1e6
    copy_gbps = 2 * bytes_read / copy_ms / 1e6
    del k_pages, v_pages, src, dst
    torch.cuda.empty_cache()
    return {
        "format": fmt_name, "k_format": k_fmt.label, "v_format": v_fmt.label,
        "batch": batch, "context": context, "bytes_read": bytes_read,
        "time_us": round(paged_ms * 1e3, 2), "time_contiguous_us": round(contiguous_ms * 1e3, 2),
        "gbps": round(kernel_gbps, 1), "copy_time_us": round(copy_ms * 1e3, 2), "copy_gbps": round(copy_gbps, 1),
        "fraction_of_copy": round(kernel_gbps / copy_gbps, 3),
        "paged_over_contiguous": round(paged_ms / contiguous_ms, 3),
    }


def _targets(results: list[dict]) -> dict:
    batch = max(r["batch"] for r in results)
    context = max(r["context"] for r in results)
    at = {r["format"]: r for r in results if r["batch"] == batch and r["context"] == context}
    checks = {"at": f"batch {batch} x context {context}"}

    def check(name, value, limit, is_min):
        checks[name] = {"value": round(value, 3), "target": limit, "met": value >= limit if is_min else value <= limit}

    for fmt, r in at.items():
        check(f"{fmt}_fraction_of_copy", r["fraction_of_copy"], TARGETS["fraction_of_copy_min"], True)
        check(f"{fmt}_paged_over_contiguous", r["paged_over_contiguous"], TARGETS["paged_over_contiguous_max"], False)
    for fmt in ("int8", "int4"):
        if fmt in at and "fp16" in at:
            check(f"{fmt}_over_fp16", at[fmt]["time_us"] / at["fp16"]["time_us"], TARGETS[f"{fmt}_over_fp16_max"], False)
    return checks


def run(args: argparse.Namespace) -> dict:
    """Measure every (batch, context, format); returns a JSON-ready dict. Needs CUDA and triton."""
    if not torch.cuda.is_available():
        raise SystemExit("kvchat bench kernels needs an NVIDIA GPU with CUDA; none found here")
    if not triton_available():
        raise SystemExit("kvchat bench kernels needs triton (pip install 'kvchat[triton]'); it does not import here")
    device = torch.device("cuda")
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    results = [_measure(fmt, batch, context, args.repeats, flush, device)
               for batch in args.batches for context in args.contexts for fmt in args.formats]
    for r in results:   # time relative to fp16 at the same batch and context
        base = next((x for x in results if x["format"] == "fp16" and x["batch"] == r["batch"]
                     and x["context"] == r["context"]), None)
        r["time_over_fp16"] = round(r["time_us"] / base["time_us"], 3) if base else None
    return {
        "device": torch.cuda.get_device_name(device),
        "shape": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE},
        "repeats": args.repeats,
        "results": results,
        "targets": _targets(results),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for r in report["results"]:
        print(f"{r['format']:>5} B={r['batch']:<3} T={r['context']:<5} {r['time_us']:>9.1f} us "
              f"{r['gbps']:>7.1f} GB/s  {r['fraction_of_copy']:.0%} of copy  paged/contig {r['paged_over_contiguous']:.2f}")
    for name, c in report["targets"].items():
        if isinstance(c, dict):
            print(f"{name}: {c['value']} (target {c['target']}) {'ok' if c['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
