"""What the packed weight path costs in fidelity, per GGUF type: `kvchat bench quality --weight-fidelity`.

For each type, one GGUF holds the model's weights in that type (the default model's own file, or
its weights requantized with gguf's quantizers into the type, so every type sees real weight
statistics). The packed path (weights="auto": the file's blocks kept packed, int16 activations in
the C kernels) is teacher-forced over a text one token per step, the decode path, against a dense
fp32 forward over the same file's weights dequantized by gguf's own `dequantize`. Reported: top-1
agreement, mean KL(dense || packed), perplexity ratio, and the largest logit difference of a
whole-text prefill (which dequantizes slabs of the same codes).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from kvchat.engine.config import CacheConfig, EngineConfig
from kvchat.engine.units import MIB

TARGETS = {"top1_min": 0.98, "kl_max": 0.002}
# types the default model (hidden 576) can hold: K-quants need rows of 256 and fall back to these
DEFAULT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16")


def requantize_gguf(src: Path, out: Path, mix: str) -> Path:
    """Write src's tensors requantized into `mix` (gguf_writer.MIXES) to out, with all of src's metadata."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
    from gguf.quants import dequantize

    from kvchat.bench.gguf_writer import MIXES, atomic_writer, quantize, tensor_type
    reader = GGUFReader(str(src))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    with atomic_writer(out, arch) as writer:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
                continue
            vtype = GGUFValueType(field.types[0])
            sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)
        writer.add_file_type(int(MIXES[mix][2]))
        count = reader.fields.get(f"{arch}.expert_count")
        experts = int(count.contents()) if count is not None else 0
        for t in reader.tensors:
            x = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            kind = tensor_type(mix, t.name, layers, tied, experts, stacked=x.ndim == 3) if x.ndim >= 2 else "F32"
            if x.ndim >= 2 and kind.endswith("_K") and x.shape[-1] % 256:
                kind = {"Q6_K": "Q8_0", "Q5_K": "Q5_1"}.get(kind, "Q5_0")      # llama.cpp's fallback for short rows
            data = quantize(x.reshape(-1, x.shape[-1]), kind)               # experts [E, out, in] by their rows
            data = data.reshape(*x.shape[:-1], data.shape[-1])
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return out


def fidelity(path: str, ids: list[int], threads: int | None = None) -> dict:
    """Packed against dense fp32 on one file, teacher-forced one token per step over ids (the decode path), with
    int16 activations (the default) and, under "int8_activations", int8 ones (EngineConfig(activations="int8"))."""
    from kvchat.engine.runtime.engine import Engine
    cache = CacheConfig(budget_mb=512)
    packed = Engine.load(EngineConfig(model=path, cache=cache, num_threads=threads, prefill="fp32"))
    act8 = Engine.load(EngineConfig(model=path, cache=cache, num_threads=threads, prefill="fp32", activations="int8"))
    dense = Engine.load(EngineConfig(model=path, weights="dense", cache=cache, num_threads=threads))
    sessions = {"int16": packed.new_session(), "int8": act8.new_session()}
    sd = dense.new_session()
    agree, kl, nll = dict.fromkeys(sessions, 0), dict.fromkeys(sessions, 0.0), dict.fromkeys([*sessions, "dense"], 0.0)
    for i in range(len(ids) - 1):
        ld = torch.log_softmax(sd.append([ids[i]])[-1].double(), -1)
        nll["dense"] -= float(ld[ids[i + 1]])
        for name, session in sessions.items():
            lp = torch.log_softmax(session.append([ids[i]])[-1].double(), -1)
            agree[name] += int(lp.argmax() == ld.argmax())
            kl[name] += float((ld.exp() * (ld - lp)).sum())
            nll[name] -= float(lp[ids[i + 1]])
    n = len(ids) - 1
    prefill_diff = (packed.new_session().append(ids) - dense.new_session().append(ids)).abs().max().item()
    return {"quant": packed.model.quant, "kinds": packed.model.linear_kinds(), "tokens": n,
            "top1_agreement": agree["int16"] / n, "mean_kl": kl["int16"] / n,
            "ppl_ratio": math.exp((nll["int16"] - nll["dense"]) / n),
            "int8_activations": {"top1_agreement": agree["int8"] / n, "mean_kl": kl["int8"] / n,
                                 "ppl_ratio": math.exp((nll["int8"] - nll["dense"]) / n)},
            "prefill_max_logit_diff": prefill_diff, "weight_bytes": packed.model.weight_bytes(),
            "dense_weight_bytes": dense.model.weight_bytes()}


