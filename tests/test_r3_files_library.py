"""One odd entry in another app's model folder (issue 37, item 16): each fails alone and is listed with its reason,
and the scan goes on to list every good model beside it (an exception out of the scan empties the Models page)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.engine.plan.library import OLLAMA_MODEL_LAYER, scan
from test_library import GIB, _hf_cache_repo, _ollama, _place, home, tiny_gguf  # noqa: F401

DEEP = "[" * 100_000 + "]" * 100_000


def _manifest(home: Path, body: str | bytes, model: str = "odd") -> None:
    path = home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / model / "latest"
    path.parent.mkdir(parents=True)
    path.write_bytes(body if isinstance(body, bytes) else body.encode())


def _model_layer(digest) -> str:
    return json.dumps({"layers": [{"mediaType": OLLAMA_MODEL_LAYER, "digest": digest}]})


def _hub_snapshot(home: Path, repo: str = "odd/repo") -> Path:
    snap = home / ".cache" / "huggingface" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    return snap


def _folder_model(home: Path, config: str) -> None:
    folder = home / ".lmstudio" / "models" / "odd" / "folder-model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(b"\0" * 16)


def _dangling(link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to("../../blobs/" + "f" * 64)


def _hub_links_to_nothing(home: Path) -> None:
    """A snapshot whose files link to blobs that are not there (a download that stopped)."""
    snap = _hub_snapshot(home)
    for name in ("config.json", "model.safetensors"):
        _dangling(snap / name)


ODD = {   # layout -> (make it under home, the name its entry takes, words of its reason)
    "ollama layer not an object": (lambda h: _manifest(h, json.dumps({"layers": ["model", 5, None]})),
                                   "odd:latest", "has no model layer"),
    "ollama layers not a list": (lambda h: _manifest(h, json.dumps({"layers": 5})), "odd:latest",
                                 "has no list of layers"),
    "ollama manifest a list": (lambda h: _manifest(h, "[1, 2]"), "odd:latest", "has no list of layers"),
    "ollama manifest 100,000 deep": (lambda h: _manifest(h, DEEP), "odd:latest", "nests too deep"),
    "ollama manifest not text": (lambda h: _manifest(h, b"\xff\xfe\x00{"), "odd:latest", "cannot be read"),
    "ollama blob missing": (lambda h: _manifest(h, _model_layer("sha256:" + "a" * 64)), "odd:latest", "missing"),
    "ollama digest a path": (lambda h: _manifest(h, _model_layer("sha256:../../../etc/passwd")), "odd:latest",
                             "not a sha256 digest"),
    "ollama digest a number": (lambda h: _manifest(h, _model_layer(5)), "odd:latest", "not a sha256 digest"),
    "ollama manifest outside a registry": (lambda h: (h / ".ollama/models/manifests/stray").write_text("{}"), "stray",
                                           "has no list of layers"),
    "hub snapshot config a dangling link": (_hub_links_to_nothing, "odd/repo",
                                            "config.json is a link to a file that is not there"),
    "hub snapshot gguf a dangling link": (lambda h: _dangling(_hub_snapshot(h) / "odd-Q4_K_M.gguf"),
                                          "odd/repo/odd-Q4_K_M", "not there"),
    "hub snapshot itself a dangling link": (
        lambda h: _dangling(h / ".cache/huggingface/hub/models--odd--repo/snapshots/0123abcd"), "odd/repo",
        "its snapshot 0123abcd is a link to a file that is not there"),
    "config.json a list": (lambda h: _folder_model(h, "[1, 2]"), "folder-model", "not a JSON object"),
    "config.json 100,000 deep": (lambda h: _folder_model(h, DEEP), "folder-model", "nests too deep"),
    "lm studio gguf a dangling link": (lambda h: _dangling(h / ".lmstudio/models/odd/odd/odd-Q8_0.gguf"),
                                       "odd-Q8_0", "not there"),
}


@pytest.fixture
def good(home, tiny_gguf, tiny_llama):
    """A good model in each peer's place: LM Studio, Jan, the hub cache, Ollama. (name, path) of each."""
    lm = _place(tiny_gguf, home / ".lmstudio" / "models" / "pub" / "Tiny-GGUF" / "tiny-Q8_0.gguf")
    jan = _place(tiny_gguf, home / "jan" / "models" / "tiny-q8" / "tiny.Q8_0.gguf")
    snap = _hf_cache_repo(home / ".cache" / "huggingface" / "hub", "someone/tiny-llama", Path(tiny_llama))
    blob = _ollama(home / ".ollama" / "models", tiny_gguf, "tiny", "latest")
    return {("tiny-Q8_0", str(lm)), ("tiny.Q8_0", str(jan)), ("someone/tiny-llama", str(snap)),
            ("tiny:latest", str(blob))}


@pytest.mark.parametrize("layout", list(ODD))
def test_an_odd_entry_fails_alone_and_is_listed_with_its_reason(home, good, layout):
    make, name, reason = ODD[layout]
    make(home)
    entries = scan(memory_bytes=GIB)
    assert {(e.name, e.path) for e in entries if e.loadable} == good
    [bad] = [e for e in entries if not e.loadable]
    assert bad.name == name and reason in bad.error, bad


def test_every_odd_entry_at_once_leaves_the_good_ones_listed(home, good):
    """All the layouts above that do not share a path, in one scan: one error entry each."""
    for layout in ("ollama layers not a list", "hub snapshot gguf a dangling link", "config.json 100,000 deep",
                   "lm studio gguf a dangling link"):
        ODD[layout][0](home)
    entries = scan(memory_bytes=GIB)
    assert {(e.name, e.path) for e in entries if e.loadable} == good
    assert sorted(e.name for e in entries if not e.loadable) == ["folder-model", "odd-Q8_0", "odd/repo/odd-Q4_K_M",
                                                                 "odd:latest"]
