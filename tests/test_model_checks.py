"""Model configs checked on load, against the weights; no code from a model folder ever runs; only
safetensors and GGUF load; a failed GGUF load leaves no temporary folder."""
from __future__ import annotations

import json
import shutil
import struct
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvchat.engine import Engine, EngineConfig, ModelLoadError, SamplingParams
from kvchat.bench.gguf_writer import preset, write_random_gguf
from kvchat.engine.model.source import locate, transformers_reference
from kvchat.engine.text.tokenizer_cache import load_tokenizer
EVIL = """
from pathlib import Path
Path(__file__).with_name("RAN").write_text("code from the model folder ran")
raise SystemExit("custom code imported")
"""


@pytest.fixture
def folder(tiny_llama, tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_llama, copy)
    return copy


def edit_config(folder: Path, change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(change(config)))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    # the default tokenizer cut to its first 2,048 tokens (merges among them): transformers' GGUF loaders parse the
    # whole file once for the tokenizer, the config and the weights, about 3 s each with all 49,152 tokens; what
    # these tests check (metadata against tensors, no code run, nothing left behind) is the same for any vocabulary
    shape = replace(preset("tiny"), vocab=2048)
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", shape, "Q8_0", seed=1)


def patch_gguf_uint32(src: Path, dst: Path, key: str, value: int) -> None:
    """Copy a GGUF with one uint32 metadata value changed in place."""
    data = bytearray(src.read_bytes())
    raw = key.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
    assert struct.unpack_from("<I", data, at)[0] == 4          # GGUF value type UINT32
    struct.pack_into("<I", data, at + 4, value)
    dst.write_bytes(bytes(data))


# ---- config.json --------------------------------------------------------------------------------

def test_config_that_is_a_json_list_is_one_line(folder):
    """config.json holding a list: a one-line ModelLoadError, not an AttributeError."""
    (folder / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ModelLoadError, match="JSON list, not an object") as info:
        Engine.load(EngineConfig(model=str(folder)))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("key", ["num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size",
                                 "intermediate_size"])
def test_config_missing_a_key_names_it(folder, key):
    """A config.json without a required field names that field."""
    edit_config(folder, lambda c: {k: v for k, v in c.items() if k != key})
    with pytest.raises(ModelLoadError, match=f"lacks '{key}'"):
        Engine.load(EngineConfig(model=str(folder)))


def test_config_with_a_mistyped_value_names_it(folder):
    edit_config(folder, lambda c: {**c, "num_key_value_heads": "two"})
    with pytest.raises(ModelLoadError, match="num_key_value_heads='two'.*positive whole number"):
        Engine.load(EngineConfig(model=str(folder)))


@pytest.mark.parametrize("key, value, found", [("num_hidden_layers", 5, "3 layers"),
                                               ("num_hidden_layers", 2, "3 layers"),
                                               ("num_key_value_heads", 3, "2 heads"),
                                               ("num_key_value_heads", 1, "2 heads")])
def test_config_that_disagrees_with_the_safetensors_is_refused(folder, key, value, found):
    """Layer or KV-head counts that differ from the weights' shapes: the field and both numbers, before any run."""
    edit_config(folder, lambda c: {**c, key: value})
    with pytest.raises(ModelLoadError, match=f"{key}={value} in config.json, but the weights hold {found}"):
        Engine.load(EngineConfig(model=str(folder)))


@pytest.mark.parametrize("key, value, found", [("llama.block_count", 3, "2 layers"),
                                               ("llama.attention.head_count_kv", 4, "2 heads")])
def test_gguf_metadata_that_disagrees_with_its_tensors_is_refused(tiny_gguf, tmp_path, key, value, found):
    bad = tmp_path / "bad.gguf"
    patch_gguf_uint32(tiny_gguf, bad, key, value)
    with pytest.raises(ModelLoadError, match=f"{key}={value} in bad.gguf, but the weights hold {found}"):
        Engine.load(EngineConfig(model=str(bad)))


# ---- no code from the folder -------------------------------------------------------------------------

