"""What the engine tells its listeners: frozen dataclasses only, never tensors or dicts."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a reply ended, in the engine's words: the session, the server's scheduler and the remote engine speak
    these; engine.serve.protocol maps them to OpenAI's ("stop", "length") at the server's edge and back. The values
    are what the app stores in its history, so they never change."""

    EOS = "eos"                         # the model's end-of-turn token
    LENGTH = "length"                   # max_new_tokens reached
    STOPPED = "stopped"                 # the user stopped it (or a reset, rewind or close ended it)
    STOP_STRING = "stop_string"         # the server: a request's stop string appeared
    BUDGET = "budget"                   # the KV budget is full
    CONTEXT = "context"                 # the model's context is full
    ABORTED = "aborted"                 # the server: the request was cancelled or the server is shutting down
    ERROR = "error"                     # generation failed (the server's request broke; the model's logits were
                                        # not finite), said in the message
    UNREACHABLE = "unreachable"         # remote: no server answered; nothing was said
    DISCONNECTED = "disconnected"       # remote: the server went away mid-reply; the partial reply is kept


@dataclass(frozen=True, slots=True)
class LayerBytes:
    layer: int
    k_bytes: int
    v_bytes: int
    k_format: str
    v_format: str
    window: int | None = None           # the tokens the layer keeps (its own window or the user's); None: every one
    window_bytes: int | None = None     # the most it holds once that window is full; None: it grows with every token
    kind: str = "attention"             # "linear_attention": a recurrent state instead of K and V (spec.LayerSpec.kind)
    state_bytes: int = 0                # that layer's state, the same at any length (its formats read "state")
    kv_source: int | None = None        # the layer whose K and V this one reads (it holds none: Gemma 4); None: own


@dataclass(frozen=True, slots=True)
class MemoryProbe:
    rss_bytes: int                      # process resident set size (psutil)
    torch_allocated_bytes: int          # torch CUDA allocator; 0 on CPU
    gpu_used_bytes: int                 # this process on the GPU via pynvml; 0 when unavailable
    gpu_total_bytes: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    """The engine's KV pool, shared by every conversation (and server request)."""

    budget_bytes: int
    held_bytes: int                     # blocks in use or kept for prefix reuse, plus full-precision sides
    free_bytes: int
    evictable_blocks: int               # freed blocks kept for prefix reuse: reclaimable at any time
    evictable_bytes: int
    shared_blocks: int                  # blocks referenced by more than one conversation
    blocks_in_use: int
    prefix_queries: int                 # prompt tokens looked up in the prefix index
    prefix_hits: int                    # of those, tokens found cached
    conversations: tuple[tuple[int, int, int, bool], ...] = ()   # (id, blocks, bytes, is this one)
    released: int = 0                   # idle conversations released so far to make room
    storage_bytes: int = 0              # page storage actually allocated (capacity included)
    saved_files: int = 0                # conversations' caches saved on disk (warm conversations)
    saved_bytes: int = 0
    saved_budget_bytes: int = 0         # their disk budget; 0 when this session keeps none
    saved: tuple[tuple[str, int], ...] = ()     # (conversation key, bytes) of each cache saved on disk, newest first
    in_host: tuple[tuple[str, int], ...] = ()   # (conversation key, bytes) of each released to host memory (GPU pool)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(frozen=True, slots=True)
class SpecStats:
    """Speculative decoding in the last turn (engine/runtime/speculative.py): how many drafts were verified, how many
    of them were accepted, and how many tokens each decode step produced."""

    method: str                         # lookup or draft
    drafted: int                        # draft tokens verified
    accepted: int                       # of those, accepted
    steps: int                          # decode steps (forward passes after the first token)
    tokens: int                         # tokens those steps produced
    steps_s: float = 0.0                # the time those steps took, drafting and verifying included
    plain_step_s: float = 0.0           # what a plain step (one token, no drafts) takes here, measured; 0.0: not yet

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def time_saved(self) -> float | None:
        """The share of decode time drafting saved (negative: what it cost) against plain steps producing the same
        tokens at the measured plain-step time; None when either time was not measured."""
        if not self.tokens or self.steps_s <= 0.0 or self.plain_step_s <= 0.0:
            return None
        return 1.0 - self.steps_s / (self.tokens * self.plain_step_s)


