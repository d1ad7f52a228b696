"""A watched conversation's attention, as the attention kernels measured it (KVCache.watch): the last step's rows,
the last prompt's observation window and the running reply. The cache owns it beside the blocks the mass falls on;
Session.attention() reads it as an AttentionMap (engine/runtime/attention_map.py).

A step records rows [R, layers, Hq, mcols]: each row's softmax mass per column of the position axis (columns of
`unit` tokens: the block size, or 1 for dense weights), the learned sink's share in the last column. A decode step's
rows are its tokens (one, or a verification's drafts); a prompt step's two: the mean over its last rows, at most
OBSERVED (SnapKV's observation window), then its last row. Rows of drafts taken back are never read (the newest row
is the cache's last token), and a step's kept rows join the reply when the next step comes.
"""
from __future__ import annotations

import torch

OBSERVED = 32       # a prompt's last rows recorded (SnapKV's observation window)


class AttentionLog:
    def __init__(self, num_layers: int, num_heads: int, block_size: int, weights: str = "blocks"):
        assert weights in ("blocks", "dense"), weights
        self.num_layers, self.num_heads, self.block_size, self.weights = num_layers, num_heads, block_size, weights
        self.unit = 1 if weights == "dense" else block_size
        self.clear()

    def clear(self) -> None:
        """Nothing measured (the conversation's cache was freed)."""
        self.rows: torch.Tensor | None = None     # the last step's [R, layers, Hq, mcols]
        self.held: torch.Tensor | None = None     # [layers, mcols - 1] bool: columns each layer attended to
        self.first = 0                  # the token index of the first row measured
        self.observed = 0               # rows measured by the last step
        self.decode = True              # the last step's kind
        self.pending = False            # the last step's rows have not joined the reply or the prompt yet
        self.prompt: tuple[torch.Tensor, int, int] | None = None   # (mean [layers, Hq, mcols], rows, tokens)
        self.reply: torch.Tensor | None = None      # sum over the reply's rows [layers, Hq, mcols]
        self.reply_rows = 0
        self.reply_start = 0            # the token index of the reply's first row

    def columns(self, num_tokens: int) -> int:
        """mcols for a conversation of num_tokens tokens: its columns, and the sink's."""
        return -(-num_tokens // self.unit) + 1

    def begin(self, first: int, num_rows: int, num_tokens: int, decode: bool, kept: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """A step measures num_rows rows, the first being token `first`, the conversation num_tokens long after it;
        kept: the tokens the cache holds before it (the previous step's rows past it were taken back). -> (rows
        [R, layers, Hq, mcols], held [layers, mcols - 1]) zeroed, for the kernels to fill: R = num_rows for a
        decode, 2 for a prompt (the mean over its num_rows rows, then the last)."""
        self._fold(kept)
        mcols = self.columns(num_tokens)
        self.observed = num_rows
        self.rows = torch.zeros(num_rows if decode else 2, self.num_layers, self.num_heads, mcols)
        self.held = torch.zeros(self.num_layers, mcols - 1, dtype=torch.bool)
        self.first, self.decode, self.pending = first, decode, True
        if not decode:                  # a new prompt: the reply to come starts after it
            self.reply, self.reply_rows = None, 0
        return self.rows, self.held

    def drop(self) -> None:
        """The step failed (rolled back): what it recorded goes."""
        self.rows = self.held = None
        self.pending = False

    def _fold(self, kept: int) -> None:
        """The last step's rows the cache kept join the reply (decode) or become the prompt's window."""
        if self.rows is None or not self.pending:
            return
        self.pending = False
        if not self.decode:
            whole = kept >= self.first + self.observed
            self.prompt = (self.rows[0], self.observed, kept) if whole else None
            return
        n = max(0, min(self.rows.shape[0], kept - self.first))
        if n == 0:
            return
        rows = self.rows[:n]
        total = rows[0] if n == 1 else rows.sum(0)
        if self.reply is None:
            self.reply, self.reply_start = total.clone(), self.first
            return self._count(n)
        if self.reply.shape != total.shape:        # the conversation grew a column: the sink's moves last
            grown = torch.zeros_like(total)
            grown[..., :self.reply.shape[-1] - 1] = self.reply[..., :-1]
            grown[..., -1] = self.reply[..., -1]
            self.reply = grown
        self.reply += total
        self._count(n)

    def _count(self, n: int) -> None:
        self.reply_rows += n

    def newest(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mass [layers, Hq, mcols], held) of the cache's last token (num_tokens held), or None: not recorded."""
        if self.rows is None:
            return None
        r = num_tokens - 1 - self.first
        if not self.decode:
            return (self.rows[1], self.held) if r == self.observed - 1 else None
        if not 0 <= r < self.rows.shape[0]:
            return None
        return self.rows[r], self.held

    def over_prompt(self, num_tokens: int) -> tuple[torch.Tensor, int] | None:
        """(mean mass [layers, Hq, mcols], rows) over the last prompt's observed rows."""
        self._fold(num_tokens)
        return None if self.prompt is None else self.prompt[:2]

    def over_reply(self, num_tokens: int, since_made: bool = False) -> tuple[torch.Tensor, int] | None:
        """(mean mass [layers, Hq, mcols], rows) over the current reply's rows up to the cache's last token. With
        since_made, each column's mean is over the rows that could see it (a block the reply wrote is not judged by
        the rows read before it existed); the sink's column over all."""
        self._fold(num_tokens)          # the rows stay readable as the newest
        if self.reply is None or not self.reply_rows:
            return None
        if not since_made:
            return self.reply / self.reply_rows, self.reply_rows
        end = self.reply_start + self.reply_rows
        first = torch.arange(self.reply.shape[-1] - 1, dtype=torch.float64) * self.unit
        seen = (end - first.clamp(min=self.reply_start)).clamp(1, self.reply_rows)
        seen = torch.cat([seen, torch.tensor([float(self.reply_rows)], dtype=torch.float64)]).to(self.reply.dtype)
        return self.reply / seen, self.reply_rows
