"""The model library finds models where LM Studio, Jan, the Hugging Face cache and Ollama keep them."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from kvchat.engine.plan.estimate import model_facts_from, parameter_count
from kvchat.engine.kv.layout import kv_layout
from kvchat.engine.plan.estimate import cache_for, largest_context, margin_for
from kvchat.engine.plan.library import FIT_FORMATS, loadable_path, peer_locations, scan

GIB = 2**30


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from kvchat.bench.gguf_writer import write_random_gguf
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf", "tiny", "Q8_0")


@pytest.fixture()
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: home))
    monkeypatch.setenv("HOME", str(home))
    for var in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    return home


def _place(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.link(src, dst) if src.stat().st_dev == dst.parent.stat().st_dev else shutil.copy(src, dst)
    return dst


def _hf_cache_repo(hub: Path, repo: str, folder: Path, revision: str = "0123abcd") -> Path:
    """A hub cache entry as huggingface_hub lays it out: blobs by hash, snapshot files linking to them."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    for f in folder.iterdir():
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        if not blob.exists():
            shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def _ollama(root: Path, gguf: Path, model: str, tag: str, namespace: str = "library") -> Path:
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    blob = _place(gguf, root / "blobs" / f"sha256-{digest}")
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / model / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": OLLAMA_TEMPLATE, "digest": "sha256:" + "0" * 64, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": gguf.stat().st_size},
    ]}))
    return blob


OLLAMA_TEMPLATE = "application/vnd.ollama.image.template"


def test_finds_models_in_every_peer_layout(home, tiny_gguf, tiny_llama, tmp_path):
    lm = _place(tiny_gguf, home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF" / "tiny-Q8_0.gguf")
    _place(tiny_gguf, home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF" / "mmproj-tiny-f16.gguf")
    jan = _place(tiny_gguf, home / ".local" / "share" / "Jan" / "data" / "llamacpp" / "models" / "tiny" / "model.gguf")
    old_jan = _place(tiny_gguf, home / "jan" / "models" / "tiny-q8" / "tiny.Q8_0.gguf")
    snap = _hf_cache_repo(home / ".cache" / "huggingface" / "hub", "someone/tiny-llama", Path(tiny_llama))
    blob = _ollama(home / ".ollama" / "models", tiny_gguf, "tiny", "latest")
    own = _place(tiny_gguf, tmp_path / "my-models" / "nested" / "mine.gguf")

    entries = scan([tmp_path / "my-models"], memory_bytes=8 * GIB)
    by_source = {}
    for e in entries:
        by_source.setdefault(e.source, []).append(e)
    assert sorted(by_source) == ["Folder", "Hugging Face", "Jan", "LM Studio", "Ollama"]
    assert [e.path for e in by_source["Folder"]] == [str(own)]
    assert [e.path for e in by_source["LM Studio"]] == [str(lm)]            # the vision projector is skipped
    assert sorted(e.path for e in by_source["Jan"]) == sorted([str(jan), str(old_jan)])
    assert [(e.name, e.path) for e in by_source["Hugging Face"]] == [("someone/tiny-llama", str(snap))]
    assert [(e.name, e.path) for e in by_source["Ollama"]] == [("tiny:latest", str(blob))]

    gguf = by_source["Ollama"][0]
    facts = model_facts_from(tiny_gguf)
    assert (gguf.kind, gguf.architecture, gguf.quantization, gguf.trained_context) == ("gguf", "llama", "Q8_0", 2048)
    assert gguf.parameters == facts.parameters == parameter_count(facts.config)
    assert gguf.file_bytes == tiny_gguf.stat().st_size
    hf = by_source["Hugging Face"][0]
    assert (hf.kind, hf.architecture, hf.quantization, hf.trained_context) == ("safetensors", "llama", "f32", 4096)
    assert hf.file_bytes == sum(f.stat().st_size for f in Path(tiny_llama).glob("*.safetensors"))


def test_fits_is_the_context_each_format_allows_beside_the_weights(home, tiny_gguf, tmp_path):
    _place(tiny_gguf, tmp_path / "m" / "tiny.gguf")
    memory = GIB
    (entry,) = scan([tmp_path / "m"], memory_bytes=memory)
    facts = model_facts_from(tiny_gguf)
    room = memory - facts.weight_bytes - margin_for(memory)
    assert [f for f, _ in entry.fits] == list(FIT_FORMATS)
    for fmt, tokens in entry.fits:
        layout = kv_layout(facts.config, cache_for(fmt), "fp32", "cpu")
        assert tokens == largest_context(layout, room)
    fits = dict(entry.fits)
    assert fits["int4"] > fits["int8"] > fits["fp16"] > 0
    (starved,) = scan([tmp_path / "m"], memory_bytes=facts.weight_bytes)
    assert all(tokens == 0 for _, tokens in starved.fits)


def test_env_overrides_move_hf_and_ollama_places(home, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    places = dict((str(p), s) for s, p in peer_locations())
    assert places[str(tmp_path / "hfhome" / "hub")] == "Hugging Face"
    assert places[str(tmp_path / "ollama")] == "Ollama"
    assert str(home / ".ollama" / "models") not in places


def test_bad_files_are_listed_with_the_reason(home, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    (folder / "notgguf.gguf").write_bytes(b"hello")
    other = folder / "gemma"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gemma3", "hidden_size": 8}))
    (other / "model.safetensors").write_bytes(b"\0" * 16)
    entries = {e.name: e for e in scan([folder], memory_bytes=GIB)}
    assert set(entries) == {"broken", "notgguf", "gemma"}
    assert not any(e.loadable for e in entries.values())
    assert "not a readable GGUF" in entries["notgguf"].error
    assert "unsupported architecture 'gemma3'" in entries["gemma"].error


def test_ollama_blob_loads_through_a_named_link(home, tiny_gguf, tmp_path):
    from kvchat.engine.runtime.engine import read_model_config
    _ollama(home / ".ollama" / "models", tiny_gguf, "tiny", "q8", namespace="someone")
    (entry,) = [e for e in scan(memory_bytes=GIB) if e.source == "Ollama"]
    assert entry.name == "someone/tiny:q8"
    path = loadable_path(entry, tmp_path / "links")
    assert path.endswith("someone_tiny-q8.gguf") and Path(path).resolve() == Path(entry.path).resolve()
    assert read_model_config(path).num_layers == 2
    assert loadable_path(entry, tmp_path / "links") == path            # idempotent
