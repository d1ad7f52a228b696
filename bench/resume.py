"""`kvchat bench resume`: reopening a long conversation, its saved cache read back against its text read again.

A conversation of about --tokens tokens (filler turns in the model's chat template, then one real turn) is built
once per cache mode and saved (engine/runtime/warm.py). Each run then reopens it in a fresh session, as the app
does after a restart, and times the first new token of the next message two ways, interleaved:
- `reread`: the history is read again (prefix cache off: nothing of it is in memory);
- `restore`: the saved file is read back into the pool, then only the new message is read.
Beside them, where llama-cpp-python is importable: llama.cpp's own state file on the same GGUF and the same
token ids (`llama_state_save_file` / `llama_state_load_file`, what its server's slot save / restore uses), timed
the same way: load the file, read the same new message's token ids (the chat template's around it, as kvchat reads
them), one token; with and without flash attention, the faster counted (bench/llamacpp.py). The file sits in the OS
page cache for both
(a restart on the same machine); a cold disk adds its read time to both.

Reported per mode: medians with min/max, `ratio_restore_vs_reprefill` (bar <= 0.1) and
`ratio_restore_vs_llamacpp` (bar <= 1.0), and file bytes per token beside llama.cpp's.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

from kvchat.bench import llamacpp
from kvchat.engine.config import CacheConfig, EngineConfig, SamplingParams

MODES = {
    "auto": CacheConfig(),
    "bf16": CacheConfig(k_format="bf16", v_format="bf16"),
    "int8": CacheConfig(k_format="int8", v_format="int8"),
    "int4": CacheConfig(k_format="int4", v_format="int4"),
}
FILLER = ("The harbour was quiet that morning. Boats rocked against the pier while gulls argued over the nets. "
          "An old sailor mended a sail and told anyone who passed about the storm of his youth. ")
ONE = SamplingParams(temperature=0, max_new_tokens=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="default, a .gguf or HF folder, or preset:NAME:TYPE[:LAYERS]")
    parser.add_argument("--tokens", type=int, default=4000, help="conversation length in tokens")
    parser.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=["auto", "bf16", "int8"],
                        help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--llamacpp", choices=["auto", "no"], default="auto")


def conversation(tokenizer, tokens: int) -> list[dict]:
    """Filler turns until the rendered chat holds about `tokens` tokens."""
    from kvchat.engine.text.chat_format import encode_conversation
    messages: list[dict] = []
    turn = 0
    while True:
        rendered, _ = encode_conversation(tokenizer, None, messages)
        if len(tokenizer.encode(rendered, add_special_tokens=False)) >= tokens:
            return messages
        messages += [{"role": "user", "content": f"Part {turn}. " + FILLER * 3},
                     {"role": "assistant", "content": f"Noted part {turn}. " + FILLER * 2}]
        turn += 1


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _first_token_s(session, text: str) -> float:
    started = time.perf_counter()
    for _ in session.send(text, ONE):
        pass
    return time.perf_counter() - started


def _measure_mode(engine, name: str, cache: CacheConfig, history: list[dict], runs: int, llms: dict) -> dict:
    # the conversation as the app leaves it: history read, one more turn answered, then saved
    base = engine.new_session(cache=cache, history=history, prefix_cache=False)
    engine.keep_warm(base, f"bench-{name}")
    for _ in base.send("Summarise the story so far in one line.", SamplingParams(temperature=0, max_new_tokens=16)):
        pass
    saved_bytes = engine.save_warm(base)
    ids, messages, held = list(base.token_ids), list(base.messages), base.seq.num_tokens
    base.close()
    reread, restore, restore_only, peer = [], [], [], {}
    question = "And what did the sailor say next?"
    for _ in range(runs):
        engine.clear_prefix_cache()
        s = engine.new_session(cache=cache, history=messages, prefix_cache=False)
        reread.append(_first_token_s(s, question))
        s.close()
        engine.clear_prefix_cache()
        s = engine.new_session(cache=cache, history=messages, prefix_cache=False)
        engine.keep_warm(s, f"bench-{name}")
        started = time.perf_counter()
        got = engine.restore_warm(s)
        restore_only.append(time.perf_counter() - started)
        for _ in s.send(question, ONE):
            pass
        restore.append(time.perf_counter() - started)
        assert got.tokens == held
        message = s.token_ids[held:held + s.turn_times.prefill_tokens]
        s.close()
        for fa, llm in (llms or {}).items():
            peer.setdefault(fa, []).append(llm.resume_s(ids[:held], message))
    out = {"tokens": held, "file_bytes": saved_bytes, "file_bytes_per_token": saved_bytes / held,
           "reread_s": _spread(reread), "restore_s": _spread(restore), "restore_read_s": _spread(restore_only),
           "ratio_restore_vs_reprefill": statistics.median(restore) / statistics.median(reread)}
    if peer:
        fa, best = llamacpp.fastest(peer)
        out["message_tokens"] = len(message)
        out["llamacpp_restore_s"] = _spread(best)
        out["llamacpp_config"] = llamacpp.label(fa)
        out["llamacpp_by_config"] = {llamacpp.label(k): _spread(v) for k, v in peer.items()}
        out["llamacpp_state_bytes_per_token"] = llms[fa].state_bytes / held
        out["ratio_restore_vs_llamacpp"] = statistics.median(restore) / statistics.median(best)
    return out


class LlamaCppState:
    """llama.cpp's state file on the same GGUF: save once, then load + the new message + one token, timed."""

    def __init__(self, path: str, threads: int, n_ctx: int, flash_attn: bool):
        import llama_cpp
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, flash_attn=flash_attn, verbose=False)
        self.file = Path(tempfile.mkdtemp(prefix="kvchat-llamacpp-")) / "state.bin"
        self.saved_for: tuple | None = None
        self.state_bytes = 0

    def resume_s(self, ids: list[int], new: list[int]) -> float:
        lib, llm = self.lib, self.llm
        if self.saved_for != tuple(ids):
            llm.reset()
            llm.eval(ids)
            arr = (lib.llama_token * len(ids))(*ids)
            if not lib.llama_state_save_file(llm._ctx.ctx, str(self.file).encode(), arr, len(ids)):
                raise RuntimeError("llama.cpp could not save its state")
            self.saved_for, self.state_bytes = tuple(ids), self.file.stat().st_size
        llm.reset()
        cap = len(ids) + 8
        out, n_out = (lib.llama_token * cap)(), ctypes.c_size_t(0)
        started = time.perf_counter()
        if not lib.llama_state_load_file(llm._ctx.ctx, str(self.file).encode(), out, cap, ctypes.byref(n_out)):
            raise RuntimeError("llama.cpp could not load its state")
        n = n_out.value
        llm.input_ids[:n] = out[:n]
        llm.n_tokens = n
        llm.eval(new)
        import numpy as np
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        int(logits.argmax())            # the first new token
        return time.perf_counter() - started


