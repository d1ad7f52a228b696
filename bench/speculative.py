"""`kvchat bench speed --speculative`: decode with and without speculative decoding, beside llama.cpp's own prompt
lookup decoding, on three chat prompts:
- code_edit: the reply repeats most of a given function (a rename);
- summary: a summary that quotes the text;
- story: a free story, nothing to copy.
Each run is a fresh greedy turn (prefix cache off), the sides interleaved run by run (every other run in the
reverse order): kvchat plain, kvchat with
prompt lookup, llama.cpp plain, llama.cpp with `LlamaPromptLookupDecoding` (where llama-cpp-python is importable),
all on the same GGUF and the same prompt token ids. Greedy, so both kvchat sides give the same tokens (checked).
Decode tok/s is the tokens after the first over the time after the first. Reported per prompt: medians with
min/max, acceptance and tokens per step, `speedup_<prompt>` (lookup against plain, ours) and
`ratio_code_edit_vs_llamacpp_lookup`; beside them what a verification row costs against a plain step on this
machine (the ceiling of any speed-up: a step of 1 + k rows costs 1 + c k steps).
"""
from __future__ import annotations

import statistics
import time

CODE = '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,!?;:")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
'''
TEXT = ("The old lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed the "
        "one hundred and twelve steps to light the lamp, and every morning he wrote the weather in a small leather "
        "book. When the keeper retired, the town voted to keep the light burning with an electric lamp, but they kept "
        "his books in the library, where children still read them on rainy afternoons.")
PROMPTS = {
    "code_edit": "Rename the variable `counts` to `freq` in this function and show the complete function:\n\n"
                 "```python\n" + CODE + "```",
    "summary": "Summarize the following text, quoting its key sentences word for word.\n\n" + TEXT,
    "story": "Write a short story about a robot who learns to paint.",
}


def add_arguments(p) -> None:
    p.add_argument("--spec-k", type=int, default=None, help="most drafts per step (default: the engine's)")
    p.add_argument("--ngram-max", type=int, default=None)


def _kvchat(engine, ids_text: str, new_tokens: int) -> dict:
    from kvchat.engine.config import SamplingParams
    from kvchat.engine.events import TurnFinished
    session = engine.new_session(prefix_cache=False)
    fin = [e for e in session.send(ids_text, SamplingParams(temperature=0, max_new_tokens=new_tokens))
           if isinstance(e, TurnFinished)][-1]
    st = fin.stats
    out = {"decode_tok_s": st.decode_tok_s, "tokens": len(session.token_ids) - st.prefill_tokens,
           "ids": list(session.token_ids)}
    if st.spec is not None:
        out.update(acceptance=st.spec.acceptance_rate, tokens_per_step=st.spec.tokens_per_step,
                   drafted=st.spec.drafted)
    session.close()
    return out


def _llamacpp(llm, ids: list[int], new_tokens: int) -> dict:
    eos = llm.token_eos()
    llm.reset()
    n, first, t_end = 0, None, None
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        now = time.perf_counter()
        if first is None:
            first = now
        n += 1
        t_end = now
        if token == eos or n >= new_tokens:
            break
    return {"decode_tok_s": (n - 1) / (t_end - first) if n > 1 and t_end > first else 0.0, "tokens": n}


def _load_llamacpp(path: str, threads: int, n_ctx: int, lookup_k: int | None, ngram: int):
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    draft = LlamaPromptLookupDecoding(max_ngram_size=ngram, num_pred_tokens=lookup_k) if lookup_k else None
    return Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 draft_model=draft, logits_all=draft is not None, verbose=False)


def row_share(engine, rows: int = 5, reps: int = 9) -> dict:
    """A verification of `rows` rows against a plain step, at 256 tokens cached: the marginal row's share of a step."""
    r = engine.runner
    seq = r.new_sequence(engine.config.cache)
    r.step([(seq, list(range(100, 356)))], decode=[False])
    one, many = [], []
    for _ in range(reps):                  # interleaved
        t = time.perf_counter()
        r.step([(seq, [500])])
        one.append(time.perf_counter() - t)
        r.truncate(seq, 1)
        t = time.perf_counter()
        r.step([(seq, list(range(500, 500 + rows)))], decode=[True])
        many.append(time.perf_counter() - t)
        r.truncate(seq, rows)
    r.close(seq)
    t1, tn = statistics.median(one), statistics.median(many)
    return {"plain_step_ms": t1 * 1000, f"verify_{rows}_rows_ms": tn * 1000, "rows": rows,
            "row_share": (tn - t1) / (rows - 1) / t1}


def _med(xs: list[dict], key: str) -> dict:
    vals = [x[key] for x in xs if key in x]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else {}


def run(args, engine, spec_path: str, threads: int) -> dict:
    from kvchat.engine.config import SpeculativeConfig
    base = engine.speculative if engine.speculative.enabled else SpeculativeConfig()
    k = args.spec_k or base.k
    ngram = args.ngram_max or base.ngram_max
    lookup = SpeculativeConfig("lookup", k=k, ngram_max=ngram, ngram_min=min(base.ngram_min, ngram),
                               adaptive=base.adaptive)
    off = SpeculativeConfig("off")
    new = args.new_tokens
    prompts = {name: text for name, text in PROMPTS.items()}
    token_ids = {}
    for name, text in prompts.items():
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                        add_generation_prompt=True)
        token_ids[name] = engine.tokenizer.encode(rendered, add_special_tokens=False)
    longest = max(map(len, token_ids.values())) + new + 16
    peers = {}
    if not args.no_llamacpp and spec_path.endswith(".gguf"):
        plain_llm = _load_llamacpp(spec_path, threads, longest, None, ngram)
        if plain_llm is not None:
            peers = {"llamacpp": plain_llm, "llamacpp_lookup": _load_llamacpp(spec_path, threads, longest, k, ngram)}
    for name, text in prompts.items():          # warm every path
        engine.set_speculative(lookup)
        _kvchat(engine, text, 8)
        for llm in peers.values():
            _llamacpp(llm, token_ids[name], 8)
    runs = {name: {"plain": [], "lookup": [], **{p: [] for p in peers}} for name in prompts}
    same = True
    for run_no in range(args.runs):             # interleaved: every side of every prompt once per run, in turn first
        for name, text in prompts.items():
            got = {}
            for config in ((off, lookup) if run_no % 2 == 0 else (lookup, off)):
                engine.set_speculative(config)
                got[config.method] = _kvchat(engine, text, new)
            plain, spec = got["off"], got["lookup"]
            same &= plain.pop("ids") == spec.pop("ids")
            runs[name]["plain"].append(plain)
            runs[name]["lookup"].append(spec)
            for peer in (list(peers) if run_no % 2 == 0 else list(peers)[::-1]):
                runs[name][peer].append(_llamacpp(peers[peer], token_ids[name], new))
    engine.set_speculative(base)
    cost = row_share(engine)
    # the most any prompt could gain here: every draft accepted, k + 1 tokens for 1 + c k steps
    cost["ceiling_speedup"] = (k + 1) / (1 + cost["row_share"] * k)
    result = {"speculative": lookup.label(), "new_tokens": new, "runs": args.runs, "greedy_outputs_equal": same,
              "cost": cost, "prompts": {}}
    for name, sides in runs.items():
        row = {side: {"decode_tok_s": _med(xs, "decode_tok_s"), "tokens": _med(xs, "tokens")}
               for side, xs in sides.items()}
        row["lookup"].update(acceptance=_med(sides["lookup"], "acceptance"),
                             tokens_per_step=_med(sides["lookup"], "tokens_per_step"))
        ours = row["lookup"]["decode_tok_s"]["median"]
        row["speedup"] = ours / row["plain"]["decode_tok_s"]["median"]
        if "llamacpp_lookup" in row:
            row["ratio_vs_llamacpp_lookup"] = ours / row["llamacpp_lookup"]["decode_tok_s"]["median"]
            row["llamacpp_lookup_speedup"] = (row["llamacpp_lookup"]["decode_tok_s"]["median"]
                                              / row["llamacpp"]["decode_tok_s"]["median"])
        result["prompts"][name] = row
        result[f"speedup_{name}"] = row["speedup"]
    if "ratio_vs_llamacpp_lookup" in result["prompts"]["code_edit"]:
        result["ratio_code_edit_vs_llamacpp_lookup"] = result["prompts"]["code_edit"]["ratio_vs_llamacpp_lookup"]
    return result


def summarize(r: dict) -> list[str]:
    c = r["cost"]
    lines = [f"  speculative decoding ({r['speculative']}), {r['new_tokens']} new tokens, median of {r['runs']} "
             f"interleaved runs; greedy outputs equal: {r['greedy_outputs_equal']}",
             f"  a verification row costs {c['row_share']:.2f} of a plain step here ({c['plain_step_ms']:.1f} ms plain, "
             f"{c['verify_5_rows_ms']:.1f} ms for 5 rows): every draft accepted would give at most "
             f"{c['ceiling_speedup']:.2f}x"]
    for name, row in r["prompts"].items():
        p, s = row["plain"]["decode_tok_s"], row["lookup"]["decode_tok_s"]
        peer = ""
        if "llamacpp_lookup" in row:
            lp, ll = row["llamacpp"]["decode_tok_s"], row["llamacpp_lookup"]["decode_tok_s"]
            peer = (f"; llama.cpp {lp['median']:.1f}, its lookup {ll['median']:.1f} ({row['llamacpp_lookup_speedup']:.2f}x)"
                    f", ours vs its lookup {row['ratio_vs_llamacpp_lookup']:.2f}x")
        lines.append(f"    {name:9s}: plain {p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f}), lookup {s['median']:.1f} "
                     f"({s['min']:.1f}-{s['max']:.1f}) tok/s = {row['speedup']:.2f}x, accepted "
                     f"{row['lookup']['acceptance'].get('median', 0):.0%}, {row['lookup']['tokens_per_step'].get('median', 0):.2f}"
                     f" tokens a step{peer}")
    return lines
