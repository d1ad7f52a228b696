"""The decode driver: what one sequence does with its logits, the same in a chat session and in a served request.

The server's scheduler feeds many sequences in one runner step and hands each its rows; a session is the batch of
one and steps the runner itself. Either way the rules per sequence are these, written once: the next token drawn
with the request's settings and its own seeded generator (engine/runtime/sampling.py); whether the reply ends there
and why, in engine.events.FinishReason's words; and speculative decoding's round trip (engine/runtime/speculative.py):
drafts proposed after the next token, verified in the same step, the accepted prefix kept, the rest taken back.

A Decoder holds no token ids: the caller's conversation (a session's token_ids, a request's prompt and output)
comes in with each call, so preemption, a regenerate or a rewind never leaves two copies to agree.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Sequence

import torch

from kvchat.engine.config import SamplingParams
from kvchat.engine.events import FinishReason
from kvchat.engine.kv.manager import NoFreeBlocks
from kvchat.engine.runtime.overflow import BudgetFull
from kvchat.engine.runtime.sampling import RECENT, NonFiniteLogits, sample
from kvchat.engine.runtime.speculative import DraftProposer, Speculator, accept


def new_generator(params: SamplingParams) -> torch.Generator | None:
    """The sequence's own draws: from params.seed, so that a seeded request repeats, else from the clock. Greedy
    draws nothing."""
    if params.greedy:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed if params.seed is not None else int(time.time_ns() % 2**63))
    return generator


def may_speculate(params: SamplingParams) -> bool:
    """A seeded sample must repeat: drafts, verified or not, take other random draws, and whether they are proposed
    depends on timing. Greedy and unseeded sampling speculate."""
    return params.greedy or params.seed is None


def past_context(position: int, max_context: int | None) -> bool:
    """No token is chosen at a position the model's context does not have (max_context None: a window re-positions
    every token, so none is past it)."""
    return max_context is not None and position >= max_context


class Decoder:
    """One sequence's decoding: its settings, its generator, its speculation (None: plain steps) and its finish rules.

    The generator lives as long as the decoder (a served request keeps it through preemption, so its draws go on
    where they stopped); the speculation may be swapped (a preempted request's draft cache went with its own)."""

    def __init__(self, params: SamplingParams, stop_ids: frozenset[int], *, ignore_eos: bool = False,
                 spec: Speculator | None = None):
        self.params = params
        self.stop_ids = stop_ids
        self.ignore_eos = ignore_eos
        self.generator = new_generator(params)
        self.spec = spec

    # ---- the next token ----------------------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, ids: Sequence[int], generated: Sequence[int]) -> int:
        """logits [vocab] after ids[-1] -> the next token. ids: the sequence so far (the repetition penalty reads its
        last RECENT); generated: the reply so far (the presence and frequency penalties). Raises NonFiniteLogits."""
        return sample(logits.float().cpu(), self.params, ids[-RECENT:], self.generator, generated)

    def finish(self, token: int, num_generated: int) -> FinishReason | None:
        """Whether `token`, chosen after num_generated tokens of the reply, ends it: EOS (a stop token, Harmony's
        <|return|> and <|call|> among them: chat_format.stop_ids; the token is not part of the reply) or LENGTH (the
        token is the reply's last); None while it goes on. The context, the budget, a stop or a stop string are the
        caller's to see; they end a reply in the same words."""
        if token in self.stop_ids and not self.ignore_eos:
            return FinishReason.EOS
        if num_generated + 1 >= self.params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    # ---- speculation ---------------------------------------------------------------------------------------------

    def draft_limit(self, room: int) -> int:
        """At most how many drafts to ask the cache room for (its draft_room), given `room` the reply and context
        leave; 0 when this sequence does not speculate."""
        return min(room, self.spec.config.k) if self.spec is not None else 0

    def drafts(self, ids: list[int], room: int, batch: int = 1, protect: frozenset[int] = frozenset()) -> list[int]:
        """Drafts to follow ids[-1] (the next token: fed in the same step, before them), at most `room` (what the cache
        can take back exactly); [] for a plain step. batch: the decoding sequences sharing the step. protect: the
        sequence ids a draft model's own steps must not release for room (those it drafts for)."""
        if self.spec is None:
            return []
        if isinstance(self.spec.proposer, DraftProposer):
            self.spec.proposer.protect = protect
        return self.spec.propose(ids, room, batch)

    def verified(self, rows: torch.Tensor, drafts: list[int], ids: Sequence[int],
                 generated: Sequence[int]) -> tuple[list[int], int]:
        """rows [1 + k, vocab]: a verification's logits after ids[-1] and each draft (generated: the reply up to
        ids[-1]) -> (the tokens chosen: the accepted drafts, in the cache now, then the token after them; how many
        drafts were rejected, for the caller to take back from its cache)."""
        taken, after = accept(rows.float().cpu(), drafts, self.params, ids, self.generator, generated)
        self.spec.record(len(drafts), taken)
        return drafts[:taken] + [after], len(drafts) - taken

    def plain_step(self, seconds: float | None = None) -> None:
        """A decode step that verified nothing: the speculation counts it (and learns a plain step's cost, timed)."""
        if self.spec is not None:
            self.spec.record(0, 0, seconds)

    def verify_alone(self, runner, seq, ids: list[int], generated: Sequence[int], room: int) -> list[int] | None:
        """The round trip as a batch of one (a session's step): drafts after ids[-1] (the next token, not in the cache
        yet), one verification step of `seq` on `runner`, the rejected drafts taken back. Returns the tokens chosen,
        or None when nothing was proposed or the budget cannot take the drafts (nothing changed: a plain step
        follows)."""
        spec = self.spec
        entered = time.perf_counter()
        try:
            limit = runner.draft_room(seq, self.draft_limit(room))
            drafts = self.drafts(ids, limit, protect=frozenset(m.seq_id for m in seq.members))
            if not drafts:
                return None
            started = time.perf_counter()
            try:
                (rows,) = runner.step([(seq, [ids[-1]] + drafts)], decode=[True])
            except NoFreeBlocks:
                return None
            spec.costs.verified(1 + len(drafts), time.perf_counter() - started)
            chosen, rejected = self.verified(rows, drafts, ids, generated)
            if rejected:
                runner.truncate(seq, rejected)
            return chosen
        finally:
            spec.steps_s += time.perf_counter() - entered     # a proposal that came to nothing took time too


def decode_alone(decoder: Decoder, state, runner, logits: torch.Tensor, *, feed: Callable[[list[int]], torch.Tensor],
                 context_limit: Callable[[], int | None], context_message: Callable[[], str],
                 should_stop: Callable[[], bool] | None,
                 started: float) -> Generator[int, None, tuple[FinishReason, str]]:
    """A batch of one decoding (a session's turn) from the logits after its prompt: yields each reply token (already
    in state.token_ids) and returns (why it ended, a message for the user). state: the SessionState (its seq is read
    anew each step: a slide into a window replaces it; its turn_times are filled in as the reply streams).
    feed: the session's way into its cache (slides or raises BudgetFull when the budget is full); context_limit:
    the positions the context has now (None under a window)."""
    reply: list[int] = []
    chosen: deque[int] = deque()        # tokens a verification chose; all but the last are in the cache already
    times = state.turn_times
    decode_started = time.perf_counter()
    try:
        while True:
            if should_stop is not None and should_stop():
                return FinishReason.STOPPED, ""
            if not chosen and past_context(state.num_cached, context_limit()):
                return FinishReason.CONTEXT, context_message()
            try:
                token = chosen.popleft() if chosen else decoder.sample(logits, state.token_ids, reply)
            except NonFiniteLogits as exc:
                return FinishReason.ERROR, str(exc)
            if not reply:
                times.ttft_s = time.perf_counter() - started
            state.token_ids.append(token)
            end = decoder.finish(token, len(reply))
            if end == FinishReason.EOS:
                return end, ""
            reply.append(token)
            yield token
            if end is not None:
                return end, ""
            if chosen:
                continue
            try:
                if decoder.spec is not None:
                    # the drafts, and the token after them, still fit: within what the turn may generate, at most k
                    # (a max_new_tokens of 10**12 counted down one by one never ended), and within the context
                    room, limit = decoder.draft_limit(decoder.params.max_new_tokens - len(reply) - 1), context_limit()
                    while room > 0 and past_context(state.num_cached + room, limit):
                        room -= 1
                    verified = decoder.verify_alone(runner, state.seq, state.token_ids, reply, room)
                    if verified is not None:
                        chosen.extend(verified)
                        times.decode_tokens += len(verified)
                        times.decode_s = time.perf_counter() - decode_started   # live rate for stats()
                        continue
                stepped = time.perf_counter()
                logits = feed([token])[-1]
                decoder.plain_step(time.perf_counter() - stepped)
            except BudgetFull as exc:
                return FinishReason.BUDGET, str(exc)
            except NonFiniteLogits as exc:      # a verification's rows: the caller takes its drafts back
                return FinishReason.ERROR, str(exc)
            times.decode_tokens += 1
            times.decode_s = time.perf_counter() - decode_started
    finally:
        times.decode_s = time.perf_counter() - decode_started
        times.spec = decoder.spec.stats() if decoder.spec is not None else None