def run(args) -> dict:
    import torch
    from kvchat.bench.models import resolve_model
    from kvchat.engine import Engine
    from kvchat.engine.model.source import locate
    from kvchat.engine.runtime.warm import WarmStore
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    spec = resolve_model(args.model)
    engine = Engine.load(EngineConfig(model=spec, num_threads=threads))
    engine._warm_store = WarmStore(Path(tempfile.mkdtemp(prefix="kvchat-bench-resume-")), 1 << 20)
    engine.runner.set_budget(max(engine.budget_mb, 4096))
    history = conversation(engine.tokenizer, args.tokens)
    files = locate(spec)
    llms = {}
    if args.llamacpp == "auto" and files.is_gguf:
        try:
            llms = {fa: LlamaCppState(str(files.path), threads, args.tokens + 512, fa)
                    for fa in llamacpp.configurations(llamacpp.F16)}
        except ImportError:
            llms = {}
    result = {"model": engine.model_name, "weights": engine.weights_label, "threads": threads,
              "llamacpp": bool(llms), "modes": {}}
    for name in args.modes:
        result["modes"][name] = _measure_mode(engine, name, MODES[name], history, args.runs, llms)
        result["modes"][name]["cache"] = MODES[name].label()
    engine.warm_store.clear()
    return result


def summarize(r: dict) -> str:
    lines = [f"{r['model']} ({r['weights']}), {r['threads']} threads: first new token after reopening"]
    for name, m in r["modes"].items():
        line = (f"  {m['cache']:<28} {m['tokens']:>5} tokens: restore {m['restore_s']['median']:.2f} s "
                f"(file {m['restore_read_s']['median']:.2f} s) vs read again {m['reread_s']['median']:.2f} s = "
                f"{m['ratio_restore_vs_reprefill']:.3f}x; file {m['file_bytes_per_token'] / 1024:.1f} KiB/token")
        if "ratio_restore_vs_llamacpp" in m:
            line += (f"; llama.cpp state {m['llamacpp_restore_s']['median']:.2f} s ({m['llamacpp_config']}), "
                     f"{m['llamacpp_state_bytes_per_token'] / 1024:.1f} KiB/token = "
                     f"{m['ratio_restore_vs_llamacpp']:.2f}x")
        lines.append(line)
    return "\n".join(lines)
