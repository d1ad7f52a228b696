"""A session is one conversation: its messages, its token ids, its paged KV cache."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from . import memory
from .config import CacheConfig, SamplingParams
from .events import LayerBytes, StatsSnapshot, TokenDelta, TurnFinished
from .kv_cache import MIB, KVCache
from .detok import StreamDecoder
from .sampling import sample

if TYPE_CHECKING:
    from .engine import Engine

PREFILL_CHUNK = 512


class BudgetFull(RuntimeError):
    """The next tokens do not fit in the KV budget; the message says what to do."""


class Session:
    def __init__(self, engine: "Engine", system_prompt: str | None = None, cache: CacheConfig | None = None,
                 history: list[dict] | None = None):
        self.engine = engine
        self.system_prompt = system_prompt
        self.messages: list[dict] = [dict(m) for m in (history or [])]
        self.cache = KVCache(engine.model.config, cache or engine.config.cache, engine.dtype_name, engine.device)
        self.token_ids: list[int] = []      # the conversation as tokens
        self._cached = 0                    # how many of token_ids the cache has seen
        self._turn = dict(prefill_tokens=0, prefill_s=0.0, decode_tokens=0, decode_s=0.0, ttft_s=0.0)

    @property
    def cache_config(self) -> CacheConfig:
        return self.cache.config

    # ---- forward ----------------------------------------------------------------------

    def _check_budget(self, num_new: int) -> bool:
        """True when num_new tokens fit; False when the session just slid into a window (chunk again)."""
        need = self.cache.blocks_needed(num_new)
        if self.cache.pool.can_allocate(need):
            return True
        c = self.cache.config
        if c.overflow == "slide" and c.window is None:
            self._slide_to_fit()
            return False
        raise BudgetFull(self._budget_message(num_new))

    def _check_whole_fits(self, num_new: int) -> None:
        """With overflow="stop" and no window, refuse up front what cannot fit, so nothing is half-prefilled."""
        c = self.cache.config
        if c.window is None and c.overflow == "stop" and \
                not self.cache.pool.can_allocate(self.cache.blocks_needed(num_new)):
            raise BudgetFull(self._budget_message(num_new))

    def _budget_message(self, num_new: int) -> str:
        c = self.cache.config
        fit = self.tokens_left()
        if c.window is not None:
            return (f"The KV cache budget ({c.budget_mb:g} MiB) cannot hold a window of {c.window} + {c.sinks} sinks "
                    f"tokens in {c.label()} while taking {num_new} new tokens: lower the window, choose a smaller "
                    f"format (int8 or int4), or raise the budget.")
        return (f"The KV cache budget ({c.budget_mb:g} MiB, {c.label()}) is full: {self.cache.tokens_held} tokens are "
                f"held and {num_new} more were needed, but only {fit} fit. Reset the session, switch to a sliding "
                f"window, choose a smaller format (int8 or int4), or raise the budget.")

    def _slide_to_fit(self) -> None:
        c = self.cache.config
        sink_blocks = -(-c.sinks // c.block_size)
        blocks = self.cache.budget_blocks(c) - sink_blocks - 2   # headroom for the block being filled
        window = blocks * c.block_size
        if window < c.block_size:
            raise BudgetFull(f"the budget ({c.budget_mb:g} MiB) is too small even for a sliding window: raise it")
        self.set_cache(c.with_(window=window))

    def _forward(self, ids: list[int], all_logits: bool) -> torch.Tensor:
        """Run ids through the model, chunked; every token joins the cache. Returns float32 logits."""
        outs = []
        i = 0
        while i < len(ids):
            c = self.cache.config           # re-read: overflow="slide" may switch to a window mid-prompt
            part = ids[i:i + (c.block_size if c.window is not None else PREFILL_CHUNK)]
            if not self._check_budget(len(part)):
                continue
            i += len(part)
            plan = self.cache.begin(len(part))
            x = torch.tensor(part, dtype=torch.long, device=self.engine.device)
            logits = self.engine.model.forward(x, lambda layer, q, k, v: self.cache.attend(layer, q, k, v, plan),
                                               all_logits=all_logits)
            self.cache.end(plan)
            self._cached += len(part)
            outs.append(logits)
        return torch.cat(outs) if all_logits else outs[-1]

    def append(self, token_ids: list[int], all_logits: bool = True) -> torch.Tensor:
        """Teacher-forced: feed token_ids (after any pending ones) into the cache.

        Returns their logits [T, vocab], or only the last token's [1, vocab] when all_logits is False.
        """
        token_ids = [int(t) for t in token_ids]
        pending = self.token_ids[self._cached:]
        self._check_whole_fits(len(pending) + len(token_ids))
        self.token_ids.extend(token_ids)
        try:
            logits = self._forward(pending + token_ids, all_logits=all_logits)
        except BudgetFull:
            del self.token_ids[self._cached:]   # tokens the cache did not take leave the conversation
            raise
        return logits[len(pending):] if all_logits else logits

    # ---- chat -------------------------------------------------------------------------

    def _render(self, messages: list[dict]) -> str:
        msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + messages
        return self.engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def _new_tokens_for(self, rendered: str) -> list[int]:
        """The tokens to add for this turn: the rendered text past what the session already holds."""
        tok = self.engine.tokenizer
        held = tok.decode(self.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if self.token_ids and rendered.startswith(held):
            return tok.encode(rendered[len(held):], add_special_tokens=False)
        if self.token_ids:                      # the text diverged: start the cache over
            self.reset()
        return tok.encode(rendered, add_special_tokens=False)

    def send(self, text: str, params: SamplingParams | None = None,
             should_stop: Callable[[], bool] | None = None) -> Iterator[TokenDelta | TurnFinished]:
        """Add a user message and stream the reply: TokenDelta ..., then one TurnFinished."""
        params = params or SamplingParams()
        tok = self.engine.tokenizer
        self._turn = dict(prefill_tokens=0, prefill_s=0.0, decode_tokens=0, decode_s=0.0, ttft_s=0.0)
        started = time.perf_counter()
        rendered = self._render(self.messages + [{"role": "user", "content": text}])
        new_ids = self._new_tokens_for(rendered)
        prompt = self.token_ids[self._cached:] + new_ids
        kept = len(self.token_ids)
        if self._past_context(len(prompt)):
            yield TurnFinished("", "context", self._context_message(len(prompt)), self.stats())
            return
        try:
            self._check_whole_fits(len(prompt))
            self.token_ids.extend(new_ids)
            logits = self._forward(prompt, all_logits=False)[-1]
        except BudgetFull as exc:
            # the user's message is not added; a half-prefilled prompt leaves the cache, the chat stays
            del self.token_ids[kept:]
            if self._cached > kept:
                self.reset()
            yield TurnFinished("", "budget", str(exc), self.stats())
            return
        self.messages.append({"role": "user", "content": text})
        self._turn["prefill_tokens"] = len(prompt)
        self._turn["prefill_s"] = time.perf_counter() - started
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed if params.seed is not None else int(time.time_ns() % 2**63))
        reply: list[int] = []
        stream = StreamDecoder(tok)
        reason, message = "length", ""
        decode_started = time.perf_counter()
        try:
            for step in range(params.max_new_tokens):
                if should_stop is not None and should_stop():
                    reason = "stopped"
                    break
                if self._past_context(1):
                    reason, message = "context", self._context_message(1)
                    break
                next_id = sample(logits.cpu(), params, self.token_ids[-1024:], generator)
                if step == 0:
                    self._turn["ttft_s"] = time.perf_counter() - started
                self.token_ids.append(next_id)
                if next_id in self.engine.stop_ids:
                    reason = "eos"
                    break
                reply.append(next_id)
                delta = stream.push(next_id)
                if delta:
                    yield TokenDelta(delta, (next_id,))
                if step + 1 == params.max_new_tokens:
                    break
                try:
                    logits = self._forward([next_id], all_logits=False)[-1]
                except BudgetFull as exc:
                    reason, message = "budget", str(exc)
                    break
                self._turn["decode_tokens"] += 1
                self._turn["decode_s"] = time.perf_counter() - decode_started   # live rate for stats()
        finally:
            self._turn["decode_s"] = time.perf_counter() - decode_started
            final = stream.text()
            self.messages.append({"role": "assistant", "content": final})
        rest = stream.flush()
        if rest:
            yield TokenDelta(rest, ())
        yield TurnFinished(final, reason, message, self.stats())

    def _past_context(self, num_new: int) -> bool:
        """Would num_new more tokens pass the model's context? A window re-positions, so it never does."""
        limit = self.engine.model.config.max_position_embeddings
        return self.cache.config.window is None and self.cache.num_tokens + num_new > limit

    def _context_message(self, num_new: int) -> str:
        limit = self.engine.model.config.max_position_embeddings
        return (f"The conversation would pass {self.engine.model_name}'s context of {limit:,} tokens "
                f"({self.cache.num_tokens:,} held, {num_new:,} more needed): switch the cache to a sliding "
                f"window with sinks to keep going, or start a new chat.")

    def reply(self, text: str, params: SamplingParams | None = None) -> str:
        for event in self.send(text, params):
            if isinstance(event, TurnFinished):
                return event.text
        return ""

    # ---- cache control ----------------------------------------------------------------

    def set_cache(self, config: CacheConfig) -> None:
        """Switch the cache mode live: convert the blocks held, keep the conversation."""
        from .convert import convert_cache
        self.cache = convert_cache(self.cache, config)

    def reset(self) -> int:
        """Free every block; the messages stay and are prefilled again on the next turn."""
        freed = self.cache.reset()
        self.token_ids.clear()
        self._cached = 0
        if str(self.engine.device).startswith("cuda"):
            torch.cuda.empty_cache()
        return freed

    # ---- statistics ---------------------------------------------------------------------

    def tokens_left(self) -> int:
        """More tokens that fit in the budget in this mode; -1 when a window bounds the cache."""
        cache = self.cache
        c = cache.config
        if c.window is not None:
            return -1
        free_blocks = cache.pool.get_num_free_blocks()
        in_last = len(cache.table) * c.block_size - cache.seq_len
        return free_blocks * c.block_size + in_last

    def stats(self) -> StatsSnapshot:
        cache = self.cache
        c = cache.config
        per_block, tail = cache.layout_bytes(c)
        layers = tuple(LayerBytes(i, k, v, kc.fmt.label, vc.fmt.label)
                       for i, ((k, v), (kc, vc)) in enumerate(zip(cache.layer_bytes(), cache.layers)))
        t = self._turn
        return StatsSnapshot(
            time_s=time.monotonic(),
            cache_label=c.label().replace("auto", cache.model_dtype),
            layers=layers,
            kv_bytes=sum(l.k_bytes + l.v_bytes for l in layers),
            budget_bytes=int(c.budget_mb * MIB),
            block_size=c.block_size,
            blocks_used=cache.pool.num_used_blocks,
            blocks_free=cache.pool.get_num_free_blocks(),
            blocks_budget=cache.pool.num_blocks,
            tokens_in_context=len(self.token_ids),
            tokens_held=cache.tokens_held,
            tokens_evicted=cache.tokens_evicted,
            tokens_left=self.tokens_left(),
            bytes_per_token=per_block / c.block_size,
            prefill_tokens=t["prefill_tokens"],
            prefill_tok_s=t["prefill_tokens"] / t["prefill_s"] if t["prefill_s"] else 0.0,
            decode_tok_s=t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0,
            ttft_s=t["ttft_s"],
            memory=memory.probe(),
            weight_bytes=self.engine.weight_bytes,
            weights_label=self.engine.weights_label,
        )
