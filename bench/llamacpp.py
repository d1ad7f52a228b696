"""llama.cpp as the peer of a cache benchmark: each configuration it may run a cache type in, the fastest counted.

With an f16 cache llama.cpp runs with or without flash attention, and which is faster depends on the CPU and the
length (on the AMX Xeon a 24-token message after 4,096 cached on the default model takes 0.17 s without it and
0.31 s with it). A benchmark that pinned one would flatter kvchat, so the f16 peer is timed both ways, interleaved,
and the faster median is the ratio's denominator; a quantized V (q8_0, q4_0) needs flash attention in llama.cpp, so
it has one configuration.
"""
from __future__ import annotations

import statistics

F16 = 1


def configurations(ggml_type: int) -> list[bool]:
    """The flash-attention settings llama.cpp can run this cache type with."""
    return [False, True] if ggml_type == F16 else [True]


def label(flash_attn: bool) -> str:
    return "flash attention" if flash_attn else "no flash attention"


def open_peers(path: str, threads: int, n_ctx: int, ggml_type: int) -> dict[bool, object]:
    """{flash_attn: Llama} for each configuration this build opens; empty when llama-cpp-python is missing."""
    peers = {}
    for fa in configurations(ggml_type):
        try:
            from llama_cpp import Llama
            peers[fa] = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, flash_attn=fa, type_k=ggml_type, type_v=ggml_type, verbose=False)
        except Exception:      # noqa: BLE001 - not installed, or this cache type not built in
            continue
    return peers


def fastest(times: dict[bool, list[float]], lower_is_better: bool = True) -> tuple[bool, list[float]]:
    """The configuration whose median is best, and its samples."""
    pick = min if lower_is_better else max
    fa = pick(times, key=lambda k: statistics.median(times[k]))
    return fa, times[fa]
