"""A session is one conversation: its messages, its token ids, its sequence in the engine's KV pool.

The chat layer: chat template, sampling, events, the overflow policy. The model runner does the
forward passes and owns the cache; a session holds one `Sequence` of it (and, after a regenerate,
the sequences of the replies it kept as alternatives).

The statistics a session reports are in engine/runtime/session_stats.py, what it does when the budget or
the context runs out in engine/runtime/overflow.py, speculative decoding's proposers and acceptance in
engine/runtime/speculative.py. What is left is ~560 lines, past the ~400 the style asks for: the four ways a
turn starts (send, regenerate, continue_reply, append) and the decode loop share the conversation's token
bookkeeping and its undo rules, and read best together.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Generator, Iterator

import torch

from kvchat.engine.runtime import memory, overflow, session_stats, warm
from kvchat.engine.runtime.warm import RELEASED_NOTICE
from kvchat.engine.text.chat_format import encode_conversation, held_prefix, tokenize_pieces
from kvchat.engine.config import CacheConfig, ConfigError, SamplingParams
from kvchat.engine.text.reasoning import PLAIN, REASONING_KEY, assistant_message
from kvchat.engine.events import FinishReason, PoolStats, PrefillProgress, StatsSnapshot, TokenDelta, TurnFinished
from kvchat.engine.kv.layout import WindowGeometry
from kvchat.engine.kv.manager import NoFreeBlocks
from kvchat.engine.plan.fit import trim_heap
from kvchat.engine.runtime.overflow import BudgetFull
from kvchat.engine.runtime.runner import ModelRunner
from kvchat.engine.runtime.sampling import RECENT, NonFiniteLogits, sample
from kvchat.engine.runtime.speculative import Speculator
from kvchat.engine.runtime.turns import SessionBusy, SessionClosed  # noqa: F401 - raised by a session's methods
from kvchat.engine.runtime.turns import TurnGuard, TurnTimes, checked_history, checked_params, checked_text, turn


TurnEvent = PrefillProgress | TokenDelta | TurnFinished


class Stopped(Exception):
    """The user stopped the turn while its prompt was being read."""


@dataclass(frozen=True)
class ModelInfo:
    """What a session needs to know about the loaded model besides the runner."""

    name: str
    tokenizer: object
    stop_ids: frozenset[int]
    max_context: int
    weight_bytes: int = 0
    weights_label: str = ""
    reply: object = PLAIN               # the format its replies come in (engine.text.reply.reply_format)


@dataclass
class Alternative:
    """A reply the user regenerated away from, kept with its cache until the budget needs the room."""

    text: str
    seq: object
    token_ids: list[int] = field(default_factory=list)
    reasoning: str = ""


class Session:
    def __init__(self, runner: ModelRunner, info: ModelInfo, cache: CacheConfig, system_prompt: str | None = None,
                 history: list[dict] | None = None, prefix_cache: bool = True):
        self.runner = runner
        self.info = info
        self.system_prompt = checked_text(system_prompt, "the system prompt") if system_prompt else None
        self.messages: list[dict] = checked_history(history)
        self._config = cache
        self.seq = runner.new_sequence(cache)
        self.prefix_cache = prefix_cache
        self.token_ids: list[int] = []      # the conversation as tokens; the cache holds the first seq.num_tokens
        self.alternatives: list[Alternative] = []   # earlier replies to the last user message
        self._prompt_end = 0                # tokens before the last reply
        self._prompt_logits: torch.Tensor | None = None
        self._starts: list[int | None] = [None] * len(self.messages)   # token index where each message begins
        self.turn_times = TurnTimes()
        self.notice = ""
        self._guard = TurnGuard()
        self.warm = None                    # (WarmStore, key, model identity): where this cache is kept (engine.keep_warm)
        self.tier = "pool"                  # where the cache is: pool, host (released to host memory), disk (to its
                                            # saved file) or none
        self._spec: Speculator | None = None  # speculative decoding's state here (engine/runtime/speculative.py)

    @property
    def is_closed(self) -> bool:
        return self._guard.closed

    @property
    def cache_config(self) -> CacheConfig:
        return self._config

    @property
    def components(self):
        """This conversation's page components per layer, (K, V): the engine's pages in its layout."""
        return self.runner.components(self.seq)

    @property
    def tokenizer(self):
        return self.info.tokenizer

    @property
    def _cached(self) -> int:
        return self.seq.num_tokens

    @property
    def released(self) -> bool:
        """Its cache was taken back to make room for another conversation: the next turn reads the history again."""
        return self.seq.released and self.seq.num_tokens == 0 and bool(self.token_ids)

    def _sync(self) -> None:
        """A sequence released for another conversation holds nothing: its saved cache is read back where it has one
        (the second tier, engine/runtime/warm.py), else its tokens are read again next turn."""
        if self.released:
            self.seq.released = False
            kept = (list(self.token_ids), self._prompt_end, list(self._starts), self._prompt_logits)
            self.token_ids.clear()
            self._prompt_logits = None
            if self.tier == "host":
                self.notice = warm.from_host(self, *kept)
                return
            if self.warm is not None and self.tier == "disk":
                self.notice = warm.read_back(self, *kept)
                return
            self.notice = RELEASED_NOTICE

    def offload(self) -> bool:
        """The budget is releasing this idle conversation: its cache goes to the second tier first, host memory when
        the pool is on a GPU (runner.host_tier), else (or when that is full) its saved file. True when it was kept."""
        if self.warm is None or self._guard.closed:
            return False
        if warm.to_host(self):
            self.tier = "host"
            return True
        store, key, identity = self.warm
        kept = store.save(self, key, identity) > 0
        self.tier = "disk" if kept else "none"
        return kept

    # ---- forward ----------------------------------------------------------------------

    def _chunk(self) -> int:
        return WindowGeometry.of(self._config).prefill_chunk()

    def _forward(self, ids: list[int], all_logits: bool, should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Run ids through the model in chunks; each chunk joins the cache or, on any error, leaves it untouched."""
        reading = self._read(ids, all_logits, should_stop)
        while True:
            try:
                next(reading)
            except StopIteration as done:
                return done.value

    def _read(self, ids: list[int], all_logits: bool,
              should_stop: Callable[[], bool] | None = None) -> Generator[PrefillProgress, None, torch.Tensor]:
        """_forward for a turn's prompt: after each chunk of a prompt longer than one it says how far it got, so a
        long paste shows progress instead of seconds of nothing; returns the logits as _forward does."""
        outs = []
        i = 0
        while i < len(ids):
            if should_stop is not None and i and should_stop():
                raise Stopped()
            part = ids[i:i + self._chunk()]
            try:
                (logits,) = self.runner.step([(self.seq, part)], all_logits=all_logits)
            except NoFreeBlocks:
                c = self._config
                if c.overflow == "slide" and c.window is None:
                    overflow.slide_to_fit(self)
                    continue
                raise BudgetFull(overflow.budget_message(self, len(ids) - i)) from None
            i += len(part)
            outs.append(logits)
            if len(outs) > 1 or i < len(ids):      # a prompt of more than one chunk
                yield PrefillProgress(i, len(ids))
        return torch.cat(outs) if all_logits else outs[-1]

    def append(self, token_ids: list[int], all_logits: bool = True) -> torch.Tensor:
        """Teacher-forced: feed token_ids (after any pending ones) into the cache.

        Returns their logits [T, vocab], or only the last token's [1, vocab] when all_logits is False."""
        self._guard.check_idle()
        self._sync()
        token_ids = [int(t) for t in token_ids]
        vocab = self.runner.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary (0-{vocab - 1})")
        pending = self.token_ids[self._cached:]
        feed = pending + token_ids
        if overflow.past_context(self, len(feed)):
            raise BudgetFull(overflow.context_message(self, len(feed)))
        overflow.check_whole_fits(self, len(feed))
        kept = len(self.token_ids)
        self.token_ids.extend(token_ids)
        try:
            logits = self._forward(feed, all_logits=all_logits)
        except BaseException:
            del self.token_ids[max(kept, self._cached):]   # tokens the cache did not take leave the conversation
            raise
        return logits[len(pending):] if all_logits else logits

    # ---- chat -------------------------------------------------------------------------

    def _encode_conversation(self, messages: list[dict]) -> tuple[str, list[tuple[str, bool]]]:
        return encode_conversation(self.tokenizer, self.system_prompt, messages, where=self.info.name)

    def _tokenize(self, pieces: list[tuple[str, bool]], skip_chars: int) -> list[int]:
        return tokenize_pieces(self.tokenizer, pieces, skip_chars)

    def _reply_start(self) -> int | None:
        """Where the last reply's tokens begin, when the last message is a reply and that is known."""
        if self.messages and self.messages[-1]["role"] == "assistant" and len(self._starts) == len(self.messages):
            start = self._starts[-1]
            return start if start is not None and start <= len(self.token_ids) else None
        return None

    def _new_tokens_for(self, messages: list[dict]) -> list[int]:
        """The tokens to add for this turn: the rendered chat past what the session already holds."""
        rendered, pieces = self._encode_conversation(messages)
        held = held_prefix(self.tokenizer, rendered, self.token_ids, self._cached, self._reply_start())
        if held is not None and held[0] < self._cached:
            # the format writes the last reply otherwise than the model did (Harmony drops its analysis): the cache
            # goes back to where the reply began, and the reply is read as the format writes it
            try:
                self.runner.truncate(self.seq, self._cached - held[0])
            except ConfigError:
                held = None
        if held is None:                        # the text diverged: start the cache over
            self.reset()
            return self._tokenize(pieces, 0)
        del self.token_ids[held[0]:]            # an end of text the format does not write: never fed, not kept
        return self._tokenize(pieces, held[1])

    @turn
    def send(self, text: str, params: SamplingParams | None = None,
             should_stop: Callable[[], bool] | None = None) -> Iterator[TurnEvent]:
        """Add a user message and stream the reply: TokenDelta ..., then one TurnFinished (before them, a
        PrefillProgress after each chunk of a prompt longer than one).

        A model that reasons apart (gpt-oss: engine/text/reasoning.py) streams its reasoning in the events'
        `reasoning` and its answer in their `text`; the reply joins `messages` as its answer, with the reasoning
        under "reasoning", and a later prompt holds only the answer.

        A turn refused (too long, over budget) or stopped while its prompt is read leaves the
        conversation and the cache exactly as they were. While the stream is live the session takes no other
        turn (SessionBusy); a reset, rewind or close ends it (engine/runtime/turns.py)."""
        text = checked_text(text, "the message")
        params = checked_params(params, self.runner.config.vocab_size)
        self.notice = ""                    # a notice is about this turn; _sync may set one
        self._sync()
        self.turn_times = TurnTimes()
        self.runner.model.count_experts()        # the experts of this turn's tokens (StatsSnapshot.experts)
        started = time.perf_counter()
        new_ids = self._new_tokens_for(self.messages + [{"role": "user", "content": text}])
        kept, seq_before = len(self.token_ids), (self.seq, self.seq.evicted)
        self.token_ids.extend(new_ids)
        if not self._cached and self.prefix_cache:
            self.turn_times.reused = self.runner.match_prefix(self.seq, self.token_ids)
        prompt = self.token_ids[self._cached:]
        if not prompt:
            # the cache already holds the whole prompt (a regenerate that could not fork after its reply's tokens
            # were cut): its last token is read again for the logits the reply starts from, all of it where the
            # cache cannot give one token back
            try:
                self.runner.truncate(self.seq, 1)
            except ConfigError:
                self.runner.free(self.seq)
            prompt = self.token_ids[self._cached:]
        if overflow.past_context(self, len(prompt)):
            del self.token_ids[kept:]
            yield TurnFinished("", FinishReason.CONTEXT, overflow.context_message(self, len(prompt)), self.stats())
            return
        try:
            overflow.check_whole_fits(self, len(prompt))
            logits = (yield from self._read(prompt, all_logits=False, should_stop=should_stop))[-1]
        except (BudgetFull, Stopped) as exc:
            self._undo_prompt(kept, seq_before)
            if isinstance(exc, Stopped):
                yield TurnFinished("", FinishReason.STOPPED, "", self.stats())
            else:
                yield TurnFinished("", FinishReason.BUDGET, str(exc), self.stats())
            return
        except BaseException:
            self._undo_prompt(kept, seq_before)
            raise
        self.messages.append({"role": "user", "content": text})
        self._starts.append(kept)
        self._drop_alternatives()
        self._prompt_end, self._prompt_logits = len(self.token_ids), logits.detach().clone()
        self.turn_times.prefill_tokens = len(prompt)
        self.turn_times.prefill_s = time.perf_counter() - started
        yield from self._decode(logits, params, should_stop, started)

    def _undo_prompt(self, kept: int, seq_before: tuple) -> None:
        """A prompt that did not complete leaves the cache: taken back when exact, else the cache starts over
        (a window that evicted blocks, or a slide to a window, while the prompt was read cannot be undone)."""
        extra = self._cached - kept
        del self.token_ids[kept:]
        if extra > 0:
            if (self.seq, self.seq.evicted) != seq_before:
                self.reset()
                return
            try:
                self.runner.truncate(self.seq, extra)
            except ConfigError:
                self.reset()

    def _decode(self, logits: torch.Tensor, params: SamplingParams, should_stop, started: float,
                continues: bool = False):
        generator = None
        if not params.greedy:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed if params.seed is not None else int(time.time_ns() % 2**63))
        # a seeded sample must repeat: drafts verified or not take other random draws, and whether they pay is timed
        spec = self._speculator() if params.greedy or params.seed is None else None
        reply: list[int] = []
        chosen: deque[int] = deque()        # tokens a verification chose; all but the last are in the cache already
        start = self._reply_start() if continues else None
        resume = self.token_ids[start:] if start is not None else []
        parts = self.info.reply.parser(self.tokenizer, resume)
        reason, message = FinishReason.LENGTH, ""
        decode_started = time.perf_counter()
        try:
            for step in range(params.max_new_tokens):
                if should_stop is not None and should_stop():
                    reason = FinishReason.STOPPED
                    break
                if not chosen and overflow.past_context(self, 1):
                    reason, message = FinishReason.CONTEXT, overflow.context_message(self, 1)
                    break
                try:
                    next_id = chosen.popleft() if chosen else sample(logits.cpu(), params, self.token_ids[-RECENT:],
                                                                     generator, reply)
                except NonFiniteLogits as exc:
                    reason, message = FinishReason.ERROR, str(exc)
                    break
                if step == 0:
                    self.turn_times.ttft_s = time.perf_counter() - started
                self.token_ids.append(next_id)
                if next_id in self.info.stop_ids:
                    reason = FinishReason.EOS
                    break
                reply.append(next_id)
                text, reasoning = parts.push(next_id)
                if text or reasoning:
                    yield TokenDelta(text, (next_id,), reasoning)
                if step + 1 == params.max_new_tokens:
                    break
                if chosen:                  # the next is chosen already
                    continue
                try:
                    produced, logits = self._decode_step(next_id, params.max_new_tokens - step - 1, spec, params,
                                                         generator, chosen, logits, reply)
                except BudgetFull as exc:
                    reason, message = FinishReason.BUDGET, str(exc)
                    break
                except NonFiniteLogits as exc:      # a verification's rows: its drafts leave the cache below
                    reason, message = FinishReason.ERROR, str(exc)
                    break
                self.turn_times.decode_tokens += produced
                self.turn_times.decode_s = time.perf_counter() - decode_started   # live rate for stats()
        finally:
            self.turn_times.decode_s = time.perf_counter() - decode_started
            self.turn_times.spec = spec.stats() if spec is not None else None
            # the cache as plain decoding leaves it: the last token fed only where the turn went on after it
            fed = reason in (FinishReason.STOPPED, FinishReason.CONTEXT, FinishReason.ERROR)
            self._settle(len(self.token_ids) - (0 if fed else 1))
            final, thought = parts.text, parts.reasoning
            if continues:
                final = self.messages[-1]["content"] + final
                thought = self.messages[-1].get(REASONING_KEY, "") + thought
                self.messages[-1] = assistant_message(final, thought)
            else:
                self.messages.append(assistant_message(final, thought))
                self._starts.append(self._prompt_end)
        text, reasoning = parts.flush()
        if text or reasoning:
            yield TokenDelta(text, (), reasoning)
        yield TurnFinished(final, reason, message, self.stats(), thought)

    def _decode_step(self, next_id: int, left: int, spec, params, generator, chosen: deque, logits, reply: list[int]):
        """Feed next_id: one verification where drafts pay (the tokens it chose join `chosen`), else a plain step.
        left: tokens the turn may still generate after next_id; reply: the turn's tokens, next_id last. Returns
        (tokens produced, the logits to sample)."""
        if spec is not None:
            # the drafts, and the token after them, still fit: within what the turn may generate, at most k (a
            # max_new_tokens of 10**12 counted down one by one never ended), and within the context
            room = min(left - 1, spec.config.k)
            while room > 0 and overflow.past_context(self, 1 + room):
                room -= 1
            verified = spec.verify(self, next_id, params, generator, room, reply)
            if verified is not None:
                chosen.extend(verified)
                return len(verified), logits
        started = time.perf_counter()
        logits = self._forward([next_id], all_logits=False)[-1]
        if spec is not None:
            spec.record(0, 0, time.perf_counter() - started)
        return 1, logits

    def _speculator(self) -> Speculator | None:
        """This conversation's speculation under the engine's setting now (switched live), or None when it is off."""
        self._spec = Speculator.following(self._spec, self.runner, self._config)
        return self._spec

    def _settle(self, keep: int) -> None:
        """Accepted drafts a turn did not reach (a stop, an end of text among them) leave the cache."""
        extra = self._cached - max(0, keep)
        if extra > 0:
            try:
                self.runner.truncate(self.seq, extra)
            except ConfigError:          # cannot happen within draft_room; read again rather than keep them
                self.runner.free(self.seq)

    @turn
    def regenerate(self, params: SamplingParams | None = None,
                   should_stop: Callable[[], bool] | None = None) -> Iterator[TurnEvent]:
        """A new reply to the last user message: the cache forks where the reply began, so the history is not
        read again; the old reply is kept as an alternative (see `alternatives`, `select_alternative`)."""
        params = checked_params(params, self.runner.config.vocab_size)
        self.notice = ""                    # a notice is about this turn; _sync may set one
        self._sync()
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ConfigError("there is no reply to regenerate yet: send a message first")
        self.turn_times = TurnTimes()
        self.runner.model.count_experts()        # the experts of this turn's tokens (StatsSnapshot.experts)
        started = time.perf_counter()
        old = self.messages.pop()
        self._starts.pop()
        can_fork = self._prompt_logits is not None and self._cached >= self._prompt_end and not self.seq.evicted
        if not can_fork:       # released, slid or resumed: read the prompt again
            # the old replies keep their text; their caches go, as the prompt they answered is read again
            kept = [(alt.text, alt.reasoning) for alt in self.alternatives] + \
                [(old["content"], old.get(REASONING_KEY, ""))]
            self._drop_alternatives()
            last_user = self.messages.pop()
            self._starts.pop()
            self.token_ids = self.token_ids[:self._cached]
            notice = self.notice                        # send clears it; it is about this turn
            for event in self.send(last_user["content"], params, should_stop):
                if isinstance(event, TurnFinished):
                    self.notice = self.notice or notice
                    event = replace(event, stats=self.stats())
                    if self.messages and self.messages[-1]["role"] == "assistant":
                        self.alternatives = [Alternative(t, None, reasoning=r) for t, r in kept]
                    else:                               # refused or stopped before a reply: the chat stays as it was
                        self.messages += [last_user, old]
                        self._starts += [None, None]
                        self.alternatives = [Alternative(t, None, reasoning=r) for t, r in kept[:-1]]
                yield event
            return
        child, shared = self.runner.fork(self.seq, self._prompt_end)
        self.alternatives.append(Alternative(old["content"], self.seq, list(self.token_ids),
                                             old.get(REASONING_KEY, "")))
        self.seq = child
        self.token_ids = self.token_ids[:self._prompt_end]
        logits = self._prompt_logits.clone()       # sampling may scale logits in place
        if shared < self._prompt_end:      # a quantized block the fork could not share exactly: re-read it
            prompt = self.token_ids[shared:]
            logits = self._forward(prompt, all_logits=False)[-1]
            self.turn_times.prefill_tokens = len(prompt)
        self.turn_times.prefill_s = time.perf_counter() - started
        yield from self._decode(logits, params, should_stop, started)

    @turn
    def continue_reply(self, params: SamplingParams | None = None,
                       should_stop: Callable[[], bool] | None = None) -> Iterator[TurnEvent]:
        """More of the last reply (cut at max tokens, or stopped): its text grows; nothing is read again."""
        params = checked_params(params, self.runner.config.vocab_size)
        self.notice = ""                    # a notice is about this turn; _sync may set one
        self._sync()
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ConfigError("there is no reply to continue: send a message first")
        if self.token_ids and self.token_ids[-1] in self.info.stop_ids:
            raise ConfigError("the last reply ended on its own; send a message to go on")
        self.turn_times = TurnTimes()
        self.runner.model.count_experts()        # the experts of this turn's tokens (StatsSnapshot.experts)
        started = time.perf_counter()
        if not self.token_ids:        # released or resumed: the whole chat is read again, the reply included
            rendered, pieces = self._encode_conversation(self.messages[:-1])
            prompt, last = self._tokenize(pieces, 0), self.messages[-1]
            self.token_ids = prompt + self.info.reply.reply_ids(self.tokenizer, last["content"],
                                                                last.get(REASONING_KEY, ""))
            if len(self._starts) == len(self.messages):
                self._starts[-1] = len(prompt)
        if self.token_ids and self._cached == len(self.token_ids):
            # the last token is in the cache (a reply stopped after a step) and its logits are gone: take it
            # back and read it again, or read the whole chat again when the cache cannot take it back exactly
            try:
                self.runner.truncate(self.seq, 1)
            except ConfigError:
                self.reset()
                return (yield from self.continue_reply(params, should_stop))
        pending = self.token_ids[self._cached:]
        self.turn_times.prefill_tokens = len(pending)
        logits = (yield from self._read(pending, all_logits=False))[-1]
        yield from self._decode(logits, params, should_stop, started, continues=True)

    def rewind(self, index: int) -> None:
        """Drop messages[index:] (edit and resend from there): the cache goes back to where message `index`
        began, exactly when it can (full precision, or within a quantized cache's last block), else it is read
        again on the next turn. A reply streaming meanwhile stops first, kept as a stopped reply is."""
        self._guard.check_open()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= len(self.messages):
            raise ConfigError(f"there is no message {index!r} to go back to")
        self._guard.end(self, "rewind")
        start = self._starts[index] if index < len(self._starts) else None
        del self.messages[index:]
        del self._starts[index:]
        self._drop_alternatives()
        self._prompt_logits = None
        if start is None or start > len(self.token_ids):
            self.reset()
            return
        extra = self.seq.num_tokens - start
        if extra > 0:
            try:
                self.runner.truncate(self.seq, extra)
            except ConfigError:
                self.reset()
                return
        del self.token_ids[start:]

    def select_alternative(self, index: int) -> None:
        """Swap the current last reply with alternative `index` (its cache too, if it is still held)."""
        self._guard.check_idle()
        alt = self.alternatives[index]
        last = self.messages[-1]
        current = Alternative(last["content"], self.seq, list(self.token_ids), last.get(REASONING_KEY, ""))
        self.messages[-1] = assistant_message(alt.text, alt.reasoning)
        if alt.seq is not None and not alt.seq.released and alt.seq.num_tokens:
            self.seq, self.token_ids = alt.seq, list(alt.token_ids)
        else:               # its cache is gone: the chat is read again from a new sequence
            for seq in (alt.seq, current.seq):
                if seq is not None:
                    self.runner.close(seq)
            current.seq, current.token_ids = None, []
            self.seq = self.runner.new_sequence(self._config)
            self.token_ids = []
        self.alternatives[index] = current

    def reply(self, text: str, params: SamplingParams | None = None) -> str:
        """The reply's answer (a reasoning model's reasoning is in messages[-1]["reasoning"])."""
        for event in self.send(text, params):
            if isinstance(event, TurnFinished):
                return event.text
        return ""

    # ---- cache control ----------------------------------------------------------------

    def set_cache(self, config: CacheConfig) -> session_stats.CacheSwitch:
        """Switch the cache mode live: convert the blocks held, keep the conversation. Returns the tokens held
        before and after, and those the cache no longer holds (a window let them go; leaving it does not bring
        them back)."""
        self._guard.check_open()
        self.runner.check(config)
        if config.budget_mb != self._config.budget_mb:
            self.runner.set_budget(config.budget_mb)
        held = self.seq.tokens_held
        self.seq = self.runner.convert_sequence(self.seq, self._config, config)
        self._config = config
        return session_stats.CacheSwitch(held, self.seq.tokens_held, self.seq.num_tokens - self.seq.tokens_held)

    def reset(self) -> int:
        """Free every block (alternatives' too); the messages stay and are read again on the next turn.
        A reply streaming meanwhile stops first, kept as a stopped reply is."""
        self._guard.check_open()
        self._guard.end(self, "reset")
        if self.warm is not None:           # a saved cache of what is gone would only be refused later
            self.warm[0].delete(self.warm[1])
        return self._free_all()

    def _free_all(self) -> int:
        if self._spec is not None:          # a draft model's cache of this conversation goes too
            self._spec.close()
            self._spec = None
        freed = self.runner.free(self.seq) + self._drop_alternative_caches()
        if self.runner.host_tier is not None:
            self.runner.host_tier.drop(warm.host_key(self))
        self.token_ids.clear()
        self._prompt_logits = None
        self.tier = "pool"
        memory.release_cached(self.runner.device)
        trim_heap()
        return freed

    def close(self) -> None:
        """Give the conversation's blocks and sequences back for good (a closed chat or a finished request);
        a reply streaming meanwhile stops first. Closing twice is harmless; any other use afterwards is refused."""
        if self._guard.closed:
            return
        self._guard.end(self, "close")
        self._free_all()                    # a saved cache stays: the chat may be reopened
        self.runner.close(self.seq)
        self._guard.closed = True

    def _drop_alternative_caches(self) -> int:
        """Close the sequences of the kept replies (their text stays); returns the bytes freed."""
        freed = 0
        for alt in self.alternatives:
            if alt.seq is not None and alt.seq is not self.seq:
                freed += self.runner.free(alt.seq)
                self.runner.close(alt.seq)
            alt.seq, alt.token_ids = None, []
        return freed

    def _drop_alternatives(self) -> None:
        self._drop_alternative_caches()
        self.alternatives = []

    def truncate(self, n: int) -> None:
        """Take back the last n tokens of the cache and the conversation's token ids."""
        self._guard.check_idle()
        self.runner.truncate(self.seq, n)
        del self.token_ids[self.seq.num_tokens:]

    # ---- statistics (engine/runtime/session_stats.py) ------------------------------------

    def tokens_left(self) -> int | None:
        """More tokens that fit in the budget in this mode (idle conversations released); None when a window bounds
        the cache instead (any length fits)."""
        return session_stats.tokens_left(self)

    def pool_stats(self) -> PoolStats:
        return session_stats.pool_stats(self)

    def stats(self) -> StatsSnapshot:
        return session_stats.snapshot(self)
