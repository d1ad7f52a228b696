"""Full-precision pages (fp32, fp16, bf16): keys stored rotated at their absolute positions, so a step reads
every held row once and turns only the sinks. Two backends: torch, and C on the CPU (decode_attend for runs of
one-token decodes, the whole step in one decode_layers call; attn_prompt for prompt and verification rows, the
pages read in place)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.kernels import cpu_quant, cpu_step

from kvchat.engine.model.rope import rotate
from kvchat.engine.runtime.attention import observe_rows, softmax_attention
from kvchat.engine.runtime.backends.base import AttentionBackend, LayerScores, Pages
from kvchat.engine.kv.pages import Component


def _store(kc: Component, vc: Component, q, k, v, st) -> tuple:
    """The step's new keys (rotated at their positions) and values written to their page rows -> (K pages, V pages,
    the queries rotated), what both attends read."""
    new_rows = st.rows[st.rows.shape[0] - q.shape[0]:]
    kc.write_rows(rotate(k.float(), st.q_cos, st.q_sin), new_rows)
    vc.write_rows(v, new_rows)
    return kc.flat_pages(), vc.flat_pages(), rotate(q.float(), st.q_cos, st.q_sin)


def attend_torch(kc: Component, vc: Component, q, k, v, st, scores: LayerScores | None = None,
                 watch=None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] before RoPE: store the rotated keys, then read every held row once."""
    k_pages, v_pages, q_rot = _store(kc, vc, q, k, v, st)
    k_all = k_pages.index_select(0, st.rows).float()
    v_all = v_pages.index_select(0, st.rows).float()
    if st.n_sink:
        k_all[:st.n_sink] = rotate(k_all[:st.n_sink], st.delta_cos, st.delta_sin)
    return softmax_attention(q_rot, k_all, v_all, st.decode, *score_args(scores), st.outside, sink_args(scores),
                             None if watch is None else watch.rows(st))


def attend_c(kc: Component, vc: Component, q, k, v, st, scores: LayerScores, watch=None) -> torch.Tensor:
    """attend_torch's result through attn_prompt: the rotated keys stored, then every row over the pages in place
    (no gathered copy of the held keys and values); the sinks' keys turned here, a handful of rows. Where the rows'
    mass is watched, it is measured apart over a gathered copy, as softmax_attention measures it."""
    k_pages, v_pages, q_rot = _store(kc, vc, q, k, v, st)
    sink_keys = None
    if st.n_sink:
        sink_keys = rotate(k_pages.index_select(0, st.rows[:st.n_sink]).float(), st.delta_cos, st.delta_sin)
    out = cpu_quant.attn_prompt(q_rot, k_pages, v_pages, st.rows, scores.scale, scores.softcap, sink_keys,
                                st.outside, scores.sink_logits)
    observe = None if watch is None else watch.rows(st)
    if observe is not None:
        k_all = k_pages.index_select(0, st.rows).float()
        if st.n_sink:
            k_all[:st.n_sink] = sink_keys
        observe_rows(q_rot, k_all, scores.scale, scores.softcap, st.outside, scores.sink_logits, observe)
    return out


class FullPagesTorch(AttentionBackend):
    name = "full-pages-torch"

    def attend(self, layer, q, k, v, st, watch=None):
        kc, vc = self.comps[layer]
        return attend_torch(kc, vc, q, k, v, st, self.scores[layer], watch)


@dataclass
class DecodeGroup:
    """Several sequences' single decode tokens over the same full-precision pages, attended in one kernel call."""

    q_cos: torch.Tensor           # [B, D]
    q_sin: torch.Tensor
    sink_cos: torch.Tensor | None  # [B, D] (rows of sequences without sinks: q_cos, unused)
    sink_sin: torch.Tensor | None
    n_sink: torch.Tensor          # [B] int32
    rows: torch.Tensor            # every sequence's page rows, one after another (int64)
    offsets: torch.Tensor         # [B + 1] int64
    new_rows: torch.Tensor        # [B] the page rows of the new tokens

    def args(self) -> tuple:
        """decode_attend's per-step arguments, as cpu_step.decode_layers takes them."""
        return self.q_cos, self.q_sin, self.sink_cos, self.sink_sin, self.n_sink, self.new_rows, self.rows, self.offsets


