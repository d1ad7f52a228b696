"""`kvchat bench speed --device cuda`: the GPU path against the GPU's own copy bandwidth and transformers.

Decode and prefill tok/s of one model on the GPU path (packed weights through the Triton matmul, paged decode
attention through Triton), the weight and KV bytes a decode step reads, and what that makes in GB/s beside a
device-to-device copy measured in the same run (the bandwidth bound: a decode step must read every weight byte
and the KV once). transformers' `generate()` on the same weights in bf16 runs beside it, interleaved. A
micro-benchmark reads 32k tokens of bf16 KV through the Triton decode attention and compares its bandwidth with
the copy's. On a machine without a GPU, `--device cpu` with KVCHAT_GPU_PATH=interpret and TRITON_INTERPRET=1 runs
the same code under triton's interpreter (a smoke check of this script, its numbers mean nothing).
"""
from __future__ import annotations

import statistics
import time

import torch

from kvchat.engine.units import MIB


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_gbs(device, mb: int = 1024) -> float:
    """Bytes read + written per second by a device-to-device copy of mb MiB (best of 10)."""
    src = torch.ones(mb * MIB // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def time_engine(engine, ids: list[int], new_tokens: int) -> dict:
    """A prompt in one step, then new_tokens greedy decode steps; the argmax stays on the device until the end of
    each step (one small copy back, as a chat needs the token)."""
    runner, device = engine.runner, engine.runner.device
    seq = runner.new_sequence(engine.config.cache)
    try:
        sync(device)
        t0 = time.perf_counter()
        nxt = int(runner.step([(seq, ids)])[0][-1].argmax())
        sync(device)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            nxt = int(runner.step([(seq, [nxt])])[0][-1].argmax())
        sync(device)
        t2 = time.perf_counter()
        kv = runner.held_bytes
    finally:
        runner.close(seq)
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": (new_tokens - 1) / (t2 - t1),
            "ttft_s": t1 - t0, "kv_bytes_at_end": kv}


def time_transformers(model, ids: list[int], new_tokens: int, device) -> dict:
    x = torch.tensor([ids], device=device)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        sync(device)
        t1 = time.perf_counter()
        model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        sync(device)
        t2 = time.perf_counter()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": (new_tokens - 1) / max(1e-9, (t2 - t1) - (t1 - t0)),
            "ttft_s": t1 - t0}


def attention_bandwidth(device, tokens: int = 32768, kv_heads: int = 8, heads: int = 32, head_dim: int = 128,
                        runs: int = 20, fmt: str = "bf16") -> dict:
    """The Triton decode attention over `tokens` rows of K and V pages for one sequence (bf16, or a quantized format
    read in place): GB/s of KV bytes read (scales and zero points included)."""
    from kvchat.kernels.formats import bytes_per_block, page_format
    from kvchat.kernels.triton_attention import bench_decode_full
    seconds = bench_decode_full(device, tokens, kv_heads, heads, head_dim, runs, sync, fmt)
    blocks = -(-tokens // 16)
    kv_bytes = sum(bytes_per_block(page_format(fmt, role), 16, kv_heads, head_dim) for role in "kv") * blocks
    return {"format": fmt, "tokens": tokens, "kv_bytes": kv_bytes, "seconds": seconds, "gbs": kv_bytes / seconds / 1e9}


def _median(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def run(args) -> dict:
    from kvchat.bench.models import model_path, prompt_ids, resolve_model
    from kvchat.engine.config import CacheConfig, EngineConfig
    from kvchat.engine.runtime.engine import Engine, load_transformers_reference

    device = args.device
    spec = resolve_model(args.model)
    engine = Engine.load(EngineConfig(model=spec, device=device, cache=CacheConfig(budget_mb=4096)))
    ids = prompt_ids(engine.tokenizer, args.prompt_tokens)
    sides = {"kvchat": lambda: time_engine(engine, ids, args.new_tokens)}
    want_hf = args.transformers == "yes" or (args.transformers == "auto" and args.model == "default")
    if want_hf:
        try:
            ref = load_transformers_reference(spec, torch.bfloat16).to(device).eval()
            sides["transformers"] = lambda: time_transformers(ref, ids, args.new_tokens, device)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot load is reported, the rest still runs
            print(f"transformers peer unavailable: {exc}")
    time_engine(engine, ids[:32], 4)                       # warm: compile every kernel once
    if "transformers" in sides:
        time_transformers(ref, ids[:32], 4, device)
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in range(args.runs):                             # interleaved
        for name, f in sides.items():
            runs[name].append(f())
    weight_bytes = engine.model.weight_bytes()
    file_path = model_path(spec)
    result = {"model": engine.model_name, "path": file_path, "device": device,
              "gpu": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "none",
              "weights": engine.model.weights, "quant": engine.model.quant, "weight_bytes": weight_bytes,
              "file_tensor_bytes": _file_tensor_bytes(file_path), "prompt_tokens": len(ids),
              "new_tokens": args.new_tokens, "runs": args.runs,
              "copy_gbs": copy_bandwidth_gbs(device, 64 if device == "cpu" else 1024)}
    for name, r in runs.items():
        result[name] = _median(r)
        result[f"{name}_spread"] = {k: [min(x[k] for x in r), max(x[k] for x in r)]
                                    for k in ("decode_tok_s", "prefill_tok_s")}
    k = result["kvchat"]
    step_bytes = weight_bytes + k["kv_bytes_at_end"] / 2           # the KV grows over the reply: its mean
    result["decode_gbs"] = step_bytes * k["decode_tok_s"] / 1e9
    result["bound_tok_s"] = result["copy_gbs"] * 1e9 / step_bytes
    result["ratio_decode_vs_bound"] = k["decode_tok_s"] / result["bound_tok_s"]
    if result["file_tensor_bytes"]:
        result["ratio_weights_vs_file"] = weight_bytes / result["file_tensor_bytes"]
    if "transformers" in result:
        result["ratio_decode_vs_transformers"] = k["decode_tok_s"] / result["transformers"]["decode_tok_s"]
        result["ratio_prefill_vs_transformers"] = k["prefill_tok_s"] / result["transformers"]["prefill_tok_s"]
    if not args.no_attention:
        tokens = 32768 if torch.device(device).type == "cuda" else 256
        att = attention_bandwidth(device, tokens, runs=20 if tokens > 256 else 2)
        result["attention"] = att
        result["ratio_attention_vs_copy"] = att["gbs"] / result["copy_gbs"]
        q8 = attention_bandwidth(device, tokens, runs=20 if tokens > 256 else 2, fmt="int8")
        result["attention_int8"] = q8
        result["ratio_attention_int8_vs_bf16_time"] = q8["seconds"] / att["seconds"]
    if torch.device(device).type == "cuda":
        result["torch_allocated_bytes"] = torch.cuda.memory_allocated()
        result["torch_peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def _file_tensor_bytes(path: str) -> int | None:
    if not path.endswith(".gguf"):
        return None
    from kvchat.engine.gguf.file import GGUFFile
    return sum(t.n_bytes for t in GGUFFile(path).tensors.values())
