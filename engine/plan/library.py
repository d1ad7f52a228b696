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
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.config import ConfigError
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.families import family
from kvchat.engine.plan.fit import DeviceMemory, host_available_bytes, packs_gguf, plan_fit
FIT_FORMATS = ("fp16", "int8", "fp8", "int4")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str                       # what to show: file stem, repo name, or ollama name:tag
    path: str                       # the .gguf file or the Hugging Face folder (an Ollama blob for Ollama)
    source: str                     # "LM Studio", "Jan", "Hugging Face", "Ollama", or "Folder"
    kind: str                       # "gguf" or "safetensors" ("" for a folder that could not be searched)
    architecture: str = ""
    parameters: int = 0
    quantization: str = ""
    file_bytes: int = 0
    trained_context: int = 0
    fits: tuple[tuple[str, int | None], ...] = ()    # (format, largest context; None: unbounded)
    error: str = ""                 # why it cannot load (unsupported architecture, damaged file)
    active_parameters: int = 0      # a mixture of experts: the parameters one decoded token reads; 0: dense (all)
    verdict: str = ""               # fit.FITS, TIGHT or TOO_BIG on the device planned for; "" with an error
    device: str = ""                # the device `fits` and `verdict` were planned for

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


MISSING = "a link to a file that is not there (an unfinished download, or deleted elsewhere)"
Found = tuple[str, Path, str]       # (name, path, why the layout itself is broken; "" when it is not)


def _gguf_files(folder: Path, prefix: str = "") -> list[Found]:
    # vision projectors (mmproj) are GGUFs too but not language models
    found = []
    for p in sorted(folder.rglob("*.gguf")):
        if p.name.lower().startswith("mmproj"):
            continue
        if p.is_file():
            found.append((prefix + p.stem, p, ""))
        elif p.is_symlink() and not p.exists():
            found.append((prefix + p.stem, p, MISSING))
    return found


def _hf_folders(folder: Path) -> list[Found]:
    return [(cfg.parent.name, cfg.parent, "") for cfg in sorted(folder.rglob("config.json"))
            if any(cfg.parent.glob("*.safetensors"))]


def find_models(folder: Path, source: str) -> list[Found]:
    """(name, path, error) of the models under one folder, read the way `source` lays them out. An entry whose
    layout is broken (a manifest that names no model, a link to nothing) comes with its reason, not left out."""
    if not folder.is_dir():
        return []
    if source == "Ollama":
        return _ollama_models(folder)
    if source == "Hugging Face":
        return _hub_models(folder)
    return _gguf_files(folder) + _hf_folders(folder)


def _hub_models(hub: Path) -> list[Found]:
    found = []
    for repo in sorted(hub.glob("models--*")):
        label = repo.name.removeprefix("models--").replace("--", "/")
        listed = list((repo / "snapshots").glob("*"))
        snapshots = [p for p in listed if p.is_dir()]
        if not snapshots:
            if listed:
                found.append((label, repo, f"its snapshot {listed[0].name} is {MISSING}"))
            continue
        snap = max(snapshots, key=_mtime)               # the newest revision only
        found += _gguf_files(snap, f"{label}/")
        if os.path.lexists(snap / "config.json") and any(snap.glob("*.safetensors")):
            found.append((label, snap, ""))
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _ollama_models(root: Path) -> list[Found]:
    found = []
    manifests = root / "manifests"
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()) if manifests.is_dir() else []:
        parts = manifest.relative_to(manifests).parts          # registry/namespace/model/tag
        if len(parts) < 3:
            name = "/".join(parts)
        else:
            name = f"{parts[-2] if parts[-3] == 'library' else '/'.join(parts[-3:-1])}:{parts[-1]}"
        try:
            found.append((name, _ollama_blob(root, manifest), ""))
        except ValueError as exc:
            found.append((name, manifest, f"its Ollama manifest {manifest} {exc}"))
    return found


def _ollama_blob(root: Path, manifest: Path) -> Path:
    """The GGUF blob a manifest names; else ValueError, its text what follows "its Ollama manifest <path>"."""
    try:
        data = json.loads(manifest.read_text())
    except RecursionError:
        raise ValueError("nests too deep to be a manifest") from None
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot be read ({exc})") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise ValueError("has no list of layers")
    for layer in layers:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            digest = layer.get("digest")
            if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                raise ValueError(f"names the model by {str(digest)[:80]!r}, not a sha256 digest")
            blob = root / "blobs" / digest.replace(":", "-")
            if not blob.is_file():
                raise ValueError(f"names the blob {blob.name}, which is missing")
            return blob
    raise ValueError("has no model layer")


def _folder_problem(path: Path) -> str:
    """Why a Hugging Face folder cannot be described from its files ("" when it can): a file missing or not a
    regular one (a link to nothing in a hub snapshot, a pipe), or a config.json that is no JSON object."""
    for f in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        try:
            st = f.stat()
        except OSError:
            return f"{f.name} is {MISSING}" if f.is_symlink() else f"{f.name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{f.name} is not a regular file"
    try:
        config = json.loads((path / "config.json").read_text())
    except RecursionError:
        return "config.json nests too deep to be a model's configuration"
    except (OSError, ValueError) as exc:
        return f"config.json cannot be read ({exc})"
    return "" if isinstance(config, dict) else "config.json is not a JSON object"


