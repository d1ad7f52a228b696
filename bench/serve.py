"""`kvchat bench serve`: a loopback load test of `kvchat serve` with the official openai client.

Every request runs alone first (one client, temperature 0, fp32 cache): that is the reference and
the single-client throughput. Then N clients stream the same requests concurrently, some closing
their stream midway. Checks: no request failed, each completed stream's text equals its solo run
and each cancelled one is a prefix of it, KV usage never passed the budget, every block is free at
the end. Reports generated tok/s (from the server's vllm:generation_tokens_total) against one
client alone, and p50/p99 time to first token.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

WORDS = ("the cache keeps keys and values for every token so attention can look back without recomputing "
         "anything while a long conversation grows block by block until the budget is full").split()


@dataclass(frozen=True, slots=True)
class Spec:
    prompt: str
    max_tokens: int
    cancel_after: int | None        # close the stream after this many content chunks


@dataclass
class Result:
    text: str = ""
    completion_tokens: int = 0
    finish: str | None = None
    ttft_s: float | None = None
    cancelled: bool = False
    error: str | None = None


def make_specs(n: int, seed: int = 0, min_words: int = 4, max_words: int = 120, min_tokens: int = 8,
               max_tokens: int = 64, cancel_every: int = 5) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        cancel = rng.randint(2, max(3, min_tokens // 2)) if cancel_every and i % cancel_every == cancel_every - 1 else None
        specs.append(Spec(f"Request {i}: " + " ".join(words), rng.randint(min_tokens, max_tokens), cancel))
    return specs


def run_one(client, model: str, spec: Spec, cancel: bool) -> Result:
    result = Result()
    started = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": spec.prompt}], max_tokens=spec.max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = 0
        with stream:
            for event in stream:
                if event.usage is not None:
                    result.completion_tokens = event.usage.completion_tokens
                if not event.choices:
                    continue
                choice = event.choices[0]
                if choice.delta.content:
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - started
                    result.text += choice.delta.content
                    chunks += 1
                if choice.finish_reason:
                    result.finish = choice.finish_reason
                if cancel and spec.cancel_after is not None and chunks >= spec.cancel_after:
                    result.cancelled = True
                    break           # leaving the with-block closes the connection mid-stream
    except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def run_load(base_url: str, model: str, specs: list[Spec], num_clients: int, cancel: bool = True,
             api_key: str = "none", timeout_s: float = 600.0) -> list[Result]:
    """num_clients threads, each with its own openai client, take specs from a shared queue in order."""
    import openai
    results: list[Result | None] = [None] * len(specs)
    next_index = iter(range(len(specs)))
    lock = threading.Lock()

    def client_loop():
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = run_one(client, model, specs[i], cancel)

    threads = [threading.Thread(target=client_loop, name=f"load-client-{k}") for k in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return [r if r is not None else Result(error="never ran (timeout)") for r in results]


def scrape(base_url: str) -> dict[str, float]:
    """The server's /metrics as {sample name: value}, labels dropped (one model per server)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.get("le"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def measure(server, specs: list[Spec], num_clients: int) -> dict:
    """Solo reference pass, then the concurrent pass; returns numbers and the checks' outcome."""
    from kvchat.engine.serve import batch
    base_url, model = server.base_url, server.model_id
    before = scrape(base_url)["vllm:generation_tokens_total"]
    started = time.perf_counter()
    solo = run_load(base_url, model, specs, 1, cancel=False)
    solo_s = time.perf_counter() - started
    middle = scrape(base_url)["vllm:generation_tokens_total"]
    started = time.perf_counter()
    loaded = run_load(base_url, model, specs, num_clients, cancel=True)
    loaded_s = time.perf_counter() - started
    # cancelled streams are freed by the engine thread one step after the disconnect is seen
    deadline = time.monotonic() + 10
    while (batch.num_live(server.engine) or server.scheduler.running) and time.monotonic() < deadline:
        time.sleep(0.02)
    after = scrape(base_url)
    failed = [i for i, r in enumerate(solo + loaded) if r.error]
    mismatched = []
    for i, (ref, got) in enumerate(zip(solo, loaded)):
        if got.error or ref.error:
            continue
        ok = ref.text.startswith(got.text) if got.cancelled else (got.text == ref.text and
                                                                   got.completion_tokens == ref.completion_tokens)
        if not ok:
            mismatched.append(i)
    ttfts = [r.ttft_s for r in loaded if r.ttft_s is not None]
    solo_tokens = middle - before
    loaded_tokens = after["vllm:generation_tokens_total"] - middle
    return {
        "model": model,
        "clients": num_clients,
        "requests": len(specs),
        "cancelled": sum(r.cancelled for r in loaded),
        "failed": len(failed),
        "errors": sorted({(solo + loaded)[i].error for i in failed})[:5],
        "mismatched": mismatched,
        "preemptions": server.scheduler.num_preemptions,
        "max_kv_usage": server.scheduler.max_usage,
        "blocks_free_at_end": batch.num_free_blocks(server.engine),
        "blocks_budget": batch.num_blocks(server.engine),
        "live_sequences_at_end": batch.num_live(server.engine),
        "solo_tok_s": solo_tokens / solo_s,
        "loaded_tok_s": loaded_tokens / loaded_s,
        "speedup": (loaded_tokens / loaded_s) / (solo_tokens / solo_s) if solo_tokens else float("nan"),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "solo_ttft_p50_s": percentile([r.ttft_s for r in solo if r.ttft_s is not None], 50),
        "solo_s": solo_s,
        "loaded_s": loaded_s,
    }


ENGINE_OPTIONS = True        # the command line adds the cache options and passes args.engine_config


def add_arguments(p) -> None:
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests-per-client", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="the longest reply a request asks for")
    p.set_defaults(k_format="fp32", v_format="fp32")


def run(args) -> dict:
    from kvchat.engine.runtime.engine import Engine
    from kvchat.engine.serve.server import ServeConfig, Server
    engine = Engine.load(args.engine_config)
    server = Server(engine, ServeConfig(port=0, max_num_seqs=args.max_num_seqs))
    server.start()
    try:
        specs = make_specs(args.clients * args.requests_per_client, max_tokens=args.max_tokens)
        return measure(server, specs, args.clients)
    finally:
        server.stop()


def summarize(r: dict) -> str:
    verdict = "PASS" if not r["failed"] and not r["mismatched"] and r["blocks_free_at_end"] == r["blocks_budget"] \
        and r["max_kv_usage"] <= 1.0 else "FAIL"
    return "\n".join([
        f"kvchat serve, {r['model']}: {r['clients']} streaming clients x {r['requests'] // r['clients']} requests "
        f"({r['cancelled']} cancelled midway)  [{verdict}]",
        f"  failed {r['failed']}, streams differing from their solo run {len(r['mismatched'])}, "
        f"preemptions {r['preemptions']}, peak KV usage {r['max_kv_usage']:.0%}, "
        f"blocks free at the end {r['blocks_free_at_end']}/{r['blocks_budget']}",
        f"  generated tok/s: one client alone {r['solo_tok_s']:.1f}, {r['clients']} clients {r['loaded_tok_s']:.1f} "
        f"({r['speedup']:.2f}x)",
        f"  TTFT under load: p50 {r['ttft_p50_s'] * 1000:.0f} ms, p99 {r['ttft_p99_s'] * 1000:.0f} ms "
        f"(alone: p50 {r['solo_ttft_p50_s'] * 1000:.0f} ms)",
    ] + ([f"  errors: {r['errors']}"] if r["errors"] else []))
