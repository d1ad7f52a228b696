"""`kvchat bench speed`: kvchat against llama.cpp (and transformers) on the same file.

Decode and prefill tok/s and TTFT in one process, runs interleaved, medians reported, so a noisy
machine moves every side alike. llama.cpp (llama-cpp-python, when importable) is timed with its
own eval loop: the prompt in one `eval`, then one token per `eval`, no Python sampling. Memory and
start time come from one-shot answers in fresh processes: `kvchat chat --prompt` (which answers
without torch where engine/runtime/quick.py covers the file) cold (empty cache dir) and warm, the Engine API
warm (torch and the whole engine), llama.cpp's chat completion; peak RSS, wall time, time from launch
to the first token printed. `--model preset:llama-3.2-1b:Q4_0` benchmarks a
random-weight GGUF of that shape, written once into the cache dir (bench/gguf_writer.py).

Past 450 lines on purpose: each side's timing loop stays beside the others, so they measure alike.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvchat.bench.models import FALLBACK_TEXT, model_path, prompt_ids, resolve_model  # noqa: F401 - used here and re-exported
from kvchat.engine.units import MIB
from kvchat.engine.runtime.sampling import greedy_id

ANSWER_PROMPT = "What is the capital of France?"


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="default, a .gguf or HF folder, or preset:NAME:TYPE[:LAYERS] "
                                                      "(e.g. preset:llama-3.2-1b:Q4_0, preset:gpt-oss-20b:MXFP4:4)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="threads for every side (default: all cores)")
    p.add_argument("--no-load", action="store_true", help="skip the fresh-process memory and start-time runs")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--transformers", choices=["auto", "yes", "no"], default="auto",
                   help="time transformers generate() too (auto: the default model only)")
    p.add_argument("--speculative", action="store_true",
                   help="decode with and without speculative decoding (and llama.cpp's prompt lookup) on three "
                        "prompts, instead of the rest (bench/speculative.py)")
    from kvchat.bench import speculative
    speculative.add_arguments(p)
    p.add_argument("--long-context", action="store_true",
                   help="also measure decode with 4,096 tokens cached against 256 (kvchat only)")
    p.add_argument("--regenerate", type=int, default=0, metavar="TOKENS",
                   help="also time a regenerate on a chat of TOKENS prompt tokens: kvchat forks from its cache (a "
                        "state model from its snapshot) against llama.cpp reading the prompt again")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: the GPU path against the copy bandwidth and "
                                                  "transformers (bench/gpu.py)")
    p.add_argument("--no-attention", action="store_true", help="with --device cuda: skip the 32k-token KV read")
    p.add_argument("--retrieval", type=int, default=None, metavar="K",
                   help="also decode reading K blocks a token (retrieval_blocks=K) beside the full cache, e.g. "
                        "--prompt-tokens 7000 --retrieval 64")
    p.add_argument("--int8-activations", action="store_true",
                   help="also decode with int8 activations (llama.cpp's own rounding, --activations int8) beside the "
                        "default int16, interleaved in the same process")
    p.add_argument("--attention", action="store_true",
                   help="also time kvchat measuring where attention goes (session.watch_attention), interleaved: "
                        "its cost against the plain runs")


def _time_kvchat(engine, ids: list[int], new_tokens: int, watch: str | None = None,
                 cache: CacheConfig | None = None) -> dict:
    session = engine.new_session(cache=cache)
    if watch:
        session.watch_attention(watch)
    t0 = time.perf_counter()
    nxt = greedy_id(session.append(ids, all_logits=False)[-1])       # the engine's own greedy pick, as a chat's
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        nxt = greedy_id(session.append([nxt], all_logits=False)[-1])
    t2 = time.perf_counter()
    held = session.stats()
    session.reset()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": (new_tokens - 1) / (t2 - t1), "ttft_s": t1 - t0,
            "kv_bytes": held.kv_bytes + held.summary_bytes}


def _with_activations(engine, mode: str, run):
    """run() with the engine's decode activations switched to mode, and back."""
    before = engine.activations
    engine.set_activations(mode)
    try:
        return run()
    finally:
        engine.set_activations(before)


