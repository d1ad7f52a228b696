"""Speculative decoding: a cheap proposer guesses the tokens after the next one, one step of the model verifies them
all, the accepted prefix stays in the cache and the rest is taken back.

Where decode is bound by reading the weights once per step (a GPU, a large model), a step over 1 + k rows costs
little more than over one, and every accepted draft saves most of a step. On a small model on two CPU cores a row
costs about half a step (the kernels' per-row arithmetic bounds decode there), so only long accepted runs pay:
the number of drafts is chosen from what a row costs and how often drafts are accepted (Speculator.worth).

- Proposers. PromptLookup: the tokens that followed the latest earlier match of the conversation's last n tokens
  (n from ngram_max down to ngram_min), as in llama.cpp's lookup decoding, vLLM's `ngram` speculator and
  transformers' prompt-lookup decoding: chat replies often copy from the context (code edits, quotes, summaries).
  DraftProposer: a smaller model sharing the tokenizer proposes its greedy choices from its own cache.
- Verification (ModelRunner.step with a decode item of several tokens): each row runs as plain decoding would
  run it, so greedy output is plain decoding's, token for token; ModelRunner.draft_room keeps the drafts where
  taking them back is exact (no quantized block ever holds a rejected token, no window moves for one).
- The round trip (propose, verify, accept, take back) is the decode driver's (engine/runtime/driver.py), the same
  for a session and for a served request.
- Acceptance (accept). Both proposers propose one token per position (a point mass q), so the standard rule
  (Leviathan et al. 2023, Chen et al. 2023) is: accept draft d with probability p(d), where p is what the sampler
  would draw from; at the first rejection draw from p with d removed (the residual max(0, p - q), normalised);
  after the last accepted draft draw the bonus token from its row. The output then follows the target
  distribution exactly; greedy (p a point mass) accepts exactly the drafts plain decoding would have chosen.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.engine.config import CacheConfig, ConfigError, SamplingParams, SpeculativeConfig
from kvchat.engine.events import SpecStats
from kvchat.engine.kv.layout import PREFILL_CHUNK
from kvchat.engine.kv.manager import NoFreeBlocks
from kvchat.engine.runtime.sampling import RECENT, distribution, sample


class PromptLookup:
    """N-gram matches in the conversation, kept in an index that grows with it (rebuilt when it is cut or edited)."""

    def __init__(self, ngram_max: int, ngram_min: int):
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}     # n-gram -> the latest position it ended at (with a follower)
        self._seen: list[int] = []                        # the ids indexed so far (every n-gram ending before the last)

    CHECK = 64          # the indexed tokens compared each step: a cut or an edit changes the newest of them

    def _update(self, ids: list[int]) -> None:
        n_seen = len(self._seen)
        if len(ids) < n_seen or ids[max(0, n_seen - self.CHECK):n_seen] != self._seen[-self.CHECK:]:
            self._index.clear()
            self._seen = []
            n_seen = 0
        for end in range(max(0, n_seen - 1), len(ids) - 1):        # n-grams ending at `end` now have a follower
            for n in self.sizes:
                if end + 1 >= n:
                    self._index[tuple(ids[end + 1 - n:end + 1])] = end
        self._seen.extend(ids[n_seen:])

    def propose(self, ids: list[int], most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if most <= 0:
            return []
        self._update(ids)
        for n in self.sizes:
            if len(ids) > n:
                end = self._index.get(tuple(ids[-n:]))
                if end is not None:
                    return ids[end + 1:end + 1 + most]
        return []

    def close(self) -> None:
        self._index.clear()
        self._seen = []


class DraftProposer:
    """A draft model's greedy guesses. Its conversation lives in the draft model's runner (the target's own when the
    draft is the loaded model itself) and follows the target's tokens: what the target rejected is taken back."""

    def __init__(self, runner, vocab_size: int, cache: CacheConfig | None = None):
        self.runner = runner
        self.vocab_size = vocab_size          # the target's: a draft token past it is never proposed
        # its cache: the conversation's own where that is full precision without a window (then the model as its own
        # draft shares the conversation's blocks through the prefix cache), else full precision of the model dtype
        plain = cache is not None and not cache.is_quantized and cache.window is None
        self.cache = cache if plain else CacheConfig(block_size=cache.block_size if cache else 16)
        self.seq = None
        self.ids: list[int] = []              # the tokens the draft's cache holds
        self.protect: frozenset[int] = frozenset()   # the target's sequence ids: never released for the draft's room

    def _sync(self, ids: list[int]):
        """The draft's cache holds ids[:-1]; returns the logits after ids[-1] (its forward pass)."""
        r = self.runner
        if self.seq is None or self.seq.closed:
            self.seq, self.ids = r.new_sequence(self.cache), []
        if self.seq.released or self.seq.num_tokens != len(self.ids):   # the budget took its blocks back
            r.free(self.seq)
            self.ids = []
        common = 0
        for a, b in zip(self.ids, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)       # the last token is always read, for its logits
        if common < len(self.ids):
            try:
                r.truncate(self.seq, len(self.ids) - common)
            except ConfigError:          # a draft model with a recurrent state: back to its snapshot before, if any
                back = r.state_return(self.seq, common)
                try:
                    if back is None:
                        raise ConfigError("no snapshot")
                    r.truncate(self.seq, len(self.ids) - back)
                    common = back
                except ConfigError:
                    r.free(self.seq)
                    common = 0
            self.ids = ids[:common]
        if not self.ids:
            common = r.match_prefix(self.seq, ids)
            self.ids = ids[:common]
        logits = None
        for i in range(common, len(ids), PREFILL_CHUNK):
            part = ids[i:i + PREFILL_CHUNK]
            (logits,) = r.step([(self.seq, part)], decode=[len(part) == 1], keep=self.protect)
            self.ids.extend(part)
        return logits[-1]

    def propose(self, ids: list[int], most: int) -> list[int]:
        if most <= 0 or len(ids) + most >= self.runner.config.max_position_embeddings:
            return []
        try:
            logits = self._sync(ids)
            self.runner.snapshot(self.seq)    # a draft model with a recurrent state comes back here next round
            drafts: list[int] = []
            while True:
                d = int(logits.argmax())
                if d >= self.vocab_size:
                    break
                drafts.append(d)
                if len(drafts) == most:
                    break
                (logits,) = self.runner.step([(self.seq, [d])], keep=self.protect)
                self.ids.append(d)
                logits = logits[-1]
            return drafts
        except NoFreeBlocks:                  # no room for the draft's cache: no guesses this step
            self.close()
            return []

    def close(self) -> None:
        if self.seq is not None and not self.seq.closed:
            self.runner.close(self.seq)
        self.seq, self.ids = None, []


