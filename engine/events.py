"""What the engine tells its listeners: frozen dataclasses only, never tensors or dicts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerBytes:
    layer: int
    k_bytes: int
    v_bytes: int
    k_format: str
    v_format: str


@dataclass(frozen=True, slots=True)
class MemoryProbe:
    rss_bytes: int                      # process resident set size (psutil)
    torch_allocated_bytes: int          # torch CUDA allocator; 0 on CPU
    gpu_used_bytes: int                 # this process on the GPU via pynvml; 0 when unavailable
    gpu_total_bytes: int


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
    tokens_left: int                    # forecast: more tokens that fit in the budget in this mode
    bytes_per_token: float              # steady-state KV bytes per token in this mode
    prefill_tokens: int                 # tokens prefilled by the last turn (only the new ones)
    prefill_tok_s: float
    decode_tok_s: float
    ttft_s: float                       # time to first token of the last turn
    memory: MemoryProbe
    weight_bytes: int = 0               # the model's weights as held (packed codes, scales, norms)
    weights_label: str = ""             # what they are, e.g. "Q4_1 (+Q8_0), packed"
    full_precision_bytes_per_token: float = 0.0   # KV bytes per token at the model dtype, all layers; 0: unknown
    context_tokens: int = 0             # the model's context limit (max_position_embeddings); 0: unknown

    @property
    def usage(self) -> float:
        """KV bytes held as a share of the budget, 0.0-1.0."""
        return self.kv_bytes / self.budget_bytes if self.budget_bytes else 0.0


@dataclass(frozen=True, slots=True)
class TokenDelta:
    text: str                           # UTF-8-safe piece of the reply
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TurnFinished:
    text: str                           # the whole reply
    finish_reason: str                  # "eos", "length", "stopped", "budget", "context"
    message: str                        # for humans; empty unless something needs saying
    stats: StatsSnapshot
