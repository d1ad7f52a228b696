"""`kvchat bench passkey`: can the model still find a number hidden in filler text, per cache mode?

Each prompt hides a 5-digit pass key at a depth of the filler (10/50/90%) in a prompt of 256, 512
or 1,024 tokens and ends with the question. The prompt is prefilled; then the key's tokens are fed
one at a time (the decode path, attending to the stored cache). The answer counts as found when
greedy decoding gives the key (the argmax at every step is the key's next token), and the mean
log-probability of the key's tokens is reported too. A window too small to hold the key is the
negative control: it should find about none.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from kvchat.engine.config import CacheConfig, EngineConfig

MODES = {
    "full": CacheConfig(),
    "int8": CacheConfig(k_format="int8", v_format="int8"),
    "fp8": CacheConfig(k_format="fp8", v_format="fp8"),
    "int4": CacheConfig(k_format="int4", v_format="int4"),
    "int4-token": CacheConfig(k_format="int4", v_format="int4", k_scheme="token"),
    "window-32": CacheConfig(window=32, sinks=4),
    "window-int4": CacheConfig(k_format="int4", v_format="int4", window=252, sinks=4),
}
DEFAULT_MODES = ("full", "int8", "fp8", "int4", "int4-token", "window-32")
# the modes of issue 42, per tokens held per layer N: window-N (the oldest go), importance-N (the least attended go),
# retrieval-K (every block kept, each token reads the sinks, the newest two blocks and K chosen blocks: N = 16 K)
KEEP_FETCH = ("full", "window-512", "importance-512", "retrieval-32")
LENGTHS = (256, 512, 1024)
DEPTHS = (0.1, 0.5, 0.9)

HEAD = ("There is a pass key hidden inside a lot of irrelevant text. Find it and remember it. "
        "I will ask you for the pass key at the end.\n\n")
FILLER = ("The morning bus leaves the square at seven. The baker sets out bread on the long shelf. "
          "A dog sleeps by the warm stove. The river moves slowly under the old stone bridge. "
          "Children walk to school along the path by the field. ")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
EXCHANGE = "\nThat was a long text. Did you read all of it?\nYes, I read it to the end.\n"   # --later: between the two


def mode_config(name: str) -> CacheConfig:
    """A named mode: one of MODES, or window-N / importance-N / retrieval-K (see KEEP_FETCH)."""
    if name in MODES:
        return MODES[name]
    kind, _, n = name.rpartition("-")
    if kind in ("window", "importance", "retrieval") and n.isdigit():
        if kind == "retrieval":
            return CacheConfig(retrieval_blocks=int(n))
        return CacheConfig(window=int(n), sinks=4, eviction="importance" if kind == "importance" else "window")
    raise SystemExit(f"unknown mode {name!r}: choose from {', '.join(MODES)}, window-N, importance-N or retrieval-K")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="default, a local HF folder, or a .gguf file")
    parser.add_argument("--weights", default="dense", choices=["auto", "dense", "int4"],
                        help="model weights; dense (default) so only the cache differs between modes")
    parser.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(DEFAULT_MODES),
                        help=f"comma-separated, from: {', '.join(MODES)}, window-N, importance-N (N tokens held), "
                             f"retrieval-K (K blocks read a token); 'keep-fetch' for {', '.join(KEEP_FETCH)}")
    parser.add_argument("--later", action="store_true",
                        help="ask in a later turn: the text is read first, then a short exchange, then the question")
    parser.add_argument("--keys", type=int, default=4, help="keys per (length, depth) cell")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=list(LENGTHS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def build_prompts(tokenizer, lengths=LENGTHS, depths=DEPTHS, keys_per_cell: int = 4, seed: int = 0) -> list[dict]:
    """Prompts as token ids: {"ids", "key", "key_ids", "length", "depth"}; each prompt is `length` tokens."""
    rng = random.Random(seed)
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    head, question = enc(HEAD), enc(QUESTION)
    filler = enc(FILLER * (8 + max(lengths) // 40))
    prompts = []
    for length in lengths:
        for depth in depths:
            for _ in range(keys_per_cell):
                key = str(rng.randint(10000, 99999))
                needle = enc(NEEDLE.format(key=key))
                room = length - len(head) - len(needle) - len(question)
                assert 0 < room <= len(filler), f"length {length} is too short or too long for the filler"
                before = int(room * depth)
                ids = head + filler[:before] + needle + filler[before:room] + question
                prompts.append({"ids": ids, "key": key, "key_ids": enc(" " + key), "length": length, "depth": depth,
                                "key_at": len(head) + before, "question": len(question),
                                "exchange": enc(EXCHANGE)})
    return prompts


def score(engine, config: CacheConfig, prompt: dict, later: bool = False) -> tuple[bool, float]:
    """(greedy answer is the key, mean log-probability of the key's tokens) under one cache mode; later: the
    question comes after the text was read and a short exchange followed."""
    session = engine.new_session(cache=config, prefix_cache=False)
    ids = prompt["ids"]
    if later:
        q = prompt["question"]
        session.append(ids[:-q], all_logits=False)
        session.append(prompt["exchange"], all_logits=False)
        logits = session.append(ids[-q:], all_logits=False)[-1]
    else:
        logits = session.append(ids, all_logits=False)[-1]
    found, logps = True, []
    for token in prompt["key_ids"]:
        logp = torch.log_softmax(logits.float(), -1)
        found = found and int(logp.argmax()) == token
        logps.append(float(logp[token]))
        logits = session.append([token])[-1]
    session.close()
    return found, sum(logps) / len(logps)


def run(args) -> dict:
    from kvchat.engine.runtime.engine import Engine
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(model=args.model, weights=args.weights))
    names = [n for m in args.modes for n in (KEEP_FETCH if m == "keep-fetch" else (m,))]
    configs = {name: mode_config(name) for name in names}
    prompts = build_prompts(engine.tokenizer, args.lengths, DEPTHS, args.keys, args.seed)
    later = getattr(args, "later", False)
    result = {"model": engine.model_name, "prompts": len(prompts), "lengths": list(args.lengths),
              "depths": list(DEPTHS), "later": later, "modes": {}}
    for name, config in configs.items():
        started = time.perf_counter()
        rows = []
        for i, p in enumerate(prompts):
            rows.append((p, *score(engine, config, p, later)))
            print(f"\r{name}: {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        cells = {}
        for p, found, _ in rows:
            key = f"{p['length']}@{int(p['depth'] * 100)}%"
            cells[key] = cells.get(key, 0) + int(found)
        result["modes"][name] = {
            "label": config.label(),
            "found": sum(found for _, found, _ in rows),
            "mean_key_logprob": sum(lp for _, _, lp in rows) / len(rows),
            "by_cell": cells,
            "seconds": time.perf_counter() - started,
        }
    modes = result["modes"]
    checks = {}
    if "full" in modes:
        base = modes["full"]["found"]
        for name, r in modes.items():
            config = configs[name]
            if name != "full" and config.window is None:
                checks[f"{name} finds >= full - 1 ({base - 1})"] = r["found"] >= base - 1
            elif config.eviction == "importance" and not later:
                checks[f"{name} finds >= 80% of full ({0.8 * base:.1f})"] = r["found"] >= 0.8 * base
    if "window-32" in modes:
        checks["window-32 (negative control) finds <= 1"] = modes["window-32"]["found"] <= 1
    result["checks"] = checks
    return result


def summarize(result: dict) -> str:
    lines = [f"{result['model']}: {result['prompts']} prompts, lengths {result['lengths']}, depths "
             f"{[int(d * 100) for d in result['depths']]}%",
             f"{'mode':<14}{'found':>8}{'mean log p(key)':>17}  by length@depth"]
    for name, r in result["modes"].items():
        cells = " ".join(f"{k}:{v}" for k, v in r["by_cell"].items())
        lines.append(f"{name:<14}{r['found']:>5}/{result['prompts']:<3}{r['mean_key_logprob']:>16.4f}  {cells}")
    for what, ok in result["checks"].items():
        lines.append(f"{'PASS' if ok else 'FAIL'}  {what}")
    return "\n".join(lines)