def plant_auto_map(folder: Path) -> None:
    (folder / "evil.py").write_text(EVIL)
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                "AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        config = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**config, "auto_map": auto_map}))


def test_auto_map_in_a_safetensors_folder_never_runs(folder, tiny_engine, monkeypatch):
    """A folder whose config and tokenizer_config point auto_map at a .py file loads without running or asking,
    and answers as the same folder without the auto_map does (the same weights and tokenizer, greedy)."""
    plant_auto_map(folder)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked to run custom code"))
    engine = Engine.load(EngineConfig(model=str(folder)))
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    done = list(engine.new_session().send("Hello", greedy))[-1]
    assert done.finish_reason == "length" and done.text == tiny_engine.new_session().reply("Hello", greedy) != ""
    load_tokenizer(folder)
    transformers_reference(locate(str(folder)), dtype=None)
    assert not (folder / "RAN").exists()


def test_auto_map_beside_a_gguf_never_runs(tiny_gguf, tmp_path, monkeypatch):
    """The same beside a .gguf, through transformers' own GGUF tokenizer and model loaders."""
    folder = tmp_path / "gguf-folder"
    folder.mkdir()
    shutil.copy(tiny_gguf, folder / "tiny.gguf")
    plant_auto_map(folder)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked to run custom code"))
    from kvchat.engine.text.tokenizer_cache import _auto_gguf_tokenizer, gguf_tokenizer
    ids = gguf_tokenizer(folder / "tiny.gguf").encode("Hello world", add_special_tokens=False)
    # the fallback for other transformers layouts reads the same vocabulary
    assert _auto_gguf_tokenizer(folder / "tiny.gguf").encode("Hello world", add_special_tokens=False) == ids != []
    transformers_reference(locate(str(folder / "tiny.gguf")), dtype=None)
    assert not (folder / "RAN").exists()


# ---- only safetensors and GGUF; nothing left behind ------------------------------------------------------

def test_pytorch_bin_folder_is_refused(folder):
    """A folder with only pytorch_model.bin (pickle) is refused with a reason, before anything is unpickled."""
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="pickle weights.*convert them to .safetensors"):
        Engine.load(EngineConfig(model=str(folder)))


def test_failed_gguf_load_leaves_no_temporary_folder(tiny_gguf, tmp_path, monkeypatch):
    """A GGUF whose tokenizer cannot be saved, or whose metadata is wrong, leaves no folder in the cache or TMPDIR."""
    from kvchat.engine.text.tokenizer_cache import gguf_tokenizer_dir
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    gguf = tmp_path / "fresh.gguf"          # a path of its own: no tokenizer cached for it yet
    shutil.copy(tiny_gguf, gguf)
    cached = gguf_tokenizer_dir(gguf)

    def traces() -> list[Path]:
        return sorted(cached.parent.glob(cached.name + "*")) + sorted(tmp.iterdir())

    def broken_save(self, *args, **kwargs):
        Path(args[0]).mkdir(parents=True, exist_ok=True)
        (Path(args[0]) / "tokenizer.json").write_text("{half")
        raise OSError("disk full")

    from transformers import PreTrainedTokenizerFast
    with monkeypatch.context() as m:          # both writers: engine/gguf/tokenizer.py's, and transformers' fallback
        m.setattr(PreTrainedTokenizerFast, "save_pretrained", broken_save)
        m.setattr("kvchat.engine.gguf.tokenizer.write_folder", lambda gguf, folder: broken_save(None, folder))
        with pytest.raises(OSError, match="disk full"):
            Engine.load(EngineConfig(model=str(gguf)))
    assert traces() == []
    bad = tmp_path / "bad.gguf"
    patch_gguf_uint32(tiny_gguf, bad, "llama.block_count", 3)
    with pytest.raises(ModelLoadError):
        Engine.load(EngineConfig(model=str(bad)))
    assert list(tmp.iterdir()) == []
    assert sorted(p.name for p in cached.parent.glob("bad-*") if ".tmp" in p.name) == []
