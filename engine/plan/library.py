"""The models on this machine: folders the user added and the places the peer apps keep theirs.

Only headers are read (a GGUF's metadata and tensor table, a folder's config.json and safetensors
headers), so a scan of dozens of multi-GB files takes well under a second. Each entry says what the
model is and, per cache format, the longest context that fits beside its weights in the memory
available (engine.plan.estimate's arithmetic).

Where the peers keep models (Linux and macOS paths; each app can be told to use another folder,
which the user adds by hand):
- LM Studio: ~/.lmstudio/models/<publisher>/<repo>/*.gguf (older versions ~/.cache/lm-studio/models)
- Jan: ~/jan/models/<id>/*.gguf (before 0.5), <data folder>/models, and since 0.6
  <data folder>/llamacpp/models/<id>/model.gguf, the data folder being ~/.local/share/Jan/data
  (~/Library/Application Support/Jan/data on macOS)
- Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub, as
  models--<org>--<name>/snapshots/<revision>/ (config.json + safetensors, or .gguf files)
- Ollama: $OLLAMA_MODELS, else ~/.ollama/models (/usr/share/ollama/.ollama/models for the Linux
  service): manifests/<registry>/<namespace>/<model>/<tag> is JSON whose layer of mediaType
  application/vnd.ollama.image.model names the GGUF blob blobs/sha256-<hex>
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.config import ConfigError
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.families import family
FIT_FORMATS = ("fp16", "int8", "fp8", "int4")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str                       # what to show: file stem, repo name, or ollama name:tag
    path: str                       # the .gguf file or the Hugging Face folder (an Ollama blob for Ollama)
    source: str                     # "LM Studio", "Jan", "Hugging Face", "Ollama", or "Folder"
    kind: str                       # "gguf" or "safetensors"
    architecture: str = ""
    parameters: int = 0
    quantization: str = ""
    file_bytes: int = 0
    trained_context: int = 0
    fits: tuple[tuple[str, int | None], ...] = ()    # (format, largest context; None: unbounded)
    error: str = ""                 # why it cannot load (unsupported architecture, damaged file)

    @property
    def loadable(self) -> bool:
        return not self.error


def peer_locations(home: Path | None = None) -> list[tuple[str, Path]]:
    """(source, folder) of every place a peer app keeps models, existing or not."""
    home = Path.home() if home is None else home
    jan_data = [home / ".local" / "share" / "Jan" / "data", home / "Library" / "Application Support" / "Jan" / "data"]
    hf = os.environ.get("HF_HUB_CACHE") or (Path(os.environ["HF_HOME"]) / "hub" if os.environ.get("HF_HOME")
                                            else home / ".cache" / "huggingface" / "hub")
    ollama = [Path(os.environ["OLLAMA_MODELS"])] if os.environ.get("OLLAMA_MODELS") else \
        [home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    return ([("LM Studio", home / ".lmstudio" / "models"), ("LM Studio", home / ".cache" / "lm-studio" / "models"),
             ("Jan", home / "jan" / "models")]
            + [("Jan", d / sub) for d in jan_data for sub in ("models", "llamacpp/models")]
            + [("Hugging Face", Path(hf))]
            + [("Ollama", d) for d in ollama])


def _gguf_files(folder: Path) -> list[Path]:
    # vision projectors (mmproj) are GGUFs too but not language models
    return sorted(p for p in folder.rglob("*.gguf") if p.is_file() and not p.name.lower().startswith("mmproj"))


def _hf_folders(folder: Path) -> list[Path]:
    return sorted(cfg.parent for cfg in folder.rglob("config.json") if any(cfg.parent.glob("*.safetensors")))


def find_models(folder: Path, source: str) -> list[tuple[str, Path]]:
    """(name, path) of the models under one folder, read the way `source` lays them out."""
    if not folder.is_dir():
        return []
    if source == "Ollama":
        return _ollama_models(folder)
    if source == "Hugging Face":
        found = []
        for repo in sorted(folder.glob("models--*")):
            label = repo.name.removeprefix("models--").replace("--", "/")
            snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
            for snap in snapshots[:1]:              # the newest revision only
                found += [(f"{label}/{p.stem}", p) for p in _gguf_files(snap)]
                if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
                    found.append((label, snap))
        return found
    return [(p.stem, p) for p in _gguf_files(folder)] + [(p.name, p) for p in _hf_folders(folder)]


def _ollama_models(root: Path) -> list[tuple[str, Path]]:
    found = []
    manifests = root / "manifests"
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()) if manifests.is_dir() else []:
        try:
            layers = json.loads(manifest.read_text()).get("layers", [])
        except (OSError, ValueError, AttributeError):
            continue
        for layer in layers:
            if layer.get("mediaType") == OLLAMA_MODEL_LAYER and str(layer.get("digest", "")).startswith("sha256:"):
                blob = root / "blobs" / layer["digest"].replace(":", "-")
                if blob.is_file():
                    parts = manifest.relative_to(manifests).parts          # registry/namespace/model/tag
                    model = parts[-2] if parts[-3] == "library" else "/".join(parts[-3:-1])
                    found.append((f"{model}:{parts[-1]}", blob))
    return found


def describe(name: str, path: Path, source: str, memory_bytes: int, device: str = "cpu") -> ModelEntry:
    """One entry from headers alone; an unreadable or unsupported model gets its reason in `error`."""
    from kvchat.engine.plan.estimate import estimate, model_facts_from
    kind = "safetensors" if path.is_dir() else "gguf"
    size = (sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else path.stat().st_size)
    try:
        facts = model_facts_from(path, name)
        e = estimate(facts, 1, formats=FIT_FORMATS, memory_bytes=memory_bytes, memory_source="library", device=device)
    except (ModelLoadError, ConfigError, OSError, ValueError, KeyError) as exc:
        return ModelEntry(name, str(path), source, kind, file_bytes=size, error=str(exc))
    fits = tuple((r.format, r.max_context) for r in e.rows)
    # the family's name ("gemma3"), which a GGUF and a folder (model_type gemma3_text) of one model share
    arch = family(facts.config.model_type, str(path)).name
    return ModelEntry(name, str(path), source, kind, arch, facts.parameters, facts.weights_label,
                      size, facts.config.max_position_embeddings, fits)


def scan(folders: list[str | Path] = (), memory_bytes: int | None = None, device: str = "cpu",
         home: Path | None = None) -> list[ModelEntry]:
    """Every model in the user's folders and the peers' places, each file once (the first place found)."""
    from kvchat.engine.plan.estimate import available_memory
    if memory_bytes is None:
        memory_bytes, _ = available_memory(device)
    places = [("Folder", Path(f).expanduser()) for f in folders] + peer_locations(home)
    seen, entries = set(), []
    for source, folder in places:
        for name, path in find_models(folder, source):
            key = path.resolve()
            if key in seen:
                continue
            seen.add(key)
            entries.append(describe(name, path, source, memory_bytes, device))
    return entries


def loadable_path(entry: ModelEntry, link_dir: Path | None = None) -> str:
    """A path the loader accepts: an Ollama blob (no .gguf suffix) gets a named .gguf link in the cache dir."""
    path = Path(entry.path)
    if entry.kind != "gguf" or path.suffix == ".gguf":
        return str(path)
    from kvchat.engine.model.source import cache_root
    link_dir = link_dir or cache_root() / "ollama-links"
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / (entry.name.replace("/", "_").replace(":", "-") + ".gguf")
    if link.is_symlink() and link.resolve() != path.resolve():
        link.unlink()
    if not link.exists():
        link.symlink_to(path)
    return str(link)


def format_tokens(n: int | None) -> str:
    if n is None:
        return "any"
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1000:.0f}k" if n >= 10_000 else f"{n:,}"


def format_parameters(n: int) -> str:
    if not n:
        return ""
    exp = min(int(math.log10(n)) // 3, 3)
    return f"{n / 10 ** (3 * exp):.3g}{' KMB'[exp].strip()}"
