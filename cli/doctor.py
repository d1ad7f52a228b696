"""`kvchat doctor`: which kernels run here and why, on which device, and what the machine offers; with --model,
how that model's rotary embedding runs under the cache options (LongRoPE: which factors, and why)."""
from __future__ import annotations

import json
import os
import platform


def _gpus() -> list[str]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVIDIA driver is the common case, not an error
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            out.append(f"{name.decode() if isinstance(name, bytes) else name}, {mem / 2**30:.1f} GiB")
        return out
    finally:
        pynvml.nvmlShutdown()


def report() -> dict:
    import psutil
    from kvchat.kernels import cpu_lib, cpu_quant
    kernels = cpu_lib.status()
    kv = cpu_quant.kv_kernels_ready(wait=True) if kernels["loaded"] else False
    try:
        import torch
        cuda = torch.cuda.is_available()
        torch_info = {"version": torch.__version__, "cuda": cuda, "threads": torch.get_num_threads()}
    except ImportError:
        cuda, torch_info = False, None
    if torch_info:                  # Zen 4: the prompts' precision measured once (here or by the engine), kept
        from kvchat.engine.runtime.engine import measure_prefill_once
        measure_prefill_once()
    return {
        "kernels": {**kernels, "kv_kernels": kv, "kv_error": None if kv else cpu_quant._kv_error,
                    "fallback": None if kernels["loaded"] else "torch's kernels (correct, several times slower)"},
        "device": "cuda" if cuda else "cpu",
        "cpu": {"name": cpu_lib.cpu_name(), "machine": platform.machine(), "cores": os.cpu_count(),
                "features": kernels["cpu_features"]},
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": _gpus(),
        "torch": torch_info,
        "prefill": dict(zip(("auto", "why"), cpu_lib.auto_prefill())),
    }


def advice(r: dict) -> list[str]:
    k = r["kernels"]
    out = []
    if not k["loaded"]:
        out.append(f"C kernels not loaded ({k['error']}): install a C compiler (gcc or clang) and run "
                   "`python -m kernels.cpu_quant`, or use a build of kvchat that ships them")
    elif k["variant"] == "baseline" and "avx512" in k["variants"] and not os.environ.get("KVCHAT_CPU_VARIANT"):
        out.append("this CPU lacks AVX2, FMA or F16C: the baseline kernels decode several times slower")
    if k["loaded"] and not k["openmp"]:
        out.append("the kernels were built without OpenMP: they run on one thread (install libomp, then "
                   "`python -m kernels.cpu_quant`)")
    if k["loaded"] and not k["kv_kernels"]:
        out.append(f"the quantized-KV kernels did not build ({k['kv_error']}): int8 / fp8 / int4 caches decode "
                   "through torch")
    return out


def rope(args) -> str:
    """How --model's rotary embedding runs under the cache options: which LongRoPE factors their context takes (as
    the engine takes them at load, Engine.rope_note), or that it has one set."""
    from kvchat.engine.config import CacheConfig
    from kvchat.engine.kv.layout import cache_context
    from kvchat.engine.runtime.engine import read_model_config, resolve_device
    mc = read_model_config(args.model)
    cache = CacheConfig(k_format=args.k_format, v_format=args.v_format, window=args.window, sinks=args.sinks,
                        budget_mb=args.budget_mb)
    device = resolve_device("auto")
    context = cache_context(mc, cache, "fp32" if device == "cpu" else "bf16", device)
    return mc.rope_note(context) or f"one set of rotary frequencies at every length (a context of {context:,} tokens)"


def text(r: dict) -> str:
    k, cpu = r["kernels"], r["cpu"]
    lines = [f"CPU        {cpu['name']} ({cpu['machine']}, {cpu['cores']} cores, {r['memory_gib']} GiB)",
             f"features   {', '.join(cpu['features']) or 'none of AVX / AVX2 / AVX-512'} (CPUID)"]
    if k["loaded"]:
        lines.append(f"kernels    {k['variant']} build: {k['why']} (variants here: {', '.join(k['variants'])})")
        lines.append(f"           {k['build']}")
        lines.append(f"KV kernels {'loaded' if k['kv_kernels'] else 'not loaded'}")
        path = "int8 rows" if r["prefill"]["auto"] == "int8" else f"{r['prefill']['auto']} GEMM"
        lines.append(f"prompts    {path} over packed weights by default: {r['prefill']['why']} "
                     "(--prefill fp32 | bf16 | int8)")
    else:
        lines.append(f"kernels    none: {k['error']}; running {k['fallback']}")
    lines += [f"skipped    {s}" for s in k["skipped"]]
    lines.append(f"device     {r['device']}" + (f" ({'; '.join(r['gpus'])})" if r["gpus"] else ""))
    if r["torch"]:
        lines.append(f"torch      {r['torch']['version']}, {r['torch']['threads']} threads")
    if r.get("rope"):
        lines.append(f"rope       {r['rope']}")
    lines += [f"note       {a}" for a in advice(r)]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    from kvchat.engine.config import CacheConfig
    cache = CacheConfig()
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default=None, help="also say how this model's rotary embedding runs under the "
                                                      "cache options below (LongRoPE: which factors)")
    parser.add_argument("--budget-mb", type=float, default=cache.budget_mb)
    parser.add_argument("--k-format", default=cache.k_format)
    parser.add_argument("--v-format", default=cache.v_format)
    parser.add_argument("--window", type=int, default=cache.window)
    parser.add_argument("--sinks", type=int, default=cache.sinks)


def cmd_doctor(args) -> int:
    r = report()
    if args.model:
        r["rope"] = rope(args)
    print(json.dumps({**r, "advice": advice(r)}, indent=2) if args.json else text(r))
    return 0