def _agreement(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(ref || got) over the rows of two [T, vocab] logit tensors."""
    lr, lg = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lr.exp() * (lr - lg)).sum(-1)
    return {"top1_agreement": float((lr.argmax(-1) == lg.argmax(-1)).double().mean()), "mean_kl": float(kl.mean())}


def prefill_paths(path: str, ids: list[int], threads: int | None = None) -> dict:
    """The prompt path of each precision against the dense fp32 forward, one whole-text prefill each, every
    position's logits compared: our fp32 and bf16 GEMMs over the packed weights, and llama.cpp's own prefill
    (its int8 activations) on the same file and token ids, when llama-cpp-python is installed."""
    from kvchat.engine.runtime.engine import Engine
    cache = CacheConfig(budget_mb=512)
    dense = Engine.load(EngineConfig(model=path, weights="dense", cache=cache, num_threads=threads))
    ref = dense.new_session().append(ids)
    del dense
    out = {}
    for mode in ("fp32", "bf16"):
        engine = Engine.load(EngineConfig(model=path, prefill=mode, cache=cache, num_threads=threads))
        out[f"kvchat {mode}"] = _agreement(ref, engine.new_session().append(ids))
        del engine
    try:
        from llama_cpp import Llama
    except ImportError:
        return out
    llm = Llama(model_path=path, n_ctx=len(ids) + 8, n_threads=threads or torch.get_num_threads(),
                n_threads_batch=threads or torch.get_num_threads(), n_batch=512, logits_all=True, verbose=False)
    llm.eval(ids)
    out["llama.cpp"] = _agreement(ref, torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32)))
    llm.close()
    return out


def run_types(model: str, types: list[str], tokens: int, threads: int | None = None) -> dict:
    from kvchat.engine.model.source import locate
    from kvchat.engine.paths import weight_fidelity_dir
    from kvchat.engine.text.tokenizer_cache import gguf_tokenizer
    from kvchat.engine.text.samples import load_tokens
    src = locate(model).path
    out_dir = weight_fidelity_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for kind in types:
        if kind == "file":
            path = src
        else:
            path = out_dir / f"{src.stem}-{kind}.gguf"
            if not path.is_file():
                requantize_gguf(src, path, kind)
        tok = gguf_tokenizer(path)          # cached per file: no engine loaded just for it
        ids = load_tokens(tok, "prose", tokens + 1)
        results[kind] = fidelity(str(path), ids, threads)
        results[kind]["prefill_paths"] = prefill_paths(str(path), ids[:-1], threads)
    return results


def checks(results: dict) -> dict[str, bool]:
    out = {}
    for kind, r in results.items():
        out[f"weights {kind}: top-1 >= {TARGETS['top1_min']:.0%}"] = r["top1_agreement"] >= TARGETS["top1_min"]
        out[f"weights {kind}: mean KL <= {TARGETS['kl_max']}"] = r["mean_kl"] <= TARGETS["kl_max"]
    return out


def summarize(results: dict) -> list[str]:
    lines = [f"{'weights':<8}{'held as':<18}{'tokens':>7}{'top-1':>9}{'KL':>11}{'ppl ratio':>11}{'prefill Δ':>11}"
             f"{'MiB':>7}"]
    for kind, r in results.items():
        held = "+".join(f"{k}×{n}" for k, n in sorted(r["kinds"].items()))
        lines.append(f"{kind:<8}{held:<18}{r['tokens']:>7}{r['top1_agreement']:>9.2%}{r['mean_kl']:>11.6f}"
                     f"{r['ppl_ratio']:>11.4f}{r['prefill_max_logit_diff']:>11.2e}{r['weight_bytes'] / MIB:>7.0f}")
    lines.append("int8 activations (EngineConfig(activations='int8')), the same decode steps:")
    for kind, r in results.items():
        a = r.get("int8_activations")
        if a:
            lines.append(f"  {kind:<8}{'kvchat int8':<16} top-1 {a['top1_agreement']:>8.2%}  KL {a['mean_kl']:.6f}"
                         f"  ppl ratio {a['ppl_ratio']:.4f}")
    lines.append("prompt paths (a whole-text prefill, every position) against the dense fp32 forward:")
    for kind, r in results.items():
        for path, a in r.get("prefill_paths", {}).items():
            lines.append(f"  {kind:<8}{path:<16} top-1 {a['top1_agreement']:>8.2%}  KL {a['mean_kl']:.6f}")
    return lines
