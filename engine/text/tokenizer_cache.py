"""A model's tokenizer and chat template: from a GGUF's metadata (built once, cached in the user cache dir) or a
Hugging Face folder (through a private copy, so no code of the folder runs)."""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.source import Progress, SAFE_PRETRAINED, private_model_dir
from kvchat.engine.paths import tokenizer_cache_dir
def gguf_tokenizer_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return tokenizer_cache_dir() / f"{path.stem}-{key}"


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
            try:                  # a kind of tokenizer gguf/tokenizer.py does not build: transformers' converter
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


def _load_cached(folder: Path):
    """The tokenizer this module cached, read by `tokenizers` and jinja2 alone: transformers is not imported
    (a second of every start) once the cache is written."""
    from kvchat.engine.text.tokenizer import ChatTokenizer
    return ChatTokenizer(folder)


def _write_gguf_tokenizer(path: Path, folder: Path) -> bool:
    """The tokenizer folder written by gguf/tokenizer.py (`tokenizers` alone, no transformers: seconds less on
    a first start); False when the file's tokenizer is of a kind only transformers' converter builds."""
    from kvchat.engine.gguf.file import GGUFFile
    from kvchat.engine.gguf.tokenizer import NotCovered, write_folder
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
    return one_encode_at_a_time(PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra))


def one_encode_at_a_time(tok):
    """transformers' encode sets split_special_tokens on the shared Rust tokenizer, then encodes with the GIL
    released: two threads of the server encoding at once (a user's text read as plain text, a template's
    <|im_start|> as its token) could swap flags, and a template's special tokens came out as text pieces. The
    tokenizer's encode is wrapped in a lock of its own (ChatTokenizer holds one too)."""
    lock, encode = threading.Lock(), tok.encode

    def locked_encode(*args, **kwargs):
        with lock:
            return encode(*args, **kwargs)
    tok.encode = locked_encode
    return tok


def _auto_gguf_tokenizer(path: Path):
    """AutoTokenizer on the GGUF, through a private folder: the folder's own config files are never read."""
    from transformers import AutoTokenizer
    with private_model_dir(path.parent, (), links=(path,)) as tmp:
        return one_encode_at_a_time(AutoTokenizer.from_pretrained(str(tmp), gguf_file=path.name, **SAFE_PRETRAINED))


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    try:
        with private_model_dir(folder) as tmp:
            return one_encode_at_a_time(AutoTokenizer.from_pretrained(str(tmp), **SAFE_PRETRAINED))
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"no usable tokenizer in {folder} ({type(exc).__name__}: {exc})") from exc
