"""`kvchat replay`: a saved chat (--conversation ID) or a text file (--text FILE) replayed under another cache mode
beside its own (engine/runtime/replay.py): top-1 agreement of the greedy choices, KL, and where they first part.
Progress on stderr; with --json, stdout holds one JSON object."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from kvchat.engine.config import CacheConfig, ConfigError

from kvchat.cli.options import add_cache_arguments, cache_config, engine_config

MAX_TEXT_BYTES = 8 << 20


def add_arguments(p) -> None:
    add_cache_arguments(p)          # --k-format, --v-format, --window, --sinks ...: the replayed mode
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--conversation", type=int, help="a chat the app saved (its id: --list shows them)")
    what.add_argument("--text", help="a UTF-8 text file, read as one stream of tokens")
    what.add_argument("--list", action="store_true", help="list the saved chats and their ids")
    p.add_argument("--baseline-k-format", default=None, help="the baseline's K format (default: the chat's own "
                                                             "mode; full precision for a text)")
    p.add_argument("--baseline-v-format", default=None)
    p.add_argument("--tokens", type=int, default=512, help="a text's tokens replayed at most (its first ones; "
                                                           "each is one step through two sessions)")
    p.add_argument("--weights", default="auto", choices=["auto", "dense", "int8", "int4"],
                   help="model weights (auto: as `kvchat chat` loads them; `kvchat bench quality` uses dense)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_replay(args) -> int:
    if args.list:
        chats = _saved(lambda store: store.conversations())
        for c in chats:
            print(f"{c.id:6d}  {c.title}")
        if not chats:
            say("no saved chats: the app saves them as you chat (KVCHAT_DATA_DIR points at another data folder)")
        return 0
    source = _saved(lambda store: _conversation(store, args.conversation)) if args.conversation is not None else None
    text = _read_text(args.text) if args.text is not None else None
    if text is not None and args.tokens < 2:
        raise ConfigError(f"--tokens {args.tokens}: replay at least 2 tokens")
    mode = cache_config(args)           # an impossible mode is refused before the model loads
    from kvchat.engine.runtime.engine import Engine
    from kvchat.engine.runtime.replay import conversation_tokens, replay
    say(f"loading {args.model}")
    engine = Engine.load(replace(engine_config(args), weights=args.weights))
    if source is not None:
        own, system, messages = source
        ids, replies = conversation_tokens(engine, system, messages)
    else:
        own, replies = None, None
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > args.tokens:
            say(f"the text has {len(ids):,} tokens: the first {args.tokens:,} are replayed (--tokens)")
            ids = ids[:args.tokens]
    baseline, why = _baseline(args, own, engine.dtype_name)
    say(f"{len(ids):,} tokens under {mode.label()} beside {baseline.label()} ({why})")
    result = replay(engine, ids, mode, baseline, replies, progress=_progress())
    out = _as_dict(result, engine.tokenizer, ids) | {"baseline_from": why}
    print(json.dumps(out, indent=2) if args.json else _summary(out))
    return 0


def say(msg: str) -> None:
    print(f"[replay] {msg}", file=sys.stderr, flush=True)


def _progress():
    """progress(done, total) for replay(): a line on stderr every twentieth of the way."""
    last = [0]

    def progress(done: int, total: int) -> None:
        if done == total or done - last[0] >= max(1, total // 20):
            last[0] = done
            say(f"{done:,} / {total:,} tokens")
    return progress


def _saved(read):
    """read(store) on the app's saved chats (app/store/history.py: KVCHAT_DATA_DIR, else the user data dir)."""
    from kvchat.app.store.history import HistoryStore
    store = HistoryStore()
    try:
        return read(store)
    finally:
        store.close()


def _conversation(store, cid: int):
    chat = store.get(cid)
    if chat is None:
        raise ConfigError(f"--conversation {cid}: no saved chat has that id: `kvchat replay --list` shows them")
    messages = store.messages(cid)
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"--conversation {cid}: the chat has no reply to replay")
    return chat.cache, chat.system_prompt, messages


def _read_text(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--text {path}: {'not a file' if p.exists() else 'no such file'}: give a text file")
    if p.stat().st_size > MAX_TEXT_BYTES:
        raise ConfigError(f"--text {path}: larger than {MAX_TEXT_BYTES >> 20} MiB; cut it first")
    try:
        text = p.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--text {path}: not readable as UTF-8 text ({type(exc).__name__})") from None
    if "\x00" in text or not text.strip():
        raise ConfigError(f"--text {path}: {'binary' if chr(0) in text else 'empty'}: give a text file")
    return text


def _baseline(args, own: CacheConfig | None, dtype: str) -> tuple[CacheConfig, str]:
    """The baseline and where it comes from: the chat's saved mode, else full precision at the model's dtype (as
    `kvchat bench quality` measures), with the formats --baseline-k-format / --baseline-v-format name."""
    base, why = (own, "the chat's saved mode") if own is not None else \
        (CacheConfig(k_format=dtype, v_format=dtype), "full precision at the model's dtype")
    if args.baseline_k_format or args.baseline_v_format:
        why = "--baseline-k-format / --baseline-v-format"
    try:
        return base.with_(k_format=args.baseline_k_format or base.k_format,
                          v_format=args.baseline_v_format or base.v_format), why
    except ConfigError as exc:
        raise ConfigError(f"the baseline: {exc}") from None


def _as_dict(result, tokenizer, ids: list[int]) -> dict:
    def where(j, expected, replayed):
        if j is None:
            return None
        text = lambda t: tokenizer.decode([t]) if t is not None else None
        # "text": the conversation's own tokens around j (j itself included where it is one of them)
        return {"token": j, "expected": expected, "replayed": replayed, "expected_text": text(expected),
                "replayed_text": text(replayed), "text": tokenizer.decode(ids[max(0, j - 12):j + 4]),
                "context": tokenizer.decode(ids[max(0, j - 12):j])}
    out = {"mode": result.mode, "baseline": result.baseline, "tokens": result.tokens, "top1": result.top1,
           "kl": result.kl, "first_divergence": where(result.first_divergence, result.expected, result.replayed),
           "seconds": result.seconds, "kv_bytes": result.kv_bytes, "baseline_kv_bytes": result.baseline_kv_bytes}
    if result.replies:
        out["replies"] = [{"index": r.index, "start": r.start, "end": r.end, "tokens": r.tokens, "top1": r.top1,
                           "kl": r.kl, "first_divergence": where(r.first_divergence, r.expected, r.replayed)}
                          for r in result.replies]
    return out


def _summary(out: dict) -> str:
    lines = [f"{out['mode']} beside {out['baseline']} ({out['baseline_from']}) over {out['tokens']:,} positions: "
             f"top-1 {out['top1']:.1%}, KL {out['kl']:.4f} nats/token ({out['seconds']:.1f} s)"]
    for r in out.get("replies", [out]):
        d = r["first_divergence"]
        head = f"  reply {r['index']}: top-1 {r['top1']:.1%}, KL {r['kl']:.4f}; " if "index" in r else "  "
        lines.append(head + ("never parts" if d is None else f"first parts at token {d['token']}: "
                                                             f"«{d['expected_text']}» → «{d['replayed_text']}» after "
                                                             f"…{d['context']!r}"))
    return "\n".join(lines)