def _time_llamacpp(llm, ids: list[int], new_tokens: int) -> dict:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    nxt = ids[-1]
    for _ in range(new_tokens - 1):    # fixed input token: the eval loop alone, no sampling
        llm.eval([nxt])
    t2 = time.perf_counter()
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


def _llamacpp(path: str, threads: int, n_ctx: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False)


# one-shot answers in fresh processes: what a user sees starting the app or `kvchat chat --prompt`
_PEAK = """
def peak_rss():   # VmHWM: ru_maxrss would carry the parent's peak across fork + exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""

_KVCHAT_ONESHOT = _PEAK + """
import json, sys, time
t0 = time.perf_counter()
from kvchat.engine import Engine, EngineConfig, SamplingParams
from kvchat.engine.events import TokenDelta
engine = Engine.load(EngineConfig(model=sys.argv[1], num_threads=int(sys.argv[2])))
loaded = time.perf_counter()
rss_load = peak_rss()
first = None
for ev in engine.new_session().send(sys.argv[3], SamplingParams(temperature=0.0, max_new_tokens=64)):
    if first is None and isinstance(ev, TokenDelta):
        first = time.perf_counter()
print(json.dumps({"load_s": loaded - t0, "first_token_s": (first or time.perf_counter()) - t0,
                  "wall_s": time.perf_counter() - t0, "peak_rss_after_load": rss_load,
                  "peak_rss": peak_rss(),
                  "weight_bytes": engine.model.weight_bytes()}))
"""

_LLAMACPP_ONESHOT = _PEAK + """
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), verbose=False)
loaded = time.perf_counter()
rss_load = peak_rss()
first = None
msgs = [{"role": "user", "content": sys.argv[3]}]
for chunk in llm.create_chat_completion(msgs, max_tokens=64, temperature=0.0, stream=True):
    if first is None and chunk["choices"][0]["delta"].get("content"):
        first = time.perf_counter()
print(json.dumps({"load_s": loaded - t0, "first_token_s": (first or time.perf_counter()) - t0,
                  "wall_s": time.perf_counter() - t0, "peak_rss_after_load": rss_load,
                  "peak_rss": peak_rss()}))
"""


def _oneshot(code: str, model: str, threads: int, cache_dir: str | None = None) -> dict:
    env = dict(os.environ)
    if cache_dir:
        env["KVCHAT_CACHE_DIR"] = cache_dir
    launched = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, model, str(threads), ANSWER_PROMPT], env=env,
                         capture_output=True, text=True, timeout=900)
    process_s = time.perf_counter() - launched
    if out.returncode:
        raise RuntimeError(f"one-shot run failed: {out.stderr.strip()[-600:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # from the launch of the process (interpreter start included) to the first token
    r["first_token_from_launch_s"] = process_s - (r["wall_s"] - r["first_token_s"])
    return r


def _cli_oneshot(model: str, threads: int, cache_dir: str | None = None) -> dict:
    """`kvchat chat --prompt` in a fresh process, greedy, 64 tokens: seconds from launch to the first byte printed,
    wall seconds, the process's peak RSS."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if cache_dir:
        env["KVCHAT_CACHE_DIR"] = cache_dir
    # the CLI's own main, then the process's peak RSS (VmHWM: a fork's rusage would count the parent's pages)
    code = _PEAK + ("import sys\nfrom kvchat.cli.main import main\nrc = main(sys.argv[1:])\n"
                    "sys.stderr.write(f'\\nkvchat-peak-rss {peak_rss()}\\n')\nsys.exit(rc)\n")
    cmd = [sys.executable, "-c", code, "chat", "--model", model, "--prompt", ANSWER_PROMPT, "--temperature", "0",
           "--max-new-tokens", "64"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launched = time.perf_counter()
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=err)
    first, text = None, b""
    while chunk := os.read(proc.stdout.fileno(), 4096):
        if first is None and chunk.strip():
            first = time.perf_counter() - launched
        text += chunk
    proc.wait()
    wall = time.perf_counter() - launched
    proc.stdout.close()
    err.seek(0)
    report = err.read().decode(errors="replace")
    err.close()
    if proc.returncode or first is None or "kvchat-peak-rss" not in report:
        raise RuntimeError(f"kvchat chat --prompt failed (exit {proc.returncode}): {report[-300:]}")
    peak = int(report.rsplit("kvchat-peak-rss", 1)[1].split()[0])
    return {"first_token_from_launch_s": first, "wall_s": wall, "peak_rss": peak}


