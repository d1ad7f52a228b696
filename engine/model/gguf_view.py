"""The model's view of a GGUF: the container (engine/gguf/file.py) plus the family its architecture names.

The container reads any file; here a file becomes a model kvchat runs, or a refusal that names the
architecture and what kvchat runs instead (families.gguf_family). The view speaks the Hugging Face names
every loader uses (model.layers.3.self_attn.q_proj.weight) and maps them to llama.cpp's per family, reads
the header's numbers into config.json's words (gguf_arch.family_config), and knows which of the converter's
rows it interleaved. Being a GGUFFile, it goes wherever a file goes (blocks.packed_matrix reads through
`gguf_name`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.model import gguf_arch
from kvchat.engine.model.families import Family, gguf_family

_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight",
                **{own: hf for hf, own in gguf_arch.GEMMA4_MODEL_TENSORS.items()}}
# llama.cpp's layer tensors whose name is not <module>.<kind> (Gemma 4's): their own name -> kvchat's module.kind
_RENAMED = {own: hf for hf, own in gguf_arch.GEMMA4_RENAMED.items()}
# an expert matrix llama.cpp stores with gate and up fused ([experts, 2 x ffn, hidden], gate rows first)
_FUSED_EXPERTS = "mlp.experts.gate_up_proj"
_TOP_HF = {hf: own for own, hf in _TOP_TENSORS.items()}


class GGUFModel(GGUFFile):
    """A GGUF of a family kvchat runs; constructing one of any other architecture raises ModelLoadError."""

    family: Family

    def _metadata_read(self) -> None:
        # the architecture is known (or refused) before any tensor is looked at: a truncated file of an
        # architecture kvchat does not run is refused for its architecture
        self.field("general.architecture")
        self.family = gguf_family(self.arch, self.path.name)

    @classmethod
    def of(cls, gf: GGUFFile | Path | str) -> "GGUFModel":
        """The model view of a container (re-reading only its header) or of a path; a view is returned as it is."""
        if isinstance(gf, GGUFModel):
            return gf
        return cls(gf.path if isinstance(gf, GGUFFile) else Path(gf))

    def hf_config(self) -> dict:
        """The architecture numbers in config.json's words, as the header holds them: ModelConfig.from_hf checks
        them, naming each by its key here (key_names)."""
        a = self.arch
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelLoadError(f"{self.path.name} has no token_embd.weight tensor: the file is incomplete")
        if len(embd.shape) != 2:
            raise ModelLoadError(f"{self.path.name}: token_embd.weight has shape {list(embd.shape)}, not [hidden, "
                                 f"vocabulary]: the file is damaged; re-download or re-convert it")
        head_dim = self.fields.get(f"{a}.attention.key_length", self.fields.get(f"{a}.rope.dimension_count"))
        cfg = {
            "model_type": self.family.model_types[0],
            "vocab_size": int(embd.shape[1]),
            "hidden_size": self.field(f"{a}.embedding_length"),
            "num_hidden_layers": self.field(f"{a}.block_count"),
            "num_attention_heads": self.field(f"{a}.attention.head_count"),
            "num_key_value_heads": self.fields.get(f"{a}.attention.head_count_kv"),
            "head_dim": head_dim,                 # absent: hidden_size // heads, as config.json's default
            "intermediate_size": self.fields.get(f"{a}.feed_forward_length") or self.field(
                f"{a}.expert_feed_forward_length" if f"{a}.expert_count" in self.fields else f"{a}.feed_forward_length"),
            "rms_norm_eps": self.fields.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.fields.get(f"{a}.rope.freq_base", 10000.0),
            "max_position_embeddings": self.fields.get(f"{a}.context_length", 4096),
            "tie_word_embeddings": "output.weight" not in self.tensors,
        }
        kind = self.field(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": self.field(f"{a}.rope.scaling.factor")}
        elif kind == "yarn" and a == "gpt-oss":       # read with the family's fields (gguf_arch.py)
            pass
        elif kind not in ("none", ""):
            raise ModelLoadError(f"{self.path.name}: unsupported rope scaling {kind!r}: kvchat supports none and linear")
        cfg.update(gguf_arch.family_config(self, cfg))
        return cfg

    def key_names(self) -> dict[str, str]:
        """hf_config's keys -> the header's own, for messages."""
        a = self.arch
        return {"vocab_size": "token_embd.weight's rows", "hidden_size": f"{a}.embedding_length",
                "num_hidden_layers": f"{a}.block_count", "num_attention_heads": f"{a}.attention.head_count",
                "num_key_value_heads": f"{a}.attention.head_count_kv", "head_dim": f"{a}.attention.key_length",
                "intermediate_size": f"{a}.feed_forward_length", "max_position_embeddings": f"{a}.context_length",
                "rms_norm_eps": f"{a}.attention.layer_norm_rms_epsilon", "rope_theta": f"{a}.rope.freq_base",
                "rope_scaling.factor": f"{a}.rope.scaling.factor", **gguf_arch.key_names(a)}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape under its Hugging Face name, [out, in] (the reverse of the file's order); a layer's
        tensors of kinds kvchat does not read keep a name of their own, so that they still count as a layer."""
        modules = {v: k for k, v in self.family.gguf_tensors.items()}
        out = {}
        per_expert: dict[str, list] = {}
        # the multi-token-prediction blocks after the trunk (Qwen3.5's) are not layers kvchat runs
        mtp_from = gguf_arch.trunk_layers(self) if f"{self.arch}.nextn_predict_layers" in self.fields else None
        for name, t in self.tensors.items():
            parts = name.split(".")
            if mtp_from is not None and parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() \
                    and int(parts[1]) >= mtp_from:
                continue
            if len(parts) == 3 and parts[0] == "blk" and parts[2] in gguf_arch.BARE_TENSORS:
                parts.append("weight")
            if name in _TOP_TENSORS:
                out[_TOP_TENSORS[name]] = tuple(reversed(t.shape))
            elif parts[0] == "blk" and len(parts) > 2 and ".".join(parts[2:]) in _RENAMED:
                out[f"model.layers.{parts[1]}.{_RENAMED['.'.join(parts[2:])]}"] = tuple(reversed(t.shape))
            elif len(parts) == 4 and parts[0] == "blk" and modules.get(parts[2]) == _FUSED_EXPERTS:
                e, rows, cols = reversed(t.shape)       # read as kvchat's gate and up matrices (fused_experts)
                for half in ("gate_proj", "up_proj"):
                    out[f"model.layers.{parts[1]}.mlp.experts.{half}.{parts[3]}"] = (e, rows // 2, cols)
            elif len(parts) == 4 and parts[0] == "blk":
                out[f"model.layers.{parts[1]}.{modules.get(parts[2], '?' + parts[2])}.{parts[3]}"] = tuple(reversed(t.shape))
            elif len(parts) == 5 and parts[0] == "blk" and parts[2] in gguf_arch.PER_EXPERT_TENSORS \
                    and parts[3].isdigit():
                # Mixtral's older files: one 2-D tensor per expert, read as the 3-D module [experts, out, in]
                key = f"model.layers.{parts[1]}.{gguf_arch.PER_EXPERT_TENSORS[parts[2]]}.{parts[4]}"
                per_expert.setdefault(key, []).append((int(parts[3]), tuple(reversed(t.shape))))
        for key, experts in per_expert.items():
            shapes = {shape for _, shape in experts}
            ids = sorted(e for e, _ in experts)
            if len(shapes) != 1 or ids != list(range(len(ids))):
                raise ModelLoadError(f"{self.path.name}: the per-expert tensors of {self.gguf_name(key)} disagree in "
                                     f"shape or skip an expert: the file is damaged; re-download or re-convert it")
            out[key] = (len(ids), *shapes.pop())
        return out

    def expert_names(self, hf_name: str) -> list[str] | None:
        """The per-expert 2-D tensors (blk.N.ffn_gate.E.weight) that hold the 3-D module `hf_name` in Mixtral's older
        files, in expert order; None where the file stores it as one 3-D tensor (or not at all)."""
        if self.has(hf_name):
            return None
        _, _, i, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        short = {v: k for k, v in gguf_arch.PER_EXPERT_TENSORS.items()}.get(module)
        names = []
        while short is not None and f"blk.{i}.{short}.{len(names)}.{kind}" in self.tensors:
            names.append(f"blk.{i}.{short}.{len(names)}.{kind}")
        return names or None

    def rope_factors(self) -> tuple[float, ...] | None:
        """Llama 3.x GGUFs store their rope scaling as per-frequency divisors (rope_freqs.weight)."""
        t = self.tensors.get("rope_freqs.weight")
        return tuple(float(v) for v in np.asarray(t.data, dtype=np.float32)) if t is not None else None

    def gguf_name(self, hf_name: str) -> str:
        """llama.cpp's name of a tensor kvchat names `hf_name` (a name that is already llama.cpp's passes through)."""
        if hf_name.startswith("blk.") or hf_name in self.tensors:
            return hf_name
        if hf_name in _TOP_HF:
            return _TOP_HF[hf_name]
        _, _, i, rest = hf_name.split(".", 3)
        if rest in gguf_arch.GEMMA4_RENAMED and self.arch == "gemma4":
            return f"blk.{i}.{gguf_arch.GEMMA4_RENAMED[rest]}"
        module, kind = rest.rsplit(".", 1)
        tensors = self.family.gguf_tensors
        if module not in tensors and module in ("mlp.experts.gate_proj", "mlp.experts.up_proj") \
                and _FUSED_EXPERTS in tensors:         # half of the fused expert matrix
            module = _FUSED_EXPERTS
        return gguf_arch.gguf_tensor_name(i, tensors[module], kind)

    def fused_experts(self, hf_name: str) -> str | None:
        """The fused gate | up expert tensor (kvchat's name) holding the expert matrix `hf_name`
        (model.layers.N.mlp.experts.gate_proj.weight), where the file stores them fused; else None."""
        if not hf_name.endswith(("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight")):
            return None
        fused = hf_name.rsplit(".mlp.experts.", 1)[0] + f".{_FUSED_EXPERTS}.weight"
        return fused if _FUSED_EXPERTS in self.family.gguf_tensors and self.has(fused) else None

    def dequantize(self, name: str) -> np.ndarray:
        """float32, in transformers' order where llama.cpp's converter reordered a Gated DeltaNet's value heads
        (gguf_arch.value_head_order; a packed reader takes the same index)."""
        w = super().dequantize(name)
        order = gguf_arch.value_head_order(self, name)
        return w if order is None else np.take(w, order[1], axis=order[0])

    def permuted_heads(self, hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
        """How many heads' rows llama.cpp's converter interleaved in this tensor (unpermute_rows undoes it):
        q and k of the families it permutes, None for every other tensor."""
        if not self.family.gguf_permuted_qk:
            return None
        for module, heads in (("self_attn.q_proj", num_heads), ("self_attn.k_proj", num_kv_heads)):
            if f".{module}." in hf_name:
                return heads
        return None
