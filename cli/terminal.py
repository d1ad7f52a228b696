"""Terminal entry points: `kvchat chat`, `kvchat bench ...`, `kvchat estimate`, `kvchat doctor`."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading

from kvchat.cli.options import add_cache_arguments, engine_config, sampling_params
from kvchat.engine.config import ConfigError, SamplingParams
from kvchat.engine.errors import UserError
from kvchat.engine.units import KIB, MIB

BENCHES = {
    "speed": "kvchat.bench.speed",
    "memory": "kvchat.bench.memory",
    "quality": "kvchat.bench.quality",
    "passkey": "kvchat.bench.passkey",
    "serve": "kvchat.bench.serve",
    "resume": "kvchat.bench.resume",
    "latency": "kvchat.bench.latency",
    "attention": "kvchat.bench.attention",
}


def _print_stats(session) -> None:
    s = session.stats()
    print(f"[{s.cache_label}] tokens held {s.tokens_held} (evicted {s.tokens_evicted}), "
          f"KV {s.kv_bytes / KIB:.1f} KiB of {s.budget_bytes / MIB:.0f} MiB, blocks {s.blocks_used}/{s.blocks_budget}, "
          f"tokens left {'unbounded (window)' if s.tokens_left is None else s.tokens_left}, "
          f"prefill {s.prefill_tok_s:.0f} tok/s, decode {s.decode_tok_s:.1f} tok/s, TTFT {s.ttft_s * 1000:.0f} ms")
    if s.spec is not None:
        saved = s.spec.time_saved
        gain = ("no gain measured" if saved is None or abs(saved) < 0.05 else
                f"saved ~{saved:.0%} of decode time" if saved > 0 else f"cost ~{-saved:.0%} more decode time")
        print(f"speculative ({s.spec.method}): {s.spec.accepted} of {s.spec.drafted} drafts accepted "
              f"({s.spec.acceptance_rate:.0%}), {s.spec.tokens_per_step:.2f} tokens a step, {gain}")


THINKING = "thinking: "         # marks each line of a reply's reasoning (gpt-oss's analysis channel)
DIM, RESET = "\x1b[2m", "\x1b[0m"


class ReplyPrinter:
    """A reply as it streams: its reasoning in lines marked "thinking: " (dimmed on a terminal), its answer plain."""

    def __init__(self, out, color: bool):
        self.out = out
        self.color = color
        self.thinking = False           # the last text written was reasoning
        self.line_start = True

    def reasoning(self, text: str) -> None:
        if not text:
            return
        if not self.thinking:
            if not self.line_start:
                self.out.write("\n")
            self.out.write(DIM if self.color else "")
            self.thinking, self.line_start = True, True
        for i, line in enumerate(text.split("\n")):
            if i:
                self.out.write("\n")
                self.line_start = True
            if line:
                self.out.write((THINKING if self.line_start else "") + line)
                self.line_start = False
        self.out.flush()

    def text(self, text: str) -> None:
        if not text:
            return
        self._end_thinking()
        self.out.write(text)
        self.line_start = text.endswith("\n")
        self.out.flush()

    def _end_thinking(self) -> None:
        if self.thinking:
            self.out.write((RESET if self.color else "") + ("" if self.line_start else "\n"))
            self.thinking, self.line_start = False, True

    def end(self) -> None:
        self._end_thinking()
        self.out.write("\n")
        self.out.flush()


def _color(out) -> bool:
    return bool(getattr(out, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def _stream(session, text: str, params: SamplingParams, as_json: bool = False) -> bool:
    """Print the reply as it comes (its reasoning marked apart), then what ended it when that needs saying; with
    as_json, one JSON object once it ended: text, reasoning, finish_reason, message. False when generation failed."""
    from kvchat.engine.events import FinishReason, TokenDelta, TurnFinished
    ok = True
    printer = ReplyPrinter(sys.stdout, _color(sys.stdout))
    for event in session.send(text, params):
        if isinstance(event, TokenDelta) and not as_json:
            printer.reasoning(event.reasoning)
            printer.text(event.text)
        elif isinstance(event, TurnFinished):
            if as_json:
                print(json.dumps({"text": event.text, "reasoning": event.reasoning,
                                  "finish_reason": str(event.finish_reason), "message": event.message},
                                 ensure_ascii=False))
            else:
                printer.end()
                if event.message:
                    print(f"! {event.message}", file=sys.stderr)
            ok = event.finish_reason != FinishReason.ERROR
    return ok


def _say_kernel_status(engine) -> None:
    """Once, on stderr, when the C kernels are missing: the torch fallback is correct but several times slower."""
    if engine.kernel_status:
        print(f"kvchat: {engine.kernel_status}", file=sys.stderr)


def _say_chat_format(engine) -> None:
    """Once, on stderr, when the model has no chat template: the chat is a plain-text continuation."""
    if engine.chat_format_notice:
        print(f"kvchat: {engine.chat_format_notice}", file=sys.stderr)


def cmd_chat(args) -> int:
    try:
        return _chat(args)
    except BrokenPipeError:             # the reader went away (`| head`): stop quietly, as a pipe's writer does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _chat(args) -> int:
    params = sampling_params(args)      # before anything loads: a bad value costs no wait
    if args.prompt is not None:
        from kvchat.engine.runtime import quick              # a one-shot answer without torch, where it covers the model
        if quick.covers(args):
            try:
                done = quick.one_shot(args.model, args.prompt, args.system, params)
            except ConfigError:
                done = None
            except KeyboardInterrupt:
                print("\n(stopped)", file=sys.stderr)
                return 130
            if done is not None:
                return done
    from kvchat.engine.runtime.engine import Engine
    from kvchat.engine.errors import ModelLoadError
    try:
        engine = Engine.load(engine_config(args))
    except (ModelLoadError, ConfigError) as exc:
        print(f"kvchat: {exc}", file=sys.stderr)
        return 2
    _say_kernel_status(engine)
    _say_chat_format(engine)
    session = engine.new_session(system_prompt=args.system)
    if args.prompt is not None:
        try:
            return 0 if _stream(session, args.prompt, params, args.json) else 1
        except KeyboardInterrupt:           # Ctrl+C mid-reply: what came so far stays printed
            print("\n(stopped)", file=sys.stderr)
            return 130
    print(f"kvchat: {engine.model_name} on {engine.device}, cache {session.cache_config.label()}. "
          f"Commands: /reset, /stats, /quit")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        cmd = line.strip()
        if cmd in ("/quit", "/exit"):
            return 0
        if cmd == "/reset":
            freed = session.reset()
            print(f"session reset: {freed / 1024:.1f} KiB of KV cache returned")
            continue
        if cmd == "/stats":
            _print_stats(session)
            continue
        if cmd:
            try:
                _stream(session, line, params, args.json)
            except KeyboardInterrupt:
                print("\n(stopped)")


def cmd_serve(args) -> int:
    from kvchat.engine.runtime.engine import Engine
    from kvchat.engine.errors import ModelLoadError
    from kvchat.engine.serve.server import ServeConfig, Server, api_key_from
    try:
        config = ServeConfig(host=args.host, port=args.port, api_key=api_key_from(args.api_key),
                             model_id=args.served_model_name, max_num_seqs=args.max_num_seqs,
                             prefill_chunk=args.prefill_chunk, preempt_tier_mb=args.preempt_tier_mb)
        engine = Engine.load(engine_config(args))
        server = Server(engine, config)
    except (ModelLoadError, ConfigError) as exc:
        print(f"kvchat: {exc}", file=sys.stderr)
        return 2
    _say_kernel_status(engine)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"kvchat serve: {server.model_id} on http://{host}:{args.port}/v1 (metrics at /metrics), "
          f"KV budget {server.scheduler.config.cache.budget_mb:g} MiB; Ctrl+C stops", file=sys.stderr)
    try:
        server.run()
    except OSError as exc:
        print(f"kvchat: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def cmd_bench(args) -> int:
    module = importlib.import_module(BENCHES[args.bench])
    if getattr(module, "ENGINE_OPTIONS", False):      # the benchmark loads an engine from the cache options
        args.engine_config = engine_config(args)
    from kvchat.bench.progress import Progress
    args.progress = Progress(args.bench)       # stderr: stdout carries the result alone
    with args.progress.heartbeat():
        result = module.run(args)
    args.progress.done()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        summary = getattr(module, "summarize", None)
        print(summary(result) if summary else json.dumps(result, indent=2))
    return 0


def build_parser(benches: bool = True) -> argparse.ArgumentParser:
    """benches=False leaves the benchmarks' own options out: they import torch, which a one-shot answer
    (engine.runtime.quick) does without."""
    parser = argparse.ArgumentParser(prog="kvchat", description="Chat with a local model and see its KV cache.")
    sub = parser.add_subparsers(dest="command")
    chat = sub.add_parser("chat", help="terminal chat")
    add_cache_arguments(chat)
    chat.add_argument("--prompt", default=None, help="send one message, print the reply and exit")
    chat.add_argument("--system", default=None)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--top-k", type=int, default=50)
    chat.add_argument("--repetition-penalty", type=float, default=1.1)
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--json", action="store_true", help="print each reply as one JSON object (text, reasoning, "
                                                          "finish_reason, message) once it ends")
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible server (loopback unless given an API key)")
    add_cache_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="any address but loopback needs an API key")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="clients send it as 'Authorization: Bearer KEY' "
                                                       "(or set KVCHAT_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: the file's)")
    serve.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together at most")
    serve.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per request per step")
    serve.add_argument("--preempt-tier-mb", type=float, default=2048,
                       help="MiB kept for preempted requests' caches, so they resume instead of reading their "
                            "prompt again (host memory beside a GPU, files beside a host pool; 0: read again)")
    serve.set_defaults(func=cmd_serve)
    from kvchat.engine.plan import estimate
    plan = sub.add_parser("estimate", help="KV and weight memory of a model and context, before loading it")
    estimate.add_arguments(plan)
    plan.set_defaults(func=estimate.cmd_estimate)
    from kvchat.cli import doctor
    check = sub.add_parser("doctor", help="which kernels run here and why, the device, what the CPU offers")
    doctor.add_arguments(check)
    check.set_defaults(func=doctor.cmd_doctor)
    from kvchat.cli import replay
    again = sub.add_parser("replay", help="a saved chat or a text under another cache mode: where its answers part")
    replay.add_arguments(again)
    again.set_defaults(func=replay.cmd_replay)
    bench = sub.add_parser("bench", help="benchmarks (speed, memory, quality, passkey, serve, resume, latency, attention)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        p = bsub.add_parser(name)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if not benches:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if getattr(module, "ENGINE_OPTIONS", False):
            add_cache_arguments(p)
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
        p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(benches=not argv or argv[0] not in ("chat", "serve", "estimate", "doctor"))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args) or 0
    except UserError as exc:            # a bad option value, a model whose numbers break: one line, not a traceback
        print(f"kvchat: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:           # Ctrl+C while the model loads (a reply's own Ctrl+C is caught nearer)
        return interrupted()


def interrupted() -> int:
    """One line for a Ctrl+C, and the shell's code for it; a second Ctrl+C while threads wind down ends at once."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    print("\nkvchat: stopped (Ctrl+C)", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
