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

from kvchat.engine.kv.window import ReadChosen
from kvchat.engine.model.rope import rotate


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
        component (its pages are read to summarize blocks not yet summarized). st itself when every block is in
        memory and read."""
        plan = self._plans.get(id(st))
        if plan is None:
            plan = self._plans[id(st)] = self._plan(st)
        held, n_cands, counts, tier = plan["held"], plan["n"], plan["counts"], plan["tier"]
        self.held_blocks += held
        counts[1] += held
        counts[2] += 1
        if plan["all"]:
            self.read_blocks += held
            counts[0] += held
            return st
        seq, g, bs = st.res.seq, st.res.seq.geometry, st.res.seq.block_size
        ids, summ, positions = plan["ids"], plan["summ"], plan["positions"]
        if not plan["made"][layer]:
            summ.make(layer, kc, seq.seq_id, seq.block_table, seq.seq_len, ids, plan["slots"], plan["pos_rows"],
                      st.inv_freq)
            plan["made"][layer] = True
        on_disk = plan["disk"]
        if n_cands <= g.blocks:
            best, scores = torch.arange(n_cands), None
        else:
            best, scores = self._best(q, st, summ.data[layer], ids, tier.summaries[layer] if on_disk else None,
                                      plan["disk_rows"], g.blocks)
        bs_range = self._range(bs)
        n_mem = ids.numel()
        mem = best[best < n_mem]
        slots = torch.cat((plan["sink_slots"], (plan["mem_slots"][mem][:, None] * bs + bs_range).flatten(),
                           plan["new_slots"]))
        past = [st.rows[slots.to(st.rows.device)]]
        where = [torch.cat((plan["sink_slots"], (positions[mem][:, None] * bs + bs_range).flatten(), plan["new_pos"]))]
        fetched = 0
        disk_picks = best[best >= n_mem]
        if on_disk and disk_picks.numel() > tier.most:      # the best-scored of them, as many as may come
            keep = scores[disk_picks].argsort(descending=True, stable=True)[:tier.most] if scores is not None \
                else torch.arange(tier.most)
            disk_picks = disk_picks[keep.sort().values]
        for i in disk_picks.tolist():
            p = plan["disk_pos"][i - n_mem]
            try:
                block = tier.fetch(p, layer)
            except OSError as exc:              # gone or damaged: go on with the blocks in memory
                tier.failed = str(exc)
                continue
            fetched += 1
            past.append((block * bs + bs_range).to(st.rows.device))
            where.append(p * bs + bs_range)
        read = plan["fixed"] + mem.numel() + fetched
        self.read_blocks += read
        counts[0] += read
        if fetched:     # blocks from disk (full precision only) among those in memory, all in position order
            rows, past_positions = torch.cat(past), torch.cat(where)
            order = past_positions.argsort()
            rows, past_positions = rows[order.to(rows.device)], past_positions[order]
            return replace(st, rows=torch.cat((rows, st.rows[-1:])), past_slots=torch.empty(0, dtype=torch.long),
                           past_positions=past_positions, key_pos=None, key_cos=None, key_sin=None, kernel_args=None)
        key_pos = None if st.key_pos is None else torch.cat((st.key_pos[slots], st.key_pos[-1:]))
        return replace(st, rows=torch.cat((past[0], st.rows[-1:])), past_slots=slots, past_positions=where[0],
                       key_pos=key_pos, key_cos=None, key_sin=None, kernel_args=None)

    def _best(self, q: torch.Tensor, st, summary: torch.Tensor, ids: torch.Tensor, disk: torch.Tensor | None,
              disk_rows: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices ascending of the k best candidates, every candidate's score): those in memory (ids) first, then
        those on disk (rows of disk); the C kernel on the CPU, torch elsewhere."""
        n = ids.numel() + (0 if disk is None else disk_rows.numel())
        if summary.device.type == "cpu" and cpu_quant.available():
            if self._scores.numel() < n:
                self._scores = torch.empty(2 * n)
                self._out = torch.empty(2 * n, dtype=torch.int32)
            best = cpu_quant.choose_blocks(q[0].float().contiguous(), st.q_cos[0], st.q_sin[0], summary, ids, k,
                                           self._out, self._scores, disk, disk_rows).long()
            return best, self._scores[:n]
        rows = summary.index_select(0, ids)
        if disk is not None:
            rows = torch.cat((rows, disk.index_select(0, disk_rows).to(rows.device)))
        bounds = self._bounds(rows, rotate(q.float(), st.q_cos, st.q_sin)[0])
        return torch.topk(bounds, k, sorted=False).indices.sort().values, bounds

    def _plan(self, st) -> dict:
        """What every layer's choice for st shares: the candidates in memory (ids, their slots and positions) and on
        disk, the rows always read (the sinks', the newest two blocks'), the counts."""
        seq = st.res.seq
        g: ReadChosen = seq.geometry
        bs, S, table = seq.block_size, st.res.first_slot, seq.table
        tier = self.cache.tier_of(seq)
        if tier is not None and tier.failed:
            tier = None                                 # the file failed: the blocks in memory only
        # the block before the new token's, and the new token's (a verification's rows share one table: each row
        # counts from its own position)
        newest = max(0, seq.num_tokens // bs - 1)
        sinks = min(g.read_sink_blocks, newest)
        counts = self.per_conversation.setdefault(seq.members[0].seq_id, [0, 0, 0])
        held = seq.num_tokens // bs + 1
        mem = [p for p in range(sinks, newest) if table[p] is not None]
        disk = [p for p in tier.positions if sinks <= p < newest] if tier is not None else []
        plan = {"held": held, "counts": counts, "tier": tier, "all": False, "n": len(mem) + len(disk)}
        if not disk and plan["n"] <= g.blocks and not seq.evicted:
            plan["all"] = True
            return plan
        assert not st.n_sink, "retrieval reads a conversation whose positions never moved"
        slot_of = {}
        for p, b in enumerate(table):
            if b is not None:
                slot_of[p] = len(slot_of)
        first_newest = slot_of[newest] * bs if newest in slot_of else S
        summ = self.cache.key_summaries(seq.layout)
        ids = torch.tensor([table[p] for p in mem], dtype=torch.long)
        mem_slots = torch.tensor([slot_of[p] for p in mem], dtype=torch.long)
        sink_slots = torch.arange(sinks * bs)
        new_slots = torch.arange(first_newest, S)
        plan.update(
            ids=ids, summ=summ, positions=torch.tensor(mem, dtype=torch.long), mem_slots=mem_slots,
            slots=mem_slots[:, None] * bs + torch.arange(bs), pos_rows=torch.tensor(mem)[:, None] * bs + torch.arange(bs),
            made=summ.made.index_select(0, ids).all(0).tolist() if len(mem) else [True] * len(summ.data),
            disk=bool(disk), disk_pos=disk, disk_rows=tier.summary_rows(disk) if disk else None,
            sink_slots=sink_slots, new_slots=new_slots, new_pos=newest * bs + torch.arange(S - first_newest),
            fixed=sinks + (held - newest))
        return plan

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