@dataclass(frozen=True, slots=True)
class ServerStats:
    """What a remote OpenAI-compatible server reports on /metrics (vLLM's names); None where it says nothing."""

    url: str
    kv_usage: float | None = None       # vllm:kv_cache_usage_perc, 0.0-1.0
    requests_running: int | None = None
    requests_waiting: int | None = None
    prefix_cache_hit_rate: float | None = None   # hits / queries since the previous look (tokens)
    spec_acceptance: float | None = None   # draft tokens accepted / verified since the server started (vLLM's
                                           # vllm:spec_decode_num_accepted_tokens / _num_draft_tokens); None: no drafts
    reachable: bool = True              # False: the last look (or the last reply) found no server answering


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """One look at a session after a step. Every byte count comes from tensors actually held."""

    time_s: float                       # time.monotonic() when taken
    cache_label: str                    # human name of the cache mode
    layers: tuple[LayerBytes, ...]
    kv_bytes: int                       # sum of all layers' K and V bytes (pages + full-precision tail)
    budget_bytes: int
    block_size: int
    blocks_used: int
    blocks_free: int                    # blocks that still fit in the budget
    blocks_budget: int
    tokens_in_context: int              # tokens of the conversation so far
    tokens_held: int                    # tokens whose K/V the cache holds now
    tokens_evicted: int                 # tokens that left the window
    tokens_left: int | None             # forecast: more tokens that fit in the budget in this mode; None when the
                                        # budget does not bound them (a window holds the cache) or nobody says (remote)
    bytes_per_token: float              # steady-state KV bytes per token in this mode
    prefill_tokens: int                 # tokens prefilled by the last turn (only the new ones)
    prefill_tok_s: float
    decode_tok_s: float
    ttft_s: float                       # time to first token of the last turn
    memory: MemoryProbe
    weight_bytes: int = 0               # the model's weights as held (packed codes, scales, norms)
    weights_label: str = ""             # what they are, e.g. "Q4_1 (+Q8_0), packed"
    context_tokens: int = 0             # the model's trained context (0: unknown)
    full_precision_bytes_per_token: float = 0.0   # the same tokens with every component at full precision
    prefix_reused_tokens: int = 0       # prompt tokens of the last turn found in the prefix cache
    pool: PoolStats | None = None
    notice: str = ""                    # something that happened to the cache the user should hear about
    server: ServerStats | None = None   # a remote engine's server-side numbers; None for the local engine
    experts: tuple = ()                 # a mixture of experts: per layer, the tokens of the last turn (prompt and
                                        # reply) routed to each expert (a tuple of counts), None for a dense layer;
                                        # () for a dense model
    spec: SpecStats | None = None       # speculative decoding in the last turn; None when it was off
    state_bytes: int = 0                # the recurrent state of the linear-attention layers (0: a model without them)
    snapshots: tuple[int, ...] = ()     # token counts the state keeps a snapshot of (each costs state_bytes)
    summary_bytes: int = 0              # retrieval's key summaries of the blocks held (in the budget, beside kv_bytes)
    blocks_read: tuple[int, int] = (0, 0)   # retrieval: blocks the last generated token read, and held, per layer
    blocks_on_disk: int = 0             # retrieval: blocks past the budget in the conversation's tier (kv/block_tier.py)
    tier_fetches: tuple[int, int] = (0, 0)  # retrieval: (layer blocks read back from disk, found in the fetch cache)

    @property
    def usage(self) -> float:
        """KV bytes held as a share of the budget, 0.0-1.0."""
        return self.kv_bytes / self.budget_bytes if self.budget_bytes else 0.0


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """A piece of the reply as it streams. A model that reasons apart (gpt-oss's analysis channel:
    engine/text/reasoning.py) sends its reasoning in `reasoning` and its answer in `text`; every other model's
    pieces are all `text`."""

    text: str                           # UTF-8-safe piece of the reply's answer
    token_ids: tuple[int, ...]
    reasoning: str = ""                 # UTF-8-safe piece of its reasoning


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """A prompt longer than one chunk being read: said after each chunk, the last one included (done == total)."""

    done: int                           # prompt tokens the cache holds so far
    total: int                          # prompt tokens the turn reads


@dataclass(frozen=True, slots=True)
class TurnFinished:
    text: str                           # the whole reply: its answer, without the reasoning
    finish_reason: FinishReason
    message: str                        # for humans; empty unless something needs saying
    stats: StatsSnapshot
    reasoning: str = ""                 # the reply's whole reasoning ("" for a model that writes none apart)