def decode_group(steps: list) -> DecodeGroup:
    """steps: consecutive one-token decode steps of sequences sharing one full-precision layout (CPU)."""
    sinks = any(st.n_sink for st in steps)
    if len(steps) == 1:         # one conversation (a chat): its own tensors, no copies (five fewer ops a step)
        st = steps[0]
        n = st.rows.shape[0]
        return DecodeGroup(st.q_cos, st.q_sin, st.sink_cos if sinks else None, st.sink_sin if sinks else None,
                           torch.tensor([st.n_sink], dtype=torch.int32), st.rows.cpu(),
                           torch.tensor([0, n], dtype=torch.long), st.rows[-1:])
    cat = torch.cat
    sizes = torch.tensor([0] + [st.rows.shape[0] for st in steps], dtype=torch.long)
    return DecodeGroup(
        cat([st.q_cos for st in steps]), cat([st.q_sin for st in steps]),
        cat([st.sink_cos if st.n_sink else st.q_cos for st in steps]) if sinks else None,
        cat([st.sink_sin if st.n_sink else st.q_sin for st in steps]) if sinks else None,
        torch.tensor([st.n_sink for st in steps], dtype=torch.int32), cat([st.rows for st in steps]).cpu(),
        sizes.cumsum(0), cat([st.rows[-1:] for st in steps]))


def kernel_covers(comps: Pages, num_heads: int) -> bool:
    """Whether the C decode attention reads these pages: fp32 or bf16 on the CPU, K and V of one dtype."""
    return all(cpu_quant.can_attend_pages(num_heads, kc.pages["data"]) and vc.pages["data"].dtype == kc.pages["data"].dtype
               and vc.pages["data"].is_contiguous() for kc, vc in comps)


class FullPagesC(FullPagesTorch):
    """Full-precision pages on the CPU. decode_attend rotates, stores and attends one-token decodes in one call
    per layer (a sequence's result does not depend on the others in the group); the layers attend inside the
    one-call step (decode_layers), sink logits included."""
    name = "full-pages-c"
    _page_arrays: tuple[int, cpu_step.PageArrays] | None = None    # (Component.moves when built, decode_layers' pages)

    def attend(self, layer, q, k, v, st, watch=None):
        if st.one_token_decode:
            return self.attend_decodes(layer, q, k, v, [st], decode_group([st]), watch)
        kc, vc = self.comps[layer]
        if cpu_quant.can_attend_prompt(q.shape[1], kc.flat_pages()):
            return attend_c(kc, vc, q, k, v, st, self.scores[layer], watch)
        return super().attend(layer, q, k, v, st, watch)

    def prepare_decodes(self, steps):
        return decode_group(steps)

    def attend_decodes(self, layer, q, k, v, steps, grp: DecodeGroup, watch=None):
        kc, vc = self.comps[layer]
        scores = self.scores[layer]
        if q.dtype != torch.float32:
            q, k, v = q.float(), k.float(), v.float()
        cos, sin, sink_cos, sink_sin, n_sink, new_rows, rows, offsets = grp.args()
        mass, copies = (None, []) if watch is None else watch.kernel(steps)
        out = cpu_quant.decode_attend(q, k, v, cos, sin, sink_cos, sink_sin, n_sink, kc.flat_pages(), vc.flat_pages(),
                                      new_rows, rows, offsets, scores.scale, sink_logits=scores.sink_logits, mass=mass,
                                      softcap=scores.softcap)
        if copies:
            watch.done(mass, copies)
        return out

    def one_call_group(self, steps, grp: DecodeGroup, num_heads, mass):
        caps = {s.softcap for s in self.scores}
        if len(caps) > 1:
            return None         # the call takes one soft-cap a group: layers capped apart attend through Python
        kept = self._page_arrays
        if kept is None or kept[0] != Component.moves:      # built again only once any pages moved
            kept = self._page_arrays = (Component.moves, cpu_step.PageArrays(
                [(kc.flat_pages(), vc.flat_pages()) for kc, vc in self.comps], [s.sink_logits for s in self.scores],
                caps.pop()))
        return kept[1], grp.args()


def score_args(scores: LayerScores | None) -> tuple[float | None, float | None]:
    """softmax_attention's (scale, softcap) of a layer; None: head_dim ** -0.5, uncapped."""
    return (None, None) if scores is None else (scores.scale, scores.softcap)


def sink_args(scores: LayerScores | None) -> torch.Tensor | None:
    """softmax_attention's sink_logits of a layer (None: none)."""
    return None if scores is None else scores.sink_logits