def _median_dict(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def copy_bandwidth_gbs(mb: int = 256) -> float:
    """Memory copy bandwidth (bytes read + written per second), the ceiling a weight-streaming decode faces."""
    src = torch.ones(mb * MIB // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


LONG_MODES = {"bf16": ("bf16", 1), "int8": ("int8", 8), "int4": ("int4", 2)}   # kvchat format, llama.cpp ggml type


def _decode_by_context(engine, path: str | None, threads: int, runs: int, steps: int = 32) -> dict:
    """Decode tok/s with 256 and 4,096 tokens cached, per cache format, kvchat beside llama.cpp on the same
    file (f16 / q8_0 / q4_0 caches; f16 with and without flash attention, the faster counted), interleaved; each rate beside its bandwidth bound: (weight bytes + KV
    bytes read per token) over the copy bandwidth measured in the same run."""
    from kvchat.engine.config import CacheConfig
    try:
        from kvchat.engine.text.samples import load_tokens
        ids = load_tokens(engine.tokenizer, "stream", 4096 + steps)
    except Exception:
        ids = prompt_ids(engine.tokenizer, 4096 + steps)
    contexts = (256, 4096)
    from kvchat.bench import llamacpp
    peers = {}
    if path and path.endswith(".gguf"):
        for mode, (_, ggml_type) in LONG_MODES.items():
            got = llamacpp.open_peers(path, threads, 4096 + steps + 8, ggml_type)   # f16 with and without flash attention
            if got:
                peers[mode] = got
    speeds: dict = {}
    for _ in range(runs):
        for mode, (fmt, _) in LONG_MODES.items():
            for n in contexts:
                session = engine.new_session(cache=CacheConfig(k_format=fmt, v_format=fmt, budget_mb=4096))
                session.append(ids[:n], all_logits=False)
                t0 = time.perf_counter()
                for i in range(steps):
                    session.append([ids[n + i]], all_logits=False)
                speeds.setdefault(("kvchat", mode, n), []).append(steps / (time.perf_counter() - t0))
                session.close()
                for fa, llm in peers.get(mode, {}).items():
                    llm.reset()
                    llm.eval(ids[:n])
                    t0 = time.perf_counter()
                    for i in range(steps):
                        llm.eval([ids[n + i]])
                    speeds.setdefault(("llamacpp", mode, n), {}).setdefault(fa, []).append(
                        steps / (time.perf_counter() - t0))
    copy = copy_bandwidth_gbs() * 1e9
    out: dict = {"steps": steps, "copy_gbs": copy / 1e9, "modes": {}}
    from kvchat.engine.kv.layout import conversation_bytes
    for mode, (fmt, _) in LONG_MODES.items():
        cache = CacheConfig(k_format=fmt, v_format=fmt)
        row = {}
        for n in contexts:
            k = statistics.median(speeds[("kvchat", mode, n)])
            # what a token's attention reads: a sliding layer (Gemma) its window, a global one all n tokens
            kv_read = conversation_bytes(engine.model.config, cache, n, engine.dtype_name, str(engine.runner.device))
            bound = copy / (engine.model.token_read_bytes() + kv_read)
            row[n] = {"kvchat_tok_s": k, "bound_tok_s": bound, "of_bound": k / bound, "kv_bytes_read": kv_read}
            if ("llamacpp", mode, n) in speeds:
                fa, best = llamacpp.fastest(speeds[("llamacpp", mode, n)], lower_is_better=False)
                peer = statistics.median(best)
                row[n].update(llamacpp_tok_s=peer, llamacpp_config=llamacpp.label(fa), ratio_vs_llamacpp=k / peer)
        out["modes"][mode] = row
    bf16_4096 = out["modes"]["bf16"][4096]["kvchat_tok_s"]
    for mode in ("int8", "int4"):
        out["modes"][mode][4096]["ratio_vs_bf16"] = out["modes"][mode][4096]["kvchat_tok_s"] / bf16_4096
    return out


def _prefix_ttft(engine, runs: int, system_tokens: int = 1000) -> dict:
    """TTFT of a first conversation with a ~1,000-token system prompt, and of a second one sharing it."""
    from kvchat.engine.config import SamplingParams
    from kvchat.engine.events import TokenDelta
    try:
        from kvchat.engine.text.samples import load_text
        text = load_text("prose")
    except Exception:
        text = FALLBACK_TEXT * 100
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:system_tokens]
    system = engine.tokenizer.decode(ids)
    params = SamplingParams(temperature=0.0, max_new_tokens=2)

    def ttft(question: str) -> tuple[float, int]:
        session = engine.new_session(system_prompt=system)
        t0 = time.perf_counter()
        for ev in session.send(question, params):
            if isinstance(ev, TokenDelta):
                break
        took = time.perf_counter() - t0
        reused = session.stats().prefix_reused_tokens
        session.close()
        return took, reused

    first, second, reused = [], [], 0
    for _ in range(runs):
        engine.clear_prefix_cache()
        first.append(ttft("What is this text about?")[0])
        took, reused = ttft("Summarize it in one line.")
        second.append(took)
    f, s2 = statistics.median(first), statistics.median(second)
    return {"system_tokens": len(ids), "ttft_first_s": f, "ttft_second_s": s2, "ratio": s2 / f,
            "reused_tokens": reused}


def _regenerate(engine, llm, tokens: int, runs: int) -> dict:
    """The time from asking for another reply to the first token's logits, on a chat whose prompt is `tokens` long
    and whose reply was 8 tokens; with it, the prompt tokens each side reads again. kvchat's regenerate forks its
    cache where the reply began (a model with linear-attention layers from the state's snapshot there); llama.cpp
    cannot take a recurrent state back, so it reads the prompt again (its server says "forcing full prompt
    re-processing"): reset, then eval of the prompt. Interleaved runs, medians."""
    from kvchat.engine.config import SamplingParams
    ids = prompt_ids(engine.tokenizer, tokens)
    text = engine.tokenizer.decode(ids)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    ours, theirs, reread = [], [], []
    for _ in range(runs):
        session = engine.new_session()
        session.reply(text, params)
        for _event in session.regenerate(params):
            pass
        t = session.turn_times
        ours.append(t.ttft_s)                           # from the request to the first reply token
        reread.append(t.prefill_tokens + t.state_reread)    # prompt tokens read again (a state's gap included)
        session.close()
        if llm is not None:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            theirs.append(time.perf_counter() - t0)
    out = {"prompt_tokens": len(ids), "kvchat_s": statistics.median(ours), "kvchat_prompt_tokens_read": max(reread)}
    if theirs:
        out.update(llamacpp_s=statistics.median(theirs), llamacpp_prompt_tokens_read=len(ids),
                   ratio=statistics.median(ours) / statistics.median(theirs))
    return out


def run(args) -> dict:
    from kvchat import kernels
    if getattr(args, "device", "cpu") != "cpu" or kernels.interpreting():
        from kvchat.bench import gpu
        return gpu.run(args)
    from kvchat.engine.config import CacheConfig, EngineConfig
    from kvchat.engine.runtime.engine import Engine, load_transformers_reference

    from kvchat.bench.progress import Progress
    say = getattr(args, "progress", None) or Progress("speed")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    say(f"loading {args.model}")
    spec = resolve_model(args.model)
    path = model_path(spec)
    budget = CacheConfig(budget_mb=4096)
    engine = Engine.load(EngineConfig(model=spec, device="cpu", cache=budget, num_threads=threads))
    if getattr(args, "speculative", False):
        from kvchat.bench import speculative
        return {"model": engine.model_name, "path": path, "quant": engine.model.quant, "weights": engine.model.weights,
                "threads": threads, "kernels": _kernels_label(), "mode": "speculative",
                **speculative.run(args, engine, path, threads)}
    ids = prompt_ids(engine.tokenizer, args.prompt_tokens)
    sides = {"kvchat": lambda n: _time_kvchat(engine, ids[:n] if n else ids, args.new_tokens if not n else 4)}
    llm = None if args.no_llamacpp or not path.endswith(".gguf") else \
        _llamacpp(path, threads, args.prompt_tokens + args.new_tokens + 16)
    if getattr(args, "attention", False):
        sides["kvchat_attention"] = lambda n: _time_kvchat(engine, ids[:n] if n else ids,
                                                           args.new_tokens if not n else 4, "blocks")
    if getattr(args, "retrieval", None):
        fetch = CacheConfig(budget_mb=4096, retrieval_blocks=args.retrieval)
        sides["kvchat_retrieval"] = lambda n: _time_kvchat(engine, ids[:n] if n else ids,
                                                           args.new_tokens if not n else 4, cache=fetch)
    if getattr(args, "int8_activations", False):
        sides["kvchat_int8"] = lambda n: _with_activations(engine, "int8", lambda: _time_kvchat(
            engine, ids[:n] if n else ids, args.new_tokens if not n else 4))
    if llm is not None:
        sides["llamacpp"] = lambda n: _time_llamacpp(llm, ids[:n] if n else ids, args.new_tokens if not n else 4)
    want_hf = args.transformers == "yes" or (args.transformers == "auto" and args.model == "default")
    if want_hf:
        ref = load_transformers_reference(spec)
        sides["transformers"] = lambda n: _time_transformers(ref, ids[:n] if n else ids,
                                                             args.new_tokens if not n else 4)
    for name, f in sides.items():                # warm every path
        say(f"warming {name}")
        f(64)
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for i in range(args.runs):                   # interleaved
        for name, f in sides.items():
            say(f"{name}: {len(ids)}-token prompt + {args.new_tokens} tokens, run", i + 1, args.runs)
            runs[name].append(f(0))
    result = {
        "model": engine.model_name, "path": path, "quant": engine.model.quant, "weights": engine.model.weights,
        "device": "cpu", "threads": threads, "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
        "runs": args.runs, "kernels": _kernels_label(), "cpu": _cpu_label(),
        "prefill": engine.prefill, "prefill_why": engine.prefill_why, "activations": engine.activations,
        "weight_bytes": engine.model.weight_bytes(), "file_bytes": os.path.getsize(path) if os.path.isfile(path) else None,
    }
    for name, r in runs.items():
        result[name] = _median_dict(r)
        result[f"{name}_spread"] = {key: [min(x[key] for x in r), max(x[key] for x in r)]
                                    for key in ("decode_tok_s", "prefill_tok_s")}
    k = result["kvchat"]
    step_s = 1 / k["decode_tok_s"]
    result["weight_read_gbs"] = engine.model.token_read_bytes() / step_s / 1e9      # a token's reads, not residency
    result["copy_gbs"] = copy_bandwidth_gbs()
    if "kvchat_attention" in result:
        result["attention_decode_cost"] = 1 - result["kvchat_attention"]["decode_tok_s"] / k["decode_tok_s"]
        result["attention_prefill_cost"] = 1 - result["kvchat_attention"]["prefill_tok_s"] / k["prefill_tok_s"]
    if "kvchat_retrieval" in result:      # issue 42: reading K blocks a token against reading them all
        result["retrieval_blocks"] = args.retrieval
        result["retrieval_decode_speedup"] = result["kvchat_retrieval"]["decode_tok_s"] / k["decode_tok_s"]
        result["retrieval_memory_ratio"] = result["kvchat_retrieval"]["kv_bytes"] / k["kv_bytes"]
    if "kvchat_int8" in result and "llamacpp" in result:     # the same rounding of activations on both sides
        result["ratio_decode_int8_vs_llamacpp"] = (result["kvchat_int8"]["decode_tok_s"]
                                                   / result["llamacpp"]["decode_tok_s"])
    for peer in ("llamacpp", "transformers"):
        if peer in result:
            result[f"ratio_decode_vs_{peer}"] = k["decode_tok_s"] / result[peer]["decode_tok_s"]
            result[f"ratio_prefill_vs_{peer}"] = k["prefill_tok_s"] / result[peer]["prefill_tok_s"]
    say("time to first token with a shared 1,000-token system prompt")
    result["prefix_ttft"] = _prefix_ttft(engine, args.runs)
    if getattr(args, "regenerate", 0):
        say(f"regenerate on a {args.regenerate:,}-token chat")
        long = None if llm is None else _llamacpp(path, threads, args.regenerate + 64)    # room for the chat
        result["regenerate"] = _regenerate(engine, long, args.regenerate, args.runs)
        del long
    if getattr(args, "long_context", False):
        say("decode by context (4,096 cached tokens)")
        result["decode_by_context"] = _decode_by_context(engine, path if llm is not None else None, threads,
                                                         args.runs)
    del engine, llm
    if not args.no_load:
        result.update(_fresh_process_runs(spec, path, threads, args.runs, "llamacpp" in sides, say))
    return result


def _cpu_label() -> str:
    """The CPU the run measured, named as the issue asks: its model and the vector features the kernels use."""
    from kvchat.kernels import cpu_lib
    return f"{cpu_lib.cpu_name()} ({', '.join(sorted(cpu_lib.cpu_features())) or 'no SIMD features read'})"


def _kernels_label() -> str:
    """The kernels and the variant (ISA) they chose, e.g. "cpu_quant.c avx2 (isa=avx2+fma+f16c+base openmp=1 ...)"."""
    from kvchat.kernels import cpu_lib, cpu_quant
    if not cpu_quant.available():
        return f"torch reference ({cpu_quant.unavailable_reason()})"
    st = cpu_lib.status()
    return f"cpu_quant.c {st['variant']} ({st['build']})"


def _fresh_process_runs(spec: str, path: str, threads: int, runs: int, with_llamacpp: bool, say) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        say("a fresh process's first answer (cold)")
        # first start ever after install: an empty cache dir (tokenizer built from the file); the kernels come from
        # the install step when it ran (kernels/_built), else this start compiles them
        out["kvchat_cold"] = _cli_oneshot(path, threads, cache_dir=tmp)
        from kvchat.kernels import cpu_quant
        out["kvchat_cold"]["kernels_built_at_install"] = any(cpu_quant.BUILT.glob("cpu_quant-*.so"))
        warm, api, peer = [], [], []
        for i in range(runs):                     # interleaved
            say("fresh processes' first answers (warm), run", i + 1, runs)
            warm.append(_cli_oneshot(path, threads, cache_dir=tmp))
            api.append(_oneshot(_KVCHAT_ONESHOT, spec, threads, cache_dir=tmp))
            if with_llamacpp:
                peer.append(_oneshot(_LLAMACPP_ONESHOT, path, threads))
    out["kvchat_warm"] = _median_dict(warm)
    out["kvchat_api_warm"] = _median_dict(api)
    if peer:
        out["llamacpp_oneshot"] = _median_dict(peer)
        out["ratio_rss_vs_llamacpp"] = out["kvchat_warm"]["peak_rss"] / out["llamacpp_oneshot"]["peak_rss"]
        out["ratio_first_token_vs_llamacpp"] = (out["kvchat_warm"]["first_token_from_launch_s"]
                                                / out["llamacpp_oneshot"]["first_token_from_launch_s"])
    return out


def summarize(r: dict) -> str:
    if r.get("mode") == "speculative":
        from kvchat.bench import speculative
        return "\n".join([f"{r['model']} ({r['quant']}, weights {r['weights']}) on {r['threads']} threads; kernels: "
                          f"{r['kernels']}"] + speculative.summarize(r))
    lines = [f"{r['model']} ({r['quant']}, weights {r['weights']}, {r['weight_bytes'] / MIB:.0f} MiB resident"
             + (f", file {r['file_bytes'] / MIB:.0f} MiB" if r.get("file_bytes") else "") + f") on {r['threads']} "
             f"threads, {r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens, median of {r['runs']} "
             f"interleaved runs; kernels: {r['kernels']}" + (f"; CPU {r['cpu']}" if r.get("cpu") else "")]
    if r.get("prefill"):
        lines.append(f"  prompts: {r['prefill']} ({r['prefill_why']}); decode activations: {r['activations']}")
    for name in ("kvchat", "kvchat_int8", "kvchat_attention", "llamacpp", "transformers"):
        if name in r:
            s = r[name]
            lines.append(f"  {name:12s} prefill {s['prefill_tok_s']:7.1f} tok/s  decode {s['decode_tok_s']:6.1f} tok/s  "
                         f"TTFT {s['ttft_s'] * 1000:6.0f} ms")
    for peer in ("llamacpp", "transformers"):
        if f"ratio_decode_vs_{peer}" in r:
            lines.append(f"  vs {peer}: decode {r[f'ratio_decode_vs_{peer}']:.2f}x, prefill "
                         f"{r[f'ratio_prefill_vs_{peer}']:.2f}x")
    if "ratio_decode_int8_vs_llamacpp" in r:
        lines.append(f"  int8 activations (llama.cpp's rounding) vs llamacpp: decode "
                     f"{r['ratio_decode_int8_vs_llamacpp']:.2f}x")
    if "attention_decode_cost" in r:
        lines.append(f"  measuring attention costs {r['attention_decode_cost']:.1%} of decode, "
                     f"{r['attention_prefill_cost']:.1%} of prefill (interleaved runs)")
    lines.append(f"  weight reads while decoding {r['weight_read_gbs']:.1f} GB/s; memory copy {r['copy_gbs']:.1f} GB/s")
    if "prefix_ttft" in r:
        p = r["prefix_ttft"]
        lines.append(f"  shared {p['system_tokens']}-token system prompt: TTFT {p['ttft_first_s'] * 1000:.0f} ms first, "
                     f"{p['ttft_second_s'] * 1000:.0f} ms for a second conversation ({p['ratio']:.2f}x, "
                     f"{p['reused_tokens']} tokens reused)")
    if "regenerate" in r:
        g = r["regenerate"]
        peer = (f"; llama.cpp reads the prompt again: {g['llamacpp_s'] * 1000:.0f} ms ({g['ratio']:.3f}x)"
                if "llamacpp_s" in g else "")
        lines.append(f"  regenerate on a {g['prompt_tokens']:,}-token chat: first token {g['kvchat_s'] * 1000:.0f} ms, "
                     f"{g['kvchat_prompt_tokens_read']} prompt tokens read again{peer}")
    if "decode_by_context" in r:
        c = r["decode_by_context"]
        lines.append(f"  decode by context (median of {r['runs']}, {c['steps']} steps; bound = copy {c['copy_gbs']:.1f} GB/s "
                     f"over weight + KV bytes read per token):")
        for mode, row in c["modes"].items():
            for n, v in row.items():
                peer = (f", llama.cpp {v['llamacpp_tok_s']:.1f} ({v['ratio_vs_llamacpp']:.2f}x)"
                        if "llamacpp_tok_s" in v else "")
                extra = f", {v['ratio_vs_bf16']:.2f}x kvchat bf16" if "ratio_vs_bf16" in v else ""
                lines.append(f"    {mode:5s} at {int(n):5d}: {v['kvchat_tok_s']:6.1f} tok/s, {v['of_bound']:.0%} of its "
                             f"bound {v['bound_tok_s']:.0f}{peer}{extra}")
    for key, label in (("kvchat_cold", "kvchat chat, first start"), ("kvchat_warm", "kvchat chat, warm"),
                       ("kvchat_api_warm", "Engine API, warm"), ("llamacpp_oneshot", "llama.cpp")):
        if key in r:
            s = r[key]
            after_load = f" ({s['peak_rss_after_load'] / MIB:.0f} MiB after load)" if "peak_rss_after_load" in s else ""
            lines.append(f"  one 64-token answer, {label:24s}: first token {s['first_token_from_launch_s']:.2f} s "
                         f"after launch, wall {s['wall_s']:.2f} s, peak RSS {s['peak_rss'] / MIB:.0f} MiB{after_load}")
    if "ratio_rss_vs_llamacpp" in r:
        lines.append(f"  peak RSS vs llama.cpp: {r['ratio_rss_vs_llamacpp']:.2f}x")
    return "\n".join(lines)