class StepCosts:
    """What a decode step costs on this machine and model, learned as it runs: the time of a plain step and the time
    each further row adds to a verification, as moving averages. One per runner (the same weights and kernels for
    every conversation). Where weights dominate (a GPU, a large model) a row costs a small share of a step; on a
    small model on two CPU cores it costs most of one, and only long accepted runs pay."""

    DECAY = 0.8

    def __init__(self, row_share: float = 0.25):
        self.step_s: float | None = None
        self.row_s: float | None = None
        self._guess = row_share

    def plain(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else self.DECAY * self.step_s + (1 - self.DECAY) * seconds

    def verified(self, rows: int, seconds: float) -> None:
        if self.step_s is None or rows < 2:
            return
        per_row = max(0.0, (seconds - self.step_s) / (rows - 1))
        self.row_s = per_row if self.row_s is None else self.DECAY * self.row_s + (1 - self.DECAY) * per_row

    @property
    def row_share(self) -> float:
        """A further row's time as a share of a plain step's."""
        if self.step_s and self.row_s is not None:
            return self.row_s / self.step_s
        return self._guess


class Speculator:
    """One conversation's speculation: its proposer, how many drafts pay now, and the turn's counts.

    How many (adaptive): with a per-token acceptance rate a (a moving estimate) and a further row costing a share c
    of a step, k drafts give 1 + a + ... + a^k tokens for 1 + c k of a step's time; the k that gives most per time
    is proposed (0: a plain step). Proposals not verified are still checked against the token that follows, so the
    estimate recovers when the reply starts copying."""

    DECAY = 0.7
    PROBE = 16          # a draft model that stopped paying verifies one guess every PROBE steps

    def __init__(self, config: SpeculativeConfig, draft_runner=None, vocab_size: int = 0, costs: StepCosts | None = None,
                 cache: CacheConfig | None = None):
        self.config = config
        self.draft_runner = draft_runner
        self.costs = costs or StepCosts()
        if config.method == "draft":
            if draft_runner is None:
                raise ConfigError("the draft model is not loaded: set speculative decoding again to load it")
            self.proposer = DraftProposer(draft_runner, vocab_size, cache)
        else:
            self.proposer = PromptLookup(config.ngram_max, config.ngram_min)
        self._hits, self._tries = 1.0, 2.0          # the acceptance estimate starts at 1/2
        self._shadow: tuple[int, int] | None = None  # (position, first draft) of a proposal not verified
        self._idle = 0                               # steps since a draft model last proposed
        self.reset_counts()

    @classmethod
    def following(cls, current: "Speculator | None", runner, cache: CacheConfig) -> "Speculator | None":
        """A conversation's speculation for its next turn under the runner's setting now (switched live): `current`
        while the setting is unchanged, a new one when it changed, None when it is off; its counts start over."""
        config, draft = runner.speculation, runner.draft_runner
        if current is not None and (current.config != config or current.draft_runner is not draft):
            current.close()
            current = None
        if current is None and config.enabled:
            current = cls(config, draft, runner.config.vocab_size, runner.step_costs, cache)
        if current is not None:
            current.reset_counts()
        return current

    def reset_counts(self) -> None:
        self.drafted = self.accepted = self.steps = self.tokens = 0
        self.steps_s = 0.0          # the turn's decode steps' time: proposing, verifying and plain steps

    @property
    def acceptance(self) -> float:
        return self._hits / self._tries

    def _observe(self, hits: int, tries: int) -> None:
        self._hits = self.DECAY * self._hits + hits
        self._tries = self.DECAY * self._tries + tries

    def worth(self, most: int, batch: int = 1) -> int:
        """The number of drafts that gives the most tokens per time now (at most `most`). batch: the decoding
        sequences sharing the step (serving): a step of B rows costs 1 + c (B - 1) steps, so a further row costs
        c B / (1 + c (B - 1)) of one sequence's share, nearly a whole share in a large batch (where vLLM, too,
        turns speculation off)."""
        if not self.config.adaptive:
            return most
        a, c = min(self.acceptance, 0.999), self.costs.row_share
        c = c * batch / (1 + c * (batch - 1))
        best, best_rate, tokens = 0, 1.0, 1.0
        for k in range(1, most + 1):
            tokens += a ** k
            rate = tokens / (1 + c * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def propose(self, ids: list[int], room: int, batch: int = 1) -> list[int]:
        """Drafts to follow ids[-1] (the next token, not in the cache yet), at most `room`; [] for a plain step."""
        if self._shadow is not None:       # did the last unverified proposal guess the token that came?
            pos, first = self._shadow
            if len(ids) > pos + 1:
                self._observe(int(ids[pos + 1] == first), 1)
            self._shadow = None
        if room <= 0:
            return []
        want = self.worth(room, batch)
        if want == 0 and self.config.method == "draft":
            # a draft model's guesses are not free, so none are made in the shadow: every PROBE-th step verifies one
            self._idle += 1
            if self._idle < self.PROBE:
                return []
            want = 1
        self._idle = 0
        drafts = self.proposer.propose(ids, max(1, want))
        if want == 0:
            if drafts:
                self._shadow = (len(ids) - 1, drafts[0])
            return []
        return drafts

    def record(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """One decode step: `drafted` verified, `accepted` kept (0, 0 for a plain step taking `seconds`)."""
        self.steps += 1
        self.tokens += 1 + accepted
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self._observe(accepted, accepted + int(accepted < drafted))
        elif seconds is not None:
            self.costs.plain(seconds)
            self.steps_s += seconds

    def stats(self) -> SpecStats:
        return SpecStats(self.config.method, self.drafted, self.accepted, self.steps, self.tokens,
                         self.steps_s, self.costs.step_s or 0.0)

    def close(self) -> None:
        self.proposer.close()


def accept(rows: torch.Tensor, drafts: list[int], params: SamplingParams, recent_ids: list[int],
           generator: torch.Generator | None, generated: Sequence[int] = ()) -> tuple[int, int]:
    """rows [1 + k, vocab]: the verification's logits (row i after the i-th draft; row 0 after the next token).
    generated: the reply's tokens up to the next token (the presence and frequency penalties count them).
    Returns (drafts accepted, the token after them): greedy takes a draft while it is the argmax, sampling with
    probability p(draft) and otherwise draws from p without it (the module's rule)."""
    context = list(recent_ids[-RECENT:])
    reply = list(generated[-RECENT:])
    for i, d in enumerate(drafts):
        if params.greedy:
            chosen = sample(rows[i], params, context[-RECENT:], None, reply)
            if chosen != d:
                return i, chosen
        else:
            p = distribution(rows[i], params, context[-RECENT:], reply)
            if float(torch.rand((), generator=generator)) >= float(p[d]):
                rest = p.clone()
                rest[d] = 0.0
                if float(rest.sum()) > 0.0:        # (nothing left only where rounding put all of p on d: keep it)
                    return i, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
        context.append(d)
        reply.append(d)
    k = len(drafts)
    return k, sample(rows[k], params, context[-RECENT:], generator, reply)
