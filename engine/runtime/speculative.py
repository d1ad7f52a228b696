"""Speculative decoding: a cheap proposer guesses the tokens after the next one, one step of the model verifies them
all, the accepted prefix stays in the cache and the rest is taken back.

Decode on this machine is bound by reading the weights once per step, so a step over 1 + k rows costs little more
than over one (the README's batched-decode table): every accepted draft saves most of a step.

- Proposers. PromptLookup: the tokens that followed the latest earlier match of the conversation's last n tokens
  (n from ngram_max down to ngram_min), as in llama.cpp's lookup decoding, vLLM's `ngram` speculator and
  transformers' prompt-lookup decoding: chat replies often copy from the context (code edits, quotes, summaries).
  DraftProposer: a smaller model sharing the tokenizer proposes its greedy choices from its own cache.
- Verification (ModelRunner.step with a decode item of several tokens): each row runs as plain decoding would
  run it, so greedy output is plain decoding's, token for token; ModelRunner.draft_room keeps the drafts where
  taking them back is exact (no quantized block ever holds a rejected token, no window moves for one).
- Acceptance (accept). Both proposers propose one token per position (a point mass q), so the standard rule
  (Leviathan et al. 2023, Chen et al. 2023) is: accept draft d with probability p(d), where p is what the sampler
  would draw from; at the first rejection draw from p with d removed (the residual max(0, p - q), normalised);
  after the last accepted draft draw the bonus token from its row. The output then follows the target
  distribution exactly; greedy (p a point mass) accepts exactly the drafts plain decoding would have chosen.
"""
from __future__ import annotations

import torch

from engine.config import CacheConfig, ConfigError, SamplingParams, SpeculativeConfig
from engine.events import SpecStats
from engine.kv.layout import PREFILL_CHUNK
from engine.kv.manager import NoFreeBlocks
from engine.runtime.sampling import distribution, sample

RECENT = 1024           # the ids the repetition penalty looks at, as the session's sampler


class PromptLookup:
    """N-gram matches in the conversation, kept in an index that grows with it (rebuilt when it is cut or edited)."""

    def __init__(self, ngram_max: int, ngram_min: int):
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}     # n-gram -> the latest position it ended at (with a follower)
        self._seen: list[int] = []                        # the ids indexed so far (every n-gram ending before the last)

    def _update(self, ids: list[int]) -> None:
        n_seen = len(self._seen)
        if len(ids) < n_seen or ids[:n_seen] != self._seen:
            self._index.clear()
            self._seen = []
            n_seen = 0
        for end in range(max(0, n_seen - 1), len(ids) - 1):        # n-grams ending at `end` now have a follower
            for n in self.sizes:
                if end + 1 >= n:
                    self._index[tuple(ids[end + 1 - n:end + 1])] = end
        self._seen = list(ids)

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

    def __init__(self, runner, vocab_size: int):
        self.runner = runner
        self.vocab_size = vocab_size          # the target's: a draft token past it is never proposed
        self.seq = None
        self.ids: list[int] = []              # the tokens the draft's cache holds

    def _sync(self, ids: list[int]):
        """The draft's cache holds ids[:-1]; returns the logits after ids[-1] (its forward pass)."""
        r = self.runner
        if self.seq is None or self.seq.closed:
            self.seq, self.ids = r.new_sequence(CacheConfig()), []
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
            (logits,) = r.step([(self.seq, part)], decode=[len(part) == 1])
            self.ids.extend(part)
        return logits[-1]

    def propose(self, ids: list[int], most: int) -> list[int]:
        if most <= 0 or len(ids) + most >= self.runner.config.max_position_embeddings:
            return []
        try:
            logits = self._sync(ids)
            drafts: list[int] = []
            while True:
                d = int(logits.argmax())
                if d >= self.vocab_size:
                    break
                drafts.append(d)
                if len(drafts) == most:
                    break
                (logits,) = self.runner.step([(self.seq, [d])])
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


class Speculator:
    """One conversation's speculation: its proposer, the number it proposes next (adaptive), and the turn's counts."""

    def __init__(self, config: SpeculativeConfig, draft_runner=None, vocab_size: int = 0):
        self.config = config
        self.draft_runner = draft_runner
        if config.method == "draft":
            if draft_runner is None:
                raise ConfigError("the draft model is not loaded: set speculative decoding again to load it")
            self.proposer = DraftProposer(draft_runner, vocab_size)
        else:
            self.proposer = PromptLookup(config.ngram_max, config.ngram_min)
        self.k_now = config.k
        self.reset_counts()

    def reset_counts(self) -> None:
        self.drafted = self.accepted = self.steps = self.tokens = 0

    def propose(self, ids: list[int], room: int) -> list[int]:
        """Drafts to follow ids[-1] (the next token, not in the cache yet), at most `room`."""
        most = min(room, self.k_now if self.config.adaptive else self.config.k)
        return self.proposer.propose(ids, most) if most > 0 else []

    def verify(self, session, next_id: int, params: SamplingParams, generator, room: int) -> list[int] | None:
        """One verification step after next_id (the conversation's last token, not in the cache yet): returns the
        tokens chosen (the accepted drafts, in the cache now, then the token after them), or None when nothing was
        proposed or the budget cannot take the drafts (nothing changed: a plain step follows)."""
        runner, seq = session.runner, session.seq
        drafts = self.propose(session.token_ids, runner.draft_room(seq, min(room, self.config.k)))
        if not drafts:
            return None
        try:
            (rows,) = runner.step([(seq, [next_id] + drafts)], decode=[True])
        except NoFreeBlocks:
            return None
        taken, after = accept(rows.cpu(), drafts, params, session.token_ids, generator)
        if taken < len(drafts):
            runner.truncate(seq, len(drafts) - taken)
        self.record(len(drafts), taken)
        return drafts[:taken] + [after]

    def record(self, drafted: int, accepted: int) -> None:
        """One decode step: `drafted` verified, `accepted` kept (0, 0 for a plain step)."""
        self.steps += 1
        self.tokens += 1 + accepted
        self.drafted += drafted
        self.accepted += accepted
        if drafted and self.config.adaptive:
            # all taken: guess further; else guess about as far as was right (at least 1)
            self.k_now = min(self.config.k, self.k_now + 2) if accepted == drafted else max(1, accepted + 1)

    def stats(self) -> SpecStats:
        return SpecStats(self.config.method, self.drafted, self.accepted, self.steps, self.tokens)

    def close(self) -> None:
        self.proposer.close()


def accept(rows: torch.Tensor, drafts: list[int], params: SamplingParams, recent_ids: list[int],
           generator: torch.Generator | None) -> tuple[int, int]:
    """rows [1 + k, vocab]: the verification's logits (row i after the i-th draft; row 0 after the next token).
    Returns (drafts accepted, the token after them): greedy takes a draft while it is the argmax, sampling with
    probability p(draft) and otherwise draws from p without it (the module's rule)."""
    context = list(recent_ids[-RECENT:])
    for i, d in enumerate(drafts):
        if params.greedy:
            chosen = sample(rows[i], params, context[-RECENT:], None)
            if chosen != d:
                return i, chosen
        else:
            p = distribution(rows[i], params, context[-RECENT:])
            if float(torch.rand((), generator=generator)) >= float(p[d]):
                rest = p.clone()
                rest[d] = 0.0
                if float(rest.sum()) > 0.0:        # (nothing left only where rounding put all of p on d: keep it)
                    return i, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
        context.append(d)
    k = len(drafts)
    return k, sample(rows[k], params, context[-RECENT:], generator)