def planned_memory(memory_bytes: int, device: str = "cpu") -> DeviceMemory:
    """memory_bytes of `device` as a DeviceMemory: on a GPU the host's RAM is read beside it."""
    if device == "cpu":
        return DeviceMemory("cpu", memory_bytes, memory_bytes, True, "given")
    return DeviceMemory(device, memory_bytes, host_available_bytes(), packs_gguf(device), "given")


def describe(name: str, path: Path, source: str, memory_bytes: int = 0, device: str = "cpu",
             memory: DeviceMemory | None = None) -> ModelEntry:
    """One entry from headers alone; an unreadable or unsupported model gets its reason in `error`. memory: the
    device and its numbers to plan for (default: memory_bytes of `device`)."""
    from kvchat.engine.plan.estimate import estimate, model_facts_from
    memory = memory or planned_memory(memory_bytes, device)
    kind = _kind(path)
    problem = _folder_problem(path) if kind == "safetensors" else ""
    if problem:
        return ModelEntry(name, str(path), source, kind, error=problem)
    size = 0
    try:
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if kind == "safetensors" else \
            path.stat().st_size
        facts = model_facts_from(path, name)
        e = estimate(facts, 1, formats=FIT_FORMATS, memory_bytes=memory.free_bytes, memory_source="library",
                     device=memory.device, packed=memory.packs_gguf)
        fit = plan_fit(facts.config, facts.weight_bytes, "auto", memory, source=facts.source,
                       stored_dtype=facts.weights_label)
    except (ModelLoadError, ConfigError, OSError, ValueError, KeyError) as exc:
        return ModelEntry(name, str(path), source, kind, file_bytes=size, error=str(exc))
    fits = tuple((r.format, r.max_context) for r in e.rows)
    # the family's name ("gemma3"), which a GGUF and a folder (model_type gemma3_text) of one model share
    arch = family(facts.config.model_type, str(path)).name
    return ModelEntry(name, str(path), source, kind, arch, facts.parameters, facts.weights_label,
                      size, facts.config.max_position_embeddings, fits,
                      active_parameters=facts.active_parameters if e.experts else 0, verdict=fit.verdict,
                      device=memory.device)


def scan(folders: list[str | Path] = (), memory_bytes: int | None = None, device: str = "cpu",
         home: Path | None = None, memory: DeviceMemory | None = None) -> list[ModelEntry]:
    """Every model in the user's folders and the peers' places, each file once (the first place found). Each
    entry fails alone: one that cannot be read is listed with its reason, and the scan goes on. memory: what to
    plan for (fit.device_memory(): the GPU's numbers with the GPU's arithmetic); else memory_bytes of `device`,
    read from this machine where not given."""
    if memory is None:
        if memory_bytes is None:
            from kvchat.engine.plan.estimate import available_memory
            memory_bytes, _ = available_memory(device)
        memory = planned_memory(memory_bytes, device)
    places = [("Folder", Path(f).expanduser()) for f in folders] + peer_locations(home)
    seen, entries = set(), []
    for source, folder in places:
        try:
            found = find_models(folder, source)
        except OSError as exc:          # a folder that changed or vanished while it was searched
            entries.append(ModelEntry(folder.name, str(folder), source, "", error=f"{folder} could not be searched "
                                                                                  f"({exc.strerror or exc})"))
            continue
        for name, path, error in found:
            key = _identity(path)
            if key in seen:
                continue
            seen.add(key)
            entries.append(ModelEntry(name, str(path), source, _kind(path), error=error) if error else
                           _describe_alone(name, path, source, memory))
    return entries


def _describe_alone(name: str, path: Path, source: str, memory: DeviceMemory) -> ModelEntry:
    try:
        return describe(name, path, source, memory=memory)
    except RecursionError:
        why = "it nests too deep to be a model's header"
    except Exception as exc:  # noqa: BLE001 - another app's file can trip any header parser: it fails alone, listed
        why = f"its header cannot be read ({type(exc).__name__}: {exc})"
    return ModelEntry(name, str(path), source, _kind(path), error=why)


def _kind(path: Path) -> str:
    return "safetensors" if path.is_dir() else "gguf"


def _identity(path: Path):
    try:
        return path.resolve()
    except (OSError, RuntimeError):     # a link loop
        return path


def loadable_path(entry: ModelEntry, link_dir: Path | None = None) -> str:
    """A path the loader accepts: an Ollama blob (no .gguf suffix) gets a named .gguf link in the cache dir."""
    path = Path(entry.path)
    if entry.kind != "gguf" or path.suffix == ".gguf":
        return str(path)
    from kvchat.engine.paths import ollama_links_dir
    link_dir = link_dir or ollama_links_dir()
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
