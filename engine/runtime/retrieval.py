"""Query-aware retrieval (CacheConfig.retrieval_blocks = K): each generated token reads, per layer, the sink blocks,
the newest two blocks and the K blocks whose keys can score highest against its query (Quest, arXiv 2406.10774).

A block's key summary is, per KV head, each channel's max and min over its keys as attention sees them (rotated at
their positions; pages.KeySummaries). For a query q the largest score any key of the block can reach is bounded by
sum_d max(q_d max_d, q_d min_d) = relu(q) . max + min(q, 0) . min, one small matrix product per layer. Blocks are
ranked per query head by how far their bound falls below that head's best, and a block counts by its best head
(max over heads): every KV head of a layer reads the same chosen blocks, as the decode kernels read one row list
per sequence, so a block one head needs is read by all. The chosen rows go to the layer's backend as a narrower
SeqStep; the kernels are the ones full attention uses and read only those pages.

Exact where it must be: a step reads every block when it has no more than K candidates, and a verification's rows
(speculative decoding, at most a block of drafts: ModelRunner.draft_room) rank only blocks full before the step,
each row with its own query, so its tokens are plain decoding's.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kvchat.kernels import cpu_quant

from kvchat.engine.kv.pages import KeySummaries
from kvchat.engine.kv.window import ReadChosen
from kvchat.engine.model.rope import rope_cos_sin, rotate


class BlockChooser:
    """One step's choice of blocks per (layer, retrieval sequence); counts what it read for the dashboard."""

    def __init__(self, cache):
        self.cache = cache
        self.read_blocks = 0            # blocks the step's decode rows read, over layers
        self.held_blocks = 0            # blocks they could have read
        self.per_conversation: dict[int, list[int]] = {}   # first group's seq id -> [read, held, layer rows]
        self._plans: dict[int, tuple] = {}  # id(step plan) -> what its layers share (_plan)
        self._arange = torch.arange(0)
        self._scores, self._out = torch.empty(0), torch.empty(0, dtype=torch.int32)   # choose_blocks' buffers

    @staticmethod
    def applies(st) -> bool:
        return st.one_token_decode and isinstance(st.res.seq.geometry, ReadChosen)

    def narrow(self, st, layer: int, q: torch.Tensor, kc) -> object:
        """st (a one-token decode) with only the chosen blocks' rows; q [1, Hq, D] before RoPE; kc: the layer's K
        component (its pages are read to summarize blocks not yet summarized). st itself when every block is read."""
        plan = self._plans.get(id(st))
        if plan is None:
            plan = self._plans[id(st)] = self._plan(st)
        held, sinks, newest, ids, made, summ = plan
        self.held_blocks += held
        counts = self.per_conversation.setdefault(st.res.seq.members[0].seq_id, [0, 0, 0])
        counts[1] += held
        counts[2] += 1
        if ids is None:
            self.read_blocks += held
            counts[0] += held
            return st
        seq, g, bs, S = st.res.seq, st.res.seq.geometry, st.res.seq.block_size, st.res.first_slot
        if not made[layer]:
            self._summarize(summ, layer, kc, seq, ids, sinks, st.inv_freq)
            made[layer] = True
        best = self._best(q, st, summ.data[layer], ids, g.blocks) + sinks
        slots = torch.cat((self._range(sinks * bs), (best[:, None] * bs + self._range(bs)).flatten(),
                           self._range(S)[newest * bs:]))
        self.read_blocks += sinks + g.blocks + held - newest
        counts[0] += sinks + g.blocks + held - newest
        rows = torch.cat((st.rows[slots.to(st.rows.device)], st.rows[-1:]))
        key_pos = None if st.key_pos is None else torch.cat((st.key_pos[slots], st.key_pos[-1:]))
        return replace(st, rows=rows, past_slots=slots, key_pos=key_pos, key_cos=None, key_sin=None,
                       kernel_args=None)

    def _best(self, q: torch.Tensor, st, summary: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (ascending) of the k best candidates: the C kernel on the CPU, torch elsewhere."""
        if summary.device.type == "cpu" and cpu_quant.available():
            n = ids.numel()
            if self._scores.numel() < n:
                self._scores = torch.empty(2 * n)
                self._out = torch.empty(2 * n, dtype=torch.int32)
            return cpu_quant.choose_blocks(q[0].float().contiguous(), st.q_cos[0], st.q_sin[0], summary, ids, k,
                                           self._out, self._scores).long()
        bounds = self._bounds(summary.index_select(0, ids), rotate(q.float(), st.q_cos, st.q_sin)[0])
        return torch.topk(bounds, k, sorted=False).indices.sort().values

    def _plan(self, st) -> tuple:
        """What every layer's choice for st shares: (blocks held, sink blocks, first newest block, the candidate
        blocks' ids or None when all are read, per layer whether their summaries are made, the summaries)."""
        seq = st.res.seq
        g: ReadChosen = seq.geometry
        bs, S = seq.block_size, st.res.first_slot
        held = -(-(S + 1) // bs)                          # blocks holding the past and the new token
        newest = max(0, S // bs - 1)                      # the block before the new token's, and the new token's
        sinks = min(g.read_sink_blocks, newest)
        if newest - sinks <= g.blocks:
            return held, sinks, newest, None, None, None
        assert not st.n_sink and st.past_slots.numel() == S, "retrieval reads a conversation that dropped nothing"
        ids = torch.tensor(seq.table[sinks:newest], dtype=torch.long)
        summ = self.cache.key_summaries(seq.layout)
        made = summ.made.index_select(0, ids).all(0).tolist()
        return held, sinks, newest, ids, made, summ

    def _range(self, n: int) -> torch.Tensor:
        if self._arange.numel() < n:
            self._arange = torch.arange(max(n, 2 * self._arange.numel()))
        return self._arange[:n]

    @staticmethod
    def _bounds(summary: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """summary [n, Hkv, 2D] (max, min), q [Hq, D] rotated -> [n]: each block's best head's bound less that
        head's best bound (0 for a block some head ranks first)."""
        n, hkv, d2 = summary.shape
        hq, d = q.shape
        qg = q.view(hkv, hq // hkv, d)
        signed = torch.cat((qg.clamp(min=0), qg.clamp(max=0)), -1)            # [Hkv, g, 2D]
        bound = torch.bmm(signed, summary.float().permute(1, 2, 0))            # [Hkv, g, n]
        rel = bound - bound.amax(-1, keepdim=True)
        return rel.flatten(0, 1).amax(0)

    @staticmethod
    def _summarize(summ: KeySummaries, layer: int, kc, seq, ids: torch.Tensor, first: int, inv_freq) -> None:
        """Make the summaries of blocks `ids` (table positions first.. of seq) in `layer` where they are not made."""
        missing = (~summ.made[ids, layer]).nonzero().flatten()
        if not missing.numel():
            return
        bs = seq.block_size
        blocks = missing + first
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()
        keys = kc.values(seq.seq_id, seq.block_table, seq.seq_len, slots)        # [m * bs, H, D] float32
        if kc.fmt.is_quantized:             # stored before RoPE: rotate at their positions as attention does
            cos, sin = rope_cos_sin(slots, inv_freq.cpu())
            keys = rotate(keys, cos.to(keys.device), sin.to(keys.device))
        keys = keys.view(missing.numel(), bs, *keys.shape[1:])
        block_ids = ids[missing]
        summ.data[layer][block_ids] = torch.cat((keys.amax(1), keys.amin(1)), -1).to(torch.bfloat16)
        summ.made[block_ids, layer] = True
