"""The Experts page's numbers: which experts a mixture-of-experts model's last turn used, layer by layer.

The engine counts, per routed layer, the tokens of the last turn (prompt and reply) sent to each expert
(StatsSnapshot.experts); the model's description says how many experts a layer has and how many each token goes to
(LayerSpec.experts). Each token counts `used` times in a routed layer, so a layer's counts add up to tokens x used.
Every number the page shows is computed here from those two.
"""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QCoreApplication

from kvchat.engine.events import StatsSnapshot

from kvchat.app.dashboard.bar_widgets import format_share


@dataclass(frozen=True, slots=True)
class ExpertUse:
    """Per layer: (experts, used per token) from the model, None for a dense layer; and the last turn's tokens per
    expert, None for a dense layer or while nothing was counted (no turn yet, or a snapshot of another model)."""

    routing: tuple[tuple[int, int] | None, ...]
    counts: tuple[tuple[int, ...] | None, ...]

    @property
    def num_layers(self) -> int:
        return len(self.routing)

    @property
    def routed(self) -> list[int]:
        return [i for i, r in enumerate(self.routing) if r is not None]

    @property
    def max_experts(self) -> int:
        return max(r[0] for r in self.routing if r is not None)

    @property
    def counted(self) -> bool:
        return any(c is not None for c in self.counts)

    def tokens(self, layer: int) -> int:
        """Tokens the layer routed in the last turn: its counts over the experts each token took."""
        counts = self.counts[layer]
        return sum(counts) // self.routing[layer][1] if counts is not None else 0

    def share(self, layer: int, expert: int) -> float | None:
        """The share of the layer's tokens that went to this expert, 0.0-1.0; None where nothing is (a dense layer,
        no turn yet, an expert past the layer's count)."""
        counts = self.counts[layer]
        if counts is None or not 0 <= expert < len(counts):
            return None
        tokens = self.tokens(layer)
        return counts[expert] / tokens if tokens else 0.0

    def shares(self) -> list[list[float | None]]:
        """[layer][expert] share, as drawn; rows as wide as the widest layer (each layer's tokens counted once)."""
        rows, width = [], self.max_experts
        for layer, counts in enumerate(self.counts):
            tokens = self.tokens(layer)
            row = [] if counts is None else [n / tokens if tokens else 0.0 for n in counts]
            rows.append(row + [None] * (width - len(row)))
        return rows

    def experts_used(self, layer: int) -> int:
        counts = self.counts[layer]
        return sum(1 for n in counts if n) if counts is not None else 0

    def used_share(self) -> float:
        """Of every (layer, expert) pair the counted layers have, the share that took at least one token."""
        counted = [i for i in self.routed if self.counts[i] is not None]
        pairs = sum(self.routing[i][0] for i in counted)
        return sum(self.experts_used(i) for i in counted) / pairs if pairs else 0.0

    def busiest(self) -> tuple[int, int, float] | None:
        """(layer, expert, share) of the expert that took the largest share of its layer's tokens; None: nothing."""
        cells = [(share, -layer, -e) for layer in self.routed for e in range(self.routing[layer][0])
                 if (share := self.share(layer, e))]
        if not cells:
            return None
        share, layer, e = max(cells)
        return -layer, -e, share

    def even_share(self) -> float:
        """What each expert would take if the router spread the tokens evenly: used / experts."""
        count, used = self.routing[self.routed[0]]
        return used / count


def expert_use(snapshot: StatsSnapshot | None, config) -> ExpertUse | None:
    """What the model routes and what the snapshot counted; None for a dense model (or none known)."""
    layers = getattr(config, "layers", ())
    routing = tuple(None if layer.experts is None else (layer.experts.count, layer.experts.used) for layer in layers)
    if not any(routing):
        return None
    counts = tuple(snapshot.experts) if snapshot is not None else ()
    fits = len(counts) == len(routing) and all(
        c is None or (r is not None and len(c) == r[0]) for c, r in zip(counts, routing))
    return ExpertUse(routing, counts if fits else (None,) * len(routing))


def _joined(values) -> str:
    return "/".join(f"{v:,}" for v in sorted(set(values)))


def summary_text(use: ExpertUse) -> str:
    """"48 layers × 128 experts, 8 per token; last turn: 120 tokens, 37% of experts used at least once"."""
    translate = QCoreApplication.translate
    routed = use.routed
    experts = _joined(use.routing[i][0] for i in routed)
    used = _joined(use.routing[i][1] for i in routed)
    if len(routed) == use.num_layers:
        shape = translate("ExpertsData", "{layers} layers × {experts} experts, {used} per token").format(
            layers=use.num_layers, experts=experts, used=used)
    else:
        shape = translate("ExpertsData", "{routed} of {layers} layers × {experts} experts, {used} per token (the "
                          "others dense)").format(routed=len(routed), layers=use.num_layers, experts=experts, used=used)
    if not use.counted:
        return shape + translate("ExpertsData", "; no turn yet")
    tokens = _joined(use.tokens(i) for i in routed if use.counts[i] is not None)
    return shape + translate("ExpertsData", "; last turn: {tokens} tokens, {share} of experts used at least "
                             "once").format(tokens=tokens, share=format_share(use.used_share()))


def scale_entries(use: ExpertUse) -> list[tuple[str, str]]:
    """What the colours mean, as (kind, text): "none" (white), "few" (light), "busiest" (the darkest: the busiest
    expert's share sets it), "dense" (grey), then ("", what an even spread would give each expert); before any turn
    only the dense layers and a note."""
    translate = QCoreApplication.translate
    dense = [("dense", translate("ExpertsData", "dense layer"))] if len(use.routed) < use.num_layers else []
    if not use.counted:
        return dense + [("", translate("ExpertsData", "the rows fill in with the first reply"))]
    entries = [("none", translate("ExpertsData", "no token")), ("few", translate("ExpertsData", "a few"))]
    busiest = use.busiest()
    if busiest is not None:
        layer, expert, share = busiest
        entries.append(("busiest", translate("ExpertsData", "{share} (layer {layer}, expert {expert})").format(
            share=format_share(share), layer=layer, expert=expert)))
    entries += dense
    entries.append(("", translate("ExpertsData", "an even spread gives each {even}").format(
        even=format_share(use.even_share()))))
    return entries


def hover_text(use: ExpertUse | None, layer: int, expert: int) -> str | None:
    """The cell under the pointer in numbers; None off the grid."""
    translate = QCoreApplication.translate
    if use is None or not 0 <= layer < use.num_layers or not 0 <= expert < use.max_experts:
        return None
    routing = use.routing[layer]
    if routing is None:
        return translate("ExpertsData", "layer {layer}: dense (no experts)").format(layer=layer)
    if expert >= routing[0]:
        return None
    head = translate("ExpertsData", "layer {layer} · expert {expert}").format(layer=layer, expert=expert)
    counts = use.counts[layer]
    if counts is None:
        return head + "\n" + translate("ExpertsData", "no turn yet")
    tokens = use.tokens(layer)
    return head + "\n" + translate("ExpertsData", "{n} of {tokens} tokens ({share})").format(
        n=f"{counts[expert]:,}", tokens=f"{tokens:,}", share=f"{use.share(layer, expert):.1%}") + "\n" + translate(
        "ExpertsData", "layer {layer}: {used} of {count} experts took a token").format(
        layer=layer, used=use.experts_used(layer), count=routing[0])
