"""What a cache mode costs in fidelity: the same tokens teacher-forced through a full-precision session and
through the mode's, in lockstep, compared position by position (top-1 agreement, KL, perplexity).

The app's quality line and `kvchat bench quality` both measure with compare_modes.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from kvchat.engine.config import CacheConfig


class _Tally:
    """Per-position agreement, KL and negative log-likelihood of one mode against the baseline."""

    def __init__(self):
        self.top1: list[bool] = []
        self.kl: list[float] = []
        self.nll: list[float] = []

    def add(self, logp: torch.Tensor, base_logp: torch.Tensor, targets: torch.Tensor) -> None:
        # logp, base_logp: [T, vocab] log-probabilities; targets: [T] next tokens (-1: none)
        self.top1 += (logp.argmax(-1) == base_logp.argmax(-1)).tolist()
        self.kl += (base_logp.exp() * (base_logp - logp)).sum(-1).tolist()
        ok = targets >= 0
        self.nll += logp[ok].gather(-1, targets[ok, None]).neg().squeeze(-1).tolist()


def perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def _report(tally: _Tally, base: _Tally, config: CacheConfig) -> dict:
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
    """compare_modes stopped early because its should_stop callable said so."""


def compare_modes(engine, ids: list[int], modes: dict[str, CacheConfig], limits: dict[str, int] | None = None,
                  step: int = 1, should_stop: Callable[[], bool] | None = None) -> dict:
    """Teacher-force ids through a full-precision session and one session per mode, in lockstep.

    limits: tokens per mode (default all). should_stop is asked before every step; when it answers
    True, Cancelled is raised (the app measures in its engine thread and must yield to a new turn).
    Returns {"baseline": {...}, mode: {...}}.
    """
    limits = limits or {}
    budget = engine.budget_mb           # the engine's budget is everyone's: measuring must not change it
    dtype = engine.dtype_name
    full = CacheConfig(k_format=dtype, v_format=dtype, budget_mb=budget)
    base_session = engine.new_session(cache=full)
    sessions = {name: engine.new_session(cache=c.with_(budget_mb=budget)) for name, c in modes.items()}
    try:
        return _compare(engine, ids, modes, limits, step, should_stop, full, base_session, sessions)
    finally:                            # give the pool back at once (the app measures beside an open chat)
        for session in (base_session, *sessions.values()):
            session.close()


def _compare(engine, ids, modes, limits, step, should_stop, full, base_session, sessions) -> dict:
    base, tallies = _Tally(), {name: _Tally() for name in modes}
    seconds = {name: 0.0 for name in modes}
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
    out = {"baseline": {"label": full.label(), "tokens": n, "ppl": perplexity(base.nll)}}
    for name, config in modes.items():
        out[name] = _report(tallies[name], base, config)
        stats = sessions[name].stats()
        out[name]["kv_bytes"] = stats.kv_bytes
        out[name]["tokens_held"] = stats.tokens_held        # fewer than "tokens": a window slid
        out[name]["seconds"] = seconds[name]
    out["baseline"]["kv_bytes"] = base_session.stats().kv_bytes
    return out
