"""`kvchat bench speed`: prefill / decode tok/s and TTFT, kvchat against transformers generate().

Both run the same weights on the same prompt; runs are interleaved and medians reported, so a
noisy machine moves both sides alike. Load time is measured cold (empty conversion cache, in a
subprocess) and warm.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

FALLBACK_TEXT = ("The library was quiet in the early morning, and the reading room smelled of old paper and "
                 "floor polish. ")


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-load", action="store_true", help="skip the cold/warm load-time measurement")
    p.add_argument("--long-context", action="store_true",
                   help="also measure decode with 4,096 tokens cached against 256 (kvchat only)")


def prompt_ids(tokenizer, n: int) -> list[int]:
    try:
        from .texts import load_text
        text = load_text("prose")
    except Exception:
        text = FALLBACK_TEXT * 200
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _time_kvchat(engine, ids: list[int], new_tokens: int) -> dict:
    session = engine.new_session()
    t0 = time.perf_counter()
    logits = session.append(ids, all_logits=False)[-1]
    nxt = int(logits.argmax())
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        nxt = int(session.append([nxt], all_logits=False)[-1].argmax())
    t2 = time.perf_counter()
    session.reset()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": (new_tokens - 1) / (t2 - t1), "ttft_s": t1 - t0}


def _time_transformers(model, ids: list[int], new_tokens: int) -> dict:
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = time.perf_counter()
    ttft = t1 - t0
    return {"prefill_tok_s": len(ids) / ttft, "decode_tok_s": (new_tokens - 1) / max(1e-9, (t2 - t1) - ttft),
            "ttft_s": ttft}


def _load_time(model: str, cold: bool) -> float:
    env = dict(os.environ)
    code = ("import time; t=time.perf_counter(); from engine import Engine, EngineConfig; "
            f"Engine.load(EngineConfig(model={model!r})); print(time.perf_counter()-t)")
    with tempfile.TemporaryDirectory() as tmp:
        if cold:
            env["KVCHAT_CACHE_DIR"] = tmp
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _decode_by_context(engine, runs: int, steps: int = 32) -> dict:
    """Decode tok/s with 256 and 4,096 tokens already cached (interleaved), and their ratio."""
    try:
        from .texts import load_tokens
        ids = load_tokens(engine.tokenizer, "stream", 4096 + steps)
    except Exception:
        ids = prompt_ids(engine.tokenizer, 4096 + steps)
    speeds: dict[int, list[float]] = {256: [], 4096: []}
    for _ in range(runs):
        for n in speeds:
            session = engine.new_session()
            session.append(ids[:n], all_logits=False)
            t0 = time.perf_counter()
            for i in range(steps):
                session.append([ids[n + i]], all_logits=False)
            speeds[n].append(steps / (time.perf_counter() - t0))
            session.reset()
    at = {n: statistics.median(v) for n, v in speeds.items()}
    return {"decode_tok_s_at_256": at[256], "decode_tok_s_at_4096": at[4096], "ratio_4096_vs_256": at[4096] / at[256]}


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from .config import EngineConfig
    from .engine import Engine
    from .loader import locate

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(model=args.model, device="cpu", dtype=args.dtype))        # weights="auto"
    dense = engine if engine.model.weights == "dense" else \
        Engine.load(EngineConfig(model=args.model, device="cpu", dtype=args.dtype, weights="dense"))
    hf_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    ref = AutoModelForCausalLM.from_pretrained(str(locate(args.model).folder), dtype=hf_dtype)
    ids = prompt_ids(engine.tokenizer, args.prompt_tokens)
    _time_kvchat(engine, ids[:64], 4)           # warm up every path
    _time_kvchat(dense, ids[:64], 4)
    _time_transformers(ref, ids[:64], 4)
    ours, ours_dense, theirs = [], [], []
    for _ in range(args.runs):                  # interleaved
        theirs.append(_time_transformers(ref, ids, args.new_tokens))
        ours.append(_time_kvchat(engine, ids, args.new_tokens))
        if dense is not engine:
            ours_dense.append(_time_kvchat(dense, ids, args.new_tokens))
    result = {
        "model": engine.model_name,
        "device": "cpu",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "weights": engine.model.weights,
        "kvchat": {k: _median(ours, k) for k in ("prefill_tok_s", "decode_tok_s", "ttft_s")},
        "transformers": {k: _median(theirs, k) for k in ("prefill_tok_s", "decode_tok_s", "ttft_s")},
    }
    result["ratio_decode_vs_transformers"] = result["kvchat"]["decode_tok_s"] / result["transformers"]["decode_tok_s"]
    result["ratio_prefill_vs_transformers"] = result["kvchat"]["prefill_tok_s"] / result["transformers"]["prefill_tok_s"]
    if ours_dense:
        result["kvchat_dense_weights"] = {k: _median(ours_dense, k) for k in ("prefill_tok_s", "decode_tok_s", "ttft_s")}
        result["ratio_decode_dense_vs_transformers"] = (result["kvchat_dense_weights"]["decode_tok_s"]
                                                        / result["transformers"]["decode_tok_s"])
    if getattr(args, "long_context", False):
        result["decode_by_context"] = _decode_by_context(engine, args.runs)
    if not args.no_load:
        result["load_s_cold"] = _load_time(args.model, cold=True)
        result["load_s_warm"] = statistics.median(_load_time(args.model, cold=False) for _ in range(3))
    return result


def summarize(r: dict) -> str:
    k, t = r["kvchat"], r["transformers"]
    lines = [f"{r['model']} on {r['device']} ({r['dtype']}), {r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens, "
             f"median of {r['runs']} interleaved runs",
             f"  kvchat ({r['weights']:5s}) prefill {k['prefill_tok_s']:7.1f} tok/s  decode {k['decode_tok_s']:6.1f} tok/s  TTFT {k['ttft_s'] * 1000:6.0f} ms",
             *([f"  kvchat (dense) prefill {r['kvchat_dense_weights']['prefill_tok_s']:7.1f} tok/s  decode "
                f"{r['kvchat_dense_weights']['decode_tok_s']:6.1f} tok/s  TTFT {r['kvchat_dense_weights']['ttft_s'] * 1000:6.0f} ms"]
               if "kvchat_dense_weights" in r else []),
             f"  transformers   prefill {t['prefill_tok_s']:7.1f} tok/s  decode {t['decode_tok_s']:6.1f} tok/s  TTFT {t['ttft_s'] * 1000:6.0f} ms",
             f"  decode ratio {r['ratio_decode_vs_transformers']:.2f}x, prefill ratio {r['ratio_prefill_vs_transformers']:.2f}x"]
    if "decode_by_context" in r:
        c = r["decode_by_context"]
        lines.append(f"  decode with 4,096 cached: {c['decode_tok_s_at_4096']:.1f} tok/s, with 256: "
                     f"{c['decode_tok_s_at_256']:.1f} tok/s ({c['ratio_4096_vs_256']:.2f}x)")
    if "load_s_cold" in r:
        lines.append(f"  load: cold {r['load_s_cold']:.1f} s (GGUF conversion), warm {r['load_s_warm']:.1f} s")
    return "\n".join(lines)
