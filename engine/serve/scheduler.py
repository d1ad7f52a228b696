"""Continuous batching on one engine thread: admit, prefill in chunks, decode everyone, preempt.

Requests arrive from any thread (submit / abort); everything else runs in the engine thread. Each
iteration frees aborted requests, admits waiting ones while their prompt fits in the free blocks,
then runs one step over all running sequences: a prefill chunk for those still reading their
prompt, one token for those decoding. When the next step does not fit, the newest running
sequence is preempted: its cache goes to the second tier (engine/kv/tier.py: host memory beside a
GPU pool, a file beside a host pool) and its blocks back to the pool, and it waits at the front of
the queue. Admitted again, it reads its cache back and goes on where it stopped; where the tier had
no room (or is off), it is re-prefilled with the tokens it already generated, as vLLM's recompute
preemption does. The scheduler never touches the engine except through `batch`.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import FinishReason
from kvchat.engine.runtime.driver import Decoder, may_speculate, past_context
from kvchat.engine.runtime.sampling import NonFiniteLogits
from kvchat.engine.kv.saved import CacheFileError
from kvchat.engine.serve import batch
from kvchat.engine.kv.tier import DEFAULT_TIER_MB, PreemptTier

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
log = logging.getLogger("kvchat.serve")


@dataclass(frozen=True, slots=True)
class TokenOut:
    token_id: int


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason        # EOS, LENGTH, CONTEXT, BUDGET, ABORTED or ERROR
    message: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    code: str = ""              # an ERROR's kind in the API's words (non_finite_logits); "" for any other failure


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    cache: CacheConfig
    max_num_seqs: int = 16              # running sequences at most
    prefill_chunk: int = 256            # prompt tokens one sequence prefills per step
    max_num_waiting: int = 256          # the queue refuses more (the server answers 503)
    tier_mb: float = DEFAULT_TIER_MB    # preempted requests' caches kept aside (0: recompute them)

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.prefill_chunk < 1 or self.max_num_waiting < 1:
            raise ValueError("max_num_seqs, prefill_chunk and max_num_waiting must be at least 1")
        if not 0 <= self.tier_mb <= 2**20:
            raise ValueError("tier_mb must be between 0 and 2**20 (MiB)")


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[TokenOut | Finished], None]     # called in the engine thread
    ignore_eos: bool = False                        # end-of-sequence tokens do not end it (vLLM's extra)
    id: str = field(default_factory=lambda: f"req-{next(_IDS)}")
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    handle: batch.Sequence | None = None
    num_computed: int = 0                           # tokens of all_ids the cache holds
    num_preemptions: int = 0
    first_token_s: float | None = None
    decoder: Decoder | None = None                  # its sampling, finish rules, speculation (engine/runtime/driver.py)
    message_start: int = 0                          # where the newest message's tokens begin (0: not known)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


_IDS = itertools.count(1)


class QueueFull(RuntimeError):
    pass


class Scheduler:
    def __init__(self, engine, config: SchedulerConfig, metrics=None):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.max_usage = 0.0                # highest KV usage seen after a step (tests hold it <= 1)
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._max_context = batch.max_context(engine)
        self._stop_ids = batch.stop_ids(engine)
        batch.release(engine, batch.new_sequence(engine, config.cache))   # sizes the budget, checks the config
        self.num_blocks = batch.num_blocks(engine)
        self.tier = PreemptTier(config.tier_mb, "host" if batch.pool_on_gpu(engine) else "disk")

    # ---- any thread ------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._inbox) + len(self.waiting) >= self.config.max_num_waiting:
                raise QueueFull(f"{self.config.max_num_waiting} requests are already waiting")
            self._inbox.append(request)
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string seen); its blocks are freed before the next step."""
        with self._wake:
            self._aborts.add(request_id)
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvchat-serve-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        """The engine thread runs (and so requests are answered)."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.tier.close()

    def prompt_fits_budget(self, num_prompt: int) -> bool:
        """Could a prompt of this length (plus one generated token) ever fit, alone, in the budget?"""
        block_size = self.config.cache.block_size
        return -(-(num_prompt + 1) // block_size) <= self.num_blocks

    # ---- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._stopping or self._inbox or self._aborts or self.waiting or self.running):
                        self._wake.wait()
                    if self._stopping:
                        break
                try:
                    self.step()
                except Exception as exc:  # noqa: BLE001 - one bad iteration ends the requests in it, not the server
                    log.exception("a scheduler step failed")
                    for request in list(self.running):
                        self._end_quietly(request, exc)
        finally:
            for request in list(self.running) + list(self.waiting) + list(self._inbox):
                self._finish(request, FinishReason.ABORTED, "the server is shutting down")

    def _end_quietly(self, request: Request, exc: Exception) -> None:
        """End a request with the error that broke it; an error while ending it must not stop the loop."""
        try:
            self._finish(request, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001
            log.exception("could not end request %s", request.id)
            request.status = FINISHED
            if request in self.running:
                self.running.remove(request)

    def step(self) -> None:
        """One iteration: take arrivals and aborts, admit, run one batched step, sample."""
        with self._wake:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        for request in [r for r in self.running + list(self.waiting) if r.id in aborts]:
            self._finish(request, FinishReason.ABORTED)
        self._admit()
        items = self._schedule()
        if items:
            self._report()      # before any token goes out: a client that saw a token sees its request running
            decode = [r.num_computed >= len(r.prompt_ids) for r, _ in items]
            started = time.perf_counter()
            try:
                reading = [r.handle for r, ids in items if r.num_computed + len(ids) < len(r.prompt_ids)]
                logits = batch.step(self.engine, [(r.handle, ids) for r, ids in items], decode, reading)
                spec = items[0][0].decoder.spec
                if len(items) == 1 and decode[0] and spec is not None:    # one sequence alone: its costs
                    costs, rows = spec.costs, len(items[0][1])
                    seconds = time.perf_counter() - started
                    costs.plain(seconds) if rows == 1 else costs.verified(rows, seconds)
            except Exception as exc:  # noqa: BLE001 - one bad step ends its requests, not the server
                for request, _ in items:
                    self._finish(request, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
                logits = []
            for (request, ids), rows, dec in zip(items, logits, decode):
                request.num_computed += len(ids)
                if request.num_computed == self._keep_at(request) and logits:
                    batch.keep_state(self.engine, request.handle)
                try:
                    if dec and len(ids) > 1:
                        self._verified(request, ids[1:], rows)
                    elif request.num_computed == len(request.all_ids):
                        self._sample(request, rows[-1])
                except NonFiniteLogits as exc:      # the model's numbers, not a bug here: one line, no traceback
                    log.warning("%s: %s", request.id, exc)
                    self._finish(request, FinishReason.ERROR, str(exc), code="non_finite_logits")
                except Exception as exc:  # noqa: BLE001 - a request whose sampling fails ends alone
                    log.exception("sampling failed for %s", request.id)
                    self._end_quietly(request, exc)
        self._report()

    def _admit(self) -> None:
        block_size = self.config.cache.block_size
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            need = -(-(len(request.all_ids) + 1) // block_size)
            if request.num_preemptions:      # its kept cache comes back whole, with its tails and heads
                need = max(need, batch.blocks_for_bytes(self.engine, self.tier.bytes_of(request.id)) + 1)
            # room for its prompt, the rest of the running prompts, and one block of growth each
            reserved = sum(self._blocks_to_finish_prompt(r) + 1 for r in self.running)
            if need + reserved > batch.num_free_blocks(self.engine) and self.running:
                return
            self.waiting.popleft()
            try:
                self._open(request)
            except Exception as exc:  # noqa: BLE001 - a request that cannot start (a seed torch refuses) ends alone
                log.exception("could not start %s", request.id)
                self._end_quietly(request, exc)
                continue
            self.running.append(request)

    def _open(self, request: Request) -> None:
        if request.decoder is None:         # its generator lives through preemption: the draws go on where they stopped
            request.decoder = Decoder(request.params, self._stop_ids, ignore_eos=request.ignore_eos)
        request.handle = batch.new_sequence(self.engine, self.config.cache)
        request.num_computed = self._resume(request)
        if not request.num_computed:
            request.num_computed = batch.match_prefix(self.engine, request.handle, request.all_ids)
        decoder = request.decoder
        if decoder.spec is not None:         # preempted: its draft's cache went with its own
            decoder.spec.close()
        decoder.spec = batch.speculator(self.engine, self.config.cache) if may_speculate(request.params) else None
        request.status = RUNNING

    def _resume(self, request: Request) -> int:
        """A preempted request's cache read back from the tier -> the tokens it holds (0: none kept, or it could not
        be read back: the request is read again)."""
        if not request.num_preemptions:
            return 0
        kept = self.tier.take(request.id)
        if kept is not None:
            tokens, groups, tensors = kept
            try:
                if tokens < len(request.all_ids):      # the last token (sampled, not yet fed) is still to come
                    batch.import_cache(self.engine, request.handle, groups, tensors)
                    self.tier.num_resumed += 1
                    self.tier.tokens_resumed += tokens
                    if self.metrics:
                        self.metrics.resumed(tokens)
                    return tokens
            except CacheFileError as exc:
                log.warning("could not resume %s from the tier (%s): it is read again", request.id, exc)
        self.tier.num_recomputed += 1
        if self.metrics:
            self.metrics.recomputed()
        return 0

    @staticmethod
    def _keep_at(request: Request) -> int:
        """The block boundary before the request's newest message, where a model's recurrent state is kept for
        requests that start the same (a shared system prompt); 0 where there is none."""
        if not request.message_start or request.handle is None:
            return 0
        bs = request.handle.seq.block_size
        return request.message_start // bs * bs

    def _blocks_to_finish_prompt(self, request: Request) -> int:
        left = len(request.all_ids) - request.num_computed
        return batch.blocks_needed(self.engine, request.handle, left) if left > 1 else 0

    def _schedule(self) -> list[tuple[Request, list[int]]]:
        """The items of this step, oldest first; preempts the newest while they do not fit."""
        items: list[tuple[Request, list[int]]] = []
        planned = 0
        i = 0
        while i < len(self.running):
            request = self.running[i]
            # chunks end at multiples of prefill_chunk, wherever the prefix cache let the prompt start,
            # so each prompt row attends over the same keys as when the prompt is read whole; generated tokens
            # go one per step as decode rows, also when a preempted request reads its reply again: a decode
            # row's numbers differ from a prompt row's, and the stream must equal the request run alone
            chunk, done, prompt_len = self.config.prefill_chunk, request.num_computed, len(request.prompt_ids)
            end = done + 1 if done >= prompt_len else min(prompt_len, (done // chunk + 1) * chunk)
            keep = self._keep_at(request)
            if done < keep < end:           # a chunk ends where the state is worth keeping for others
                end = keep
            ids = request.all_ids[done:end]
            need = batch.blocks_needed(self.engine, request.handle, len(ids))
            free = batch.num_free_blocks(self.engine)
            decoding = sum(1 for r in self.running if r.num_computed >= len(r.prompt_ids))
            drafts = (self._drafts(request, decoding) if done >= prompt_len and done + 1 == len(request.all_ids)
                      else [])
            if drafts and batch.blocks_needed(self.engine, request.handle, 1 + len(drafts)) + planned <= free:
                ids, need = ids + drafts, batch.blocks_needed(self.engine, request.handle, 1 + len(drafts))
            if need + planned <= free:
                items.append((request, ids))
                planned += need
                i += 1
                continue
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                # alone and still no room: the budget is what limits this sequence's length
                self._finish(request, FinishReason.BUDGET, "the KV budget is full")
                continue
            self._preempt(victim)
            if victim is request:
                continue
        return items

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if self.tier.budget_bytes and request.num_computed:
            try:
                tokens, groups, tensors = batch.export(self.engine, request.handle)
                self.tier.put(request.id, groups, tensors, tokens)
            except Exception:  # noqa: BLE001 - a copy that fails only costs the prompt pass
                log.exception("could not keep %s's cache in the tier", request.id)
        batch.release(self.engine, request.handle)
        request.handle = None
        request.num_computed = 0
        request.status = WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if self.metrics:
            self.metrics.preempted()

    def _drafts(self, request: Request, decoding: int) -> list[int]:
        """Speculative decoding's guesses after a decoding request's last token (which the step feeds), within what it
        may still generate, its context and what can be taken back exactly."""
        decoder = request.decoder
        if decoder.spec is None:
            return []
        room = min(request.params.max_new_tokens - len(request.output_ids) - 1,
                   self._max_context - len(request.all_ids) - 1)
        running = batch.sequence_ids([r.handle for r in self.running if r.handle is not None])
        return decoder.drafts(request.all_ids, batch.draft_room(self.engine, request.handle, decoder.draft_limit(room)),
                              decoding, protect=running)

    def _verified(self, request: Request, drafts: list[int], rows: torch.Tensor) -> None:
        """After a verification step: the accepted drafts stay (the rest are taken back) and go out with the token after
        them, each as a sampled token would."""
        chosen, rejected = request.decoder.verified(rows, drafts, request.all_ids, request.output_ids)
        batch.truncate(self.engine, request.handle, rejected)
        request.num_computed -= rejected
        if self.metrics:
            self.metrics.speculated(len(drafts), len(drafts) - rejected)
        for token in chosen:
            if not self._take(request, token):
                return

    def _sample(self, request: Request, logits: torch.Tensor) -> None:
        token = request.decoder.sample(logits, request.all_ids, request.output_ids)
        if request.output_ids:
            request.decoder.plain_step()
        self._take(request, token)

    def _take(self, request: Request, token: int) -> bool:
        """One chosen token goes out (or ends the request); False once the request is over."""
        if request.first_token_s is None:
            request.first_token_s = time.monotonic() - request.arrival
            if self.metrics:
                self.metrics.first_token(request.first_token_s, len(request.prompt_ids))
        reason = request.decoder.finish(token, len(request.output_ids))
        if reason == FinishReason.EOS:
            self._finish(request, reason)
            return False
        request.output_ids.append(token)
        if self.metrics:
            self.metrics.generated(1)
        request.emit(TokenOut(token))
        if reason is not None:
            self._finish(request, reason)
        elif past_context(len(request.all_ids), self._max_context):     # the next token would have no position
            self._finish(request, FinishReason.CONTEXT, "the model's context is full")
        return request.status != FINISHED

    def _finish(self, request: Request, reason: FinishReason, message: str = "", code: str = "") -> None:
        if request.status == FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.handle is not None:
            batch.release(self.engine, request.handle)
            request.handle = None
        if request.decoder is not None and request.decoder.spec is not None:
            request.decoder.spec.close()
            request.decoder.spec = None
        if request.num_preemptions:
            self.tier.drop(request.id)
        request.status = FINISHED
        if self.metrics:
            self.metrics.finished(reason)
        request.emit(Finished(reason, message, len(request.prompt_ids), len(request.output_ids), code))

    def _report(self) -> None:
        usage = batch.usage(self.engine)
        self.max_usage = max(self.max_usage, usage)
        if self.metrics:
            self.metrics.scheduler_state(len(self.running), len(self.waiting) + len(self._inbox), usage,
                                         {batch.sequence_id(r.handle): r.id for r in self.running if r.handle},
                                         tier=(len(self.tier), self.tier.nbytes))
