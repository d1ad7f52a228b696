"""A session is one conversation: its messages, its token ids, its sequence in the engine's KV pool.

The chat layer: chat template, events, the undo rules of a turn. The model runner does the forward passes and owns
the cache; a session holds one `Sequence` of it (and, after a regenerate, the sequences of the replies it kept as
alternatives). Its tokens, cache handle and turn counts are one SessionState (engine/runtime/session_state.py),
which its helpers receive: the statistics (session_stats.py), feeding the cache within the budget and context
(overflow.py), the second tier (warm.py). Sampling, finish rules and speculation are the decode driver's
(driver.py), shared with the server's scheduler.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterator

import torch

from kvchat.engine.config import CacheConfig, ConfigError, SamplingParams
from kvchat.engine.events import FinishReason, PrefillProgress, TokenDelta, TurnFinished
from kvchat.engine.plan.fit import trim_heap
from kvchat.engine.runtime import alternatives, memory, overflow, session_attention, session_stats, warm
from kvchat.engine.runtime.alternatives import Alternative
from kvchat.engine.runtime.driver import Decoder, decode_alone, may_speculate
from kvchat.engine.runtime.overflow import BudgetFull, Stopped
from kvchat.engine.runtime.runner import ModelRunner
from kvchat.engine.runtime.session_state import ModelInfo, SessionState, state_field
from kvchat.engine.runtime.speculative import Speculator
from kvchat.engine.runtime.turns import SessionBusy, SessionClosed  # noqa: F401 - raised by a session's methods
from kvchat.engine.runtime.turns import TurnGuard, TurnTimes, checked_history, checked_params, checked_text, turn
from kvchat.engine.text.chat_format import encode_conversation, held_prefix, last_message, tokenize_pieces
from kvchat.engine.text.reasoning import REASONING_KEY, assistant_message


TurnEvent = PrefillProgress | TokenDelta | TurnFinished


class Session:
    def __init__(self, runner: ModelRunner, info: ModelInfo, cache: CacheConfig, system_prompt: str | None = None,
                 history: list[dict] | None = None, prefix_cache: bool = True):
        self.runner = runner
        self.info = info
        self.system_prompt = checked_text(system_prompt, "the system prompt") if system_prompt else None
        self.messages: list[dict] = checked_history(history)
        self._config = cache
        self.state = SessionState(runner.new_sequence(cache), starts=[None] * len(self.messages))
        self.prefix_cache = prefix_cache
        self._message_start: int | None = None     # where the last message's tokens begin (state points)
        self.alternatives: list[Alternative] = []   # earlier replies to the last user message
        self._guard = TurnGuard()
        self.warm = None                    # (WarmStore, key, model identity): where this cache is kept (engine.keep_warm)
        self._spec: Speculator | None = None  # speculative decoding's state here (engine/runtime/speculative.py)

    seq = state_field("seq", "Its sequence of the runner's KV pool.")
    token_ids = state_field("token_ids", "The conversation as tokens; the cache holds the first seq.num_tokens.")
    tier = state_field("tier", "Where the cache is: pool, host, disk or none (SessionState.tier).")
    notice = state_field("notice", "What the user should know about the last turn.")
    turn_times = state_field("turn_times", "The last turn's counts and times.")

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
        return self.state.num_cached

    @property
    def released(self) -> bool:
        """Its cache was taken back to make room for another conversation: the next turn reads the history again."""
        return self.seq.released and self.seq.num_tokens == 0 and bool(self.token_ids)

    def _sync(self) -> None:
        if self.released:
            warm.sync(self)
        session_attention.follow(self)

    def offload(self) -> bool:
        """The budget is releasing this idle conversation: its cache goes to the second tier (warm.offload). True
        when it was kept."""
        if self.warm is None or self._guard.closed:
            return False
        return warm.offload(self)

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
            logits = overflow.feed(self, feed, all_logits=all_logits)
        except BaseException:
            del self.token_ids[max(kept, self._cached):]   # tokens the cache did not take leave the conversation
            raise
        return logits[len(pending):] if all_logits else logits

    # ---- chat -------------------------------------------------------------------------

    def encode_conversation(self, messages: list[dict]) -> tuple[str, list[tuple[str, bool]]]:
        """The chat as the template renders it, and its pieces (text, whether special tokens are allowed)."""
        return encode_conversation(self.tokenizer, self.system_prompt, messages, where=self.info.name)

    def _reply_start(self) -> int | None:
        """Where the last reply's tokens begin, when the last message is a reply and that is known."""
        if self.messages and self.messages[-1]["role"] == "assistant" and len(self.state.starts) == len(self.messages):
            start = self.state.starts[-1]
            return start if start is not None and start <= len(self.token_ids) else None
        return None

    def _new_tokens_for(self, messages: list[dict]) -> list[int]:
        """The tokens to add for this turn: the rendered chat past what the session already holds."""
        rendered, pieces = self.encode_conversation(messages)
        held = held_prefix(self.tokenizer, rendered, self.token_ids, self._cached, self._reply_start())
        if held is not None and held[0] < self._cached:
            # the format writes the last reply otherwise than the model did (Harmony drops its analysis): the cache
            # goes back to where the reply began, and the reply is read as the format writes it
            if not self._take_back(self._cached - held[0]):
                held = None
        if held is None:                        # the text diverged: start the cache over
            self.reset()
            held = (0, 0)
        del self.token_ids[held[0]:]            # an end of text the format does not write: never fed, not kept
        ids = tokenize_pieces(self.tokenizer, pieces, held[1], starts := [])
        self._message_start = last_message(pieces, starts, held[0])     # a recurrent state is kept there
        return ids

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
            if not self._take_back(1):
                self.runner.free(self.seq)
            prompt = self.token_ids[self._cached:]
        if overflow.past_context(self, len(prompt)):
            del self.token_ids[kept:]
            yield TurnFinished("", FinishReason.CONTEXT, overflow.context_message(self, len(prompt)), self.stats())
            return
        self.runner.snapshot(self.seq)          # a recurrent state where the turn began (no-op without one)
        try:
            overflow.check_whole_fits(self, len(prompt))
            logits = (yield from overflow.read(self, prompt, all_logits=False, should_stop=should_stop))[-1]
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
        self.state.starts.append(kept)
        self._drop_alternatives()
        self.state.prompt_end, self.state.prompt_logits = len(self.token_ids), logits.detach().clone()
        self.runner.snapshot(self.seq)          # ... and where the reply begins: regenerate forks from it
        self.turn_times.prefill_tokens = len(prompt)
        self.turn_times.prefill_s = time.perf_counter() - started
        yield from self._decode(logits, params, should_stop, started)

    def _undo_prompt(self, kept: int, seq_before: tuple) -> None:
        """A prompt that did not complete leaves the cache: taken back when exact, else the cache starts over
        (a window that evicted blocks, or a slide to a window, while the prompt was read cannot be undone)."""
        extra = self._cached - kept
        del self.token_ids[kept:]
        if extra > 0 and ((self.seq, self.seq.evicted) != seq_before or not self._take_back(extra)):
            self.reset()

    def _decode(self, logits: torch.Tensor, params: SamplingParams, should_stop, started: float,
                continues: bool = False):
        """The reply: the decode driver's tokens, each streamed as a TokenDelta, and the TurnFinished that says why it
        ended; the reply joins `messages` (grows the last one when it continues)."""
        if may_speculate(params):           # this conversation's speculation under the engine's setting now
            self._spec = Speculator.following(self._spec, self.runner, self._config)
        decoder = Decoder(params, self.info.stop_ids, spec=self._spec if may_speculate(params) else None)
        start = self._reply_start() if continues else None
        parts = self.info.reply.parser(self.tokenizer, self.token_ids[start:] if start is not None else [])
        tokens = decode_alone(decoder, self.state, self.runner, logits,
                              feed=lambda ids: overflow.feed(self, ids, all_logits=False),
                              context_limit=lambda: overflow.context_limit(self),
                              context_message=lambda: overflow.context_message(self, 1),
                              should_stop=should_stop, started=started)
        reason, message = FinishReason.LENGTH, ""
        try:
            while True:
                try:
                    token = next(tokens)
                except StopIteration as done:
                    reason, message = done.value
                    break
                text, reasoning = parts.push(token)
                if text or reasoning:
                    yield TokenDelta(text, (token,), reasoning)
        finally:
            tokens.close()
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
                self.state.starts.append(self.state.prompt_end)
        text, reasoning = parts.flush()
        if text or reasoning:
            yield TokenDelta(text, (), reasoning)
        yield TurnFinished(final, reason, message, self.stats(), thought)

    def _settle(self, keep: int) -> None:
        """Accepted drafts a turn did not reach (a stop, an end of text among them) leave the cache (exactly: they
        are within draft_room; else it is read again rather than keep them)."""
        if not self._take_back(self._cached - max(0, keep)):
            self.runner.free(self.seq)

    def _take_back(self, n: int) -> bool:
        """The cache gives back its last n tokens; False where it cannot exactly (overflow.take_back)."""
        return overflow.take_back(self, n)

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
        self.state.starts.pop()
        state = self.state
        can_fork = state.prompt_logits is not None and self._cached >= state.prompt_end and not self.seq.evicted
        if not can_fork:       # released, slid or resumed: read the prompt again
            # the old replies keep their text; their caches go, as the prompt they answered is read again
            kept = alternatives.texts(self.alternatives, old)
            self._drop_alternatives()
            last_user = self.messages.pop()
            self.state.starts.pop()
            self.token_ids = self.token_ids[:self._cached]
            notice = self.notice                        # send clears it; it is about this turn
            for event in self.send(last_user["content"], params, should_stop):
                if isinstance(event, TurnFinished):
                    self.notice = self.notice or notice
                    event = replace(event, stats=self.stats())
                    if self.messages and self.messages[-1]["role"] == "assistant":
                        self.alternatives = alternatives.without_caches(kept)
                    else:                               # refused or stopped before a reply: the chat stays as it was
                        self.messages += [last_user, old]
                        self.state.starts += [None, None]
                        self.alternatives = alternatives.without_caches(kept[:-1])
                yield event
            return
        shared = alternatives.fork(self.runner, self.state, self.alternatives, old)
        logits = self.state.prompt_logits.clone()       # sampling may scale logits in place
        if shared < self.state.prompt_end:      # a quantized block the fork could not share exactly: re-read it
            prompt = self.token_ids[shared:]
            logits = overflow.feed(self, prompt, all_logits=False)[-1]
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
            rendered, pieces = self.encode_conversation(self.messages[:-1])
            prompt, last = tokenize_pieces(self.tokenizer, pieces, 0), self.messages[-1]
            self.token_ids = prompt + self.info.reply.reply_ids(self.tokenizer, last["content"],
                                                                last.get(REASONING_KEY, ""))
            if len(self.state.starts) == len(self.messages):
                self.state.starts[-1] = len(prompt)
        if self.token_ids and self._cached == len(self.token_ids):
            # the last token is in the cache (a reply stopped after a step) and its logits are gone: take it
            # back and read it again, or read the whole chat again when the cache cannot take it back exactly
            if not self._take_back(1):
                self.reset()
                return (yield from self.continue_reply(params, should_stop))
        pending = self.token_ids[self._cached:]
        self.turn_times.prefill_tokens = len(pending)
        logits = (yield from overflow.read(self, pending, all_logits=False))[-1]
        yield from self._decode(logits, params, should_stop, started, continues=True)

    def rewind(self, index: int) -> None:
        """Drop messages[index:] (edit and resend from there): the cache goes back to where message `index`
        began, exactly when it can (full precision, or within a quantized cache's last block), else it is read
        again on the next turn. A reply streaming meanwhile stops first, kept as a stopped reply is."""
        self._guard.check_open()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= len(self.messages):
            raise ConfigError(f"there is no message {index!r} to go back to")
        self._guard.end(self, "rewind")
        start = self.state.starts[index] if index < len(self.state.starts) else None
        del self.messages[index:]
        del self.state.starts[index:]
        self._drop_alternatives()
        self.state.prompt_logits = None
        if start is None or start > len(self.token_ids) or not self._take_back(self._cached - start):
            self.reset()
            return
        del self.token_ids[start:]

    def select_alternative(self, index: int) -> None:
        """Swap the current last reply with alternative `index` (its cache too, if it is still held)."""
        self._guard.check_idle()
        alternatives.swap(self.runner, self.state, self.alternatives, self.messages, index, self._config)

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
        freed = self.runner.free(self.seq) + alternatives.drop_caches(self.runner, self.alternatives, self.seq)
        if self.runner.host_tier is not None:
            self.runner.host_tier.drop(warm.host_key(self))
        self.token_ids.clear()
        self.state.prompt_logits = None
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

    def _drop_alternatives(self) -> None:
        alternatives.drop_caches(self.runner, self.alternatives, self.seq)
        self.alternatives = []

    def truncate(self, n: int) -> None:
        """Take back the last n tokens of the cache and the conversation's token ids."""
        self._guard.check_idle()
        self.runner.truncate(self.seq, n)
        del self.token_ids[self.seq.num_tokens:]

    # ---- attention (engine/runtime/session_attention.py): watch_attention("blocks" | "dense" | None), then an
    # AttentionMap of the newest token, the last reply or the last prompt's rows: attention(over, weights, max_columns)
    watch_attention = session_attention.watch
    attention = session_attention.attention_map

    # ---- statistics (engine/runtime/session_stats.py): tokens_left() (None where a window bounds the cache),
    # pool_stats(), stats() (a StatsSnapshot)
    tokens_left = session_stats.tokens_left
    pool_stats = session_stats.pool_stats
    stats = session_stats.snapshot
