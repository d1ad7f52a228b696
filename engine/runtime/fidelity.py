"""What a cache mode costs in fidelity: the same tokens teacher-forced through a baseline session (full precision
unless told otherwise) and through the mode's, in lockstep, compared position by position (top-1 agreement, KL,
perplexity).

The app's quality line and `kvchat bench quality` measure with compare_modes; a replay of a chat under another mode
(engine/runtime/replay.py) reads the same per-position tallies from teacher_force, so its figures are theirs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvchat.engine.config import CacheConfig


class Tally:
    """Per position of one session against the baseline: whether the greedy choices agree, KL, the negative
    log-likelihood of the next token, and the session's own greedy choice (where the two part, what each chose)."""

    def __init__(self):
        self.top1: list[bool] = []
        self.kl: list[float] = []
        self.nll: list[float] = []
        self.greedy: list[int] = []

    def add(self, logp: torch.Tensor, base_logp: torch.Tensor, targets: torch.Tensor) -> None:
        # logp, base_logp: [T, vocab] log-probabilities; targets: [T] next tokens (-1: none)
        greedy = logp.argmax(-1)
        self.greedy += greedy.tolist()
        self.top1 += (greedy == base_logp.argmax(-1)).tolist()
        self.kl += (base_logp.exp() * (base_logp - logp)).sum(-1).tolist()
        ok = targets >= 0
        self.nll += logp[ok].gather(-1, targets[ok, None]).neg().squeeze(-1).tolist()


def perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def _report(tally: Tally, base: Tally, config: CacheConfig) -> dict:
    n = len(tally.nll)
    q = n // 4
    ratio = perplexity(tally.nll) / perplexity(base.nll[:n])
    first = perplexity(tally.nll[:q]) / perplexity(base.nll[:q])
    last = perplexity(tally.nll[-q:]) / perplexity(base.nll[n - q:n])
    return {
        "label": config.label(),
        "tokens": len(tally.top1),
        "top1_agreement": sum(tally.top1) / len(tally.top1),
        "mean_kl": sum(tally.kl) / len(tally.kl),
        "ppl": perplexity(tally.nll),
        "ppl_ratio": ratio,
        "ppl_ratio_first_quarter": first,
        "ppl_ratio_last_quarter": last,
        "last_over_first_quarter": last / first,
    }


class Cancelled(Exception):
    """A teacher-forced run (compare_modes, a replay) stopped early because its should_stop callable said so."""


@dataclass(frozen=True)
class Lockstep:
    """What one teacher-forced run left: the baseline's tally and one per mode (lists of per-position figures), and
    what each session held at the end."""
    baseline: CacheConfig
    base: Tally
    tallies: dict[str, Tally]
    seconds: dict[str, float]           # each mode's own forward time
    kv_bytes: dict[str, int]
    tokens_held: dict[str, int]         # fewer than the tokens read: a window slid
    baseline_kv_bytes: int


def compare_modes(engine, ids: list[int], modes: dict[str, CacheConfig], limits: dict[str, int] | None = None,
                  step: int = 1, should_stop: Callable[[], bool] | None = None,
                  baseline: CacheConfig | None = None, lead: int = 0) -> dict:
    """Teacher-force ids through a baseline session (full precision by default) and one session per mode, in
    lockstep (teacher_force). Returns {"baseline": {...}, mode: {...}}: per mode its top-1 agreement, mean KL and
    perplexity ratios against the baseline, the bytes it held and its forward time."""
    run = teacher_force(engine, ids, modes, baseline, limits, step, should_stop, lead=lead)
    out = {"baseline": {"label": run.baseline.label(), "tokens": len(ids) - lead, "ppl": perplexity(run.base.nll),
                        "kv_bytes": run.baseline_kv_bytes}}
    for name, config in modes.items():
        out[name] = _report(run.tallies[name], run.base, config)
        out[name].update(kv_bytes=run.kv_bytes[name], tokens_held=run.tokens_held[name], seconds=run.seconds[name])
    return out


def teacher_force(engine, ids: list[int], modes: dict[str, CacheConfig], baseline: CacheConfig | None = None,
                  limits: dict[str, int] | None = None, step: int = 1, should_stop: Callable[[], bool] | None = None,
                  progress: Callable[[int, int], None] | None = None, lead: int = 0) -> Lockstep:
    """Feed ids `step` tokens at a time to a baseline session and one session per mode, and tally each mode's
    logits against the baseline's at every position (the logits at p predict token p + 1).

    limits: tokens per mode (default all). should_stop is asked before every step; when it answers True, Cancelled
    is raised (the app measures in its engine thread and must yield to a new turn). progress(done, total) follows
    each step. lead: the first `lead` tokens are read first as one prompt by every session (in its prompt chunks,
    as a conversation reads a pasted text) and not tallied. Every session opened here is closed however it ends: nothing is left held but blocks kept for prefix
    reuse, which the pool gives back first."""
    budget = engine.budget_mb           # the engine's budget is everyone's: measuring must not change it
    dtype = engine.dtype_name
    baseline = baseline or CacheConfig(k_format=dtype, v_format=dtype)
    opened = []                         # closed however the run ends, one that failed to open the next included
    try:
        for config in (baseline, *modes.values()):
            opened.append(engine.new_session(cache=config.with_(budget_mb=budget)))
        base_session, sessions = opened[0], dict(zip(modes, opened[1:]))
        if lead:
            for session in opened:
                session.append(ids[:lead], all_logits=False)
        base, tallies, seconds = _lockstep(ids[lead:], base_session, sessions, limits or {}, step, should_stop,
                                           progress)
        stats = {name: session.stats() for name, session in sessions.items()}
        return Lockstep(baseline, base, tallies, seconds, {name: s.kv_bytes for name, s in stats.items()},
                        {name: s.tokens_held for name, s in stats.items()}, base_session.stats().kv_bytes)
    finally:                            # give the pool back at once (the app measures beside an open chat)
        for session in opened:
            session.close()


def _lockstep(ids, base_session, sessions, limits, step, should_stop, progress) -> tuple[Tally, dict, dict]:
    """The steps themselves: (the baseline's tally, each mode's tally, each mode's forward seconds)."""
    base, tallies = Tally(), {name: Tally() for name in sessions}
    seconds = {name: 0.0 for name in sessions}
    n = len(ids)
    for i in range(0, n, step):
        if should_stop is not None and should_stop():
            raise Cancelled
        chunk = ids[i:i + step]
        nxt = ids[i + 1:i + 1 + len(chunk)]
        targets = torch.tensor(nxt + [-1] * (len(chunk) - len(nxt)))
        base_logp = torch.log_softmax(base_session.append(chunk).float(), -1)
        base.add(base_logp, base_logp, targets)
        for name, session in sessions.items():
            if i >= limits.get(name, n):
                continue
            started = time.perf_counter()
            logits = session.append(chunk)
            seconds[name] += time.perf_counter() - started
            tallies[name].add(torch.log_softmax(logits.float(), -1), base_logp, targets)
        if progress is not None:
            progress(i + len(chunk), n)
    return base, tallies, seconds
