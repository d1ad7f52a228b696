"""engine/gguf/ is a container for any architecture: it reads a file kvchat does not run, and knows no model;
the model's view (engine/model/gguf_view.py) is what refuses such a file, with the message users have always had."""
import subprocess
import sys

import numpy as np
import pytest

from kvchat.bench.gguf_writer import write_random_gguf
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.gguf_view import GGUFModel


def _with_arch(data: bytes, arch: bytes) -> bytes:
    # general.architecture is a length-prefixed string: rewrite the length and the bytes
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4
    old_len = int.from_bytes(data[at:at + 8], "little")
    return data[:at] + len(arch).to_bytes(8, "little") + arch + data[at + 8 + old_len:]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "tiny", "Q8_0", seed=3)


@pytest.fixture
def foreign(tiny, tmp_path):
    """The tiny Q8_0 model relabelled as an architecture outside the registry (its keys keep the llama prefix)."""
    path = tmp_path / "rwkv.gguf"
    path.write_bytes(_with_arch(tiny.read_bytes(), b"rwkv6"))
    return path


def test_container_reads_an_architecture_kvchat_does_not_run(foreign, tiny):
    """Header, metadata, tensor infos and data of an unknown architecture read as the same file's under llama."""
    gf, same = GGUFFile(foreign), GGUFFile(tiny)
    assert gf.arch == "rwkv6" and same.arch == "llama"
    assert gf.field("llama.block_count") == 2 and len(gf.array("tokenizer.ggml.tokens")) == 49152
    assert {n: (t.type_name, t.shape) for n, t in gf.tensors.items()} == \
        {n: (t.type_name, t.shape) for n, t in same.tensors.items()}
    assert gf.tensor_bytes == same.tensor_bytes and gf.quant_summary() == same.quant_summary()
    assert np.array_equal(gf.dequantize("blk.0.attn_q.weight"), same.dequantize("blk.0.attn_q.weight"))
    assert not hasattr(gf, "family") and not hasattr(gf, "hf_config")


def test_the_model_view_refuses_it_with_the_old_message(foreign):
    """GGUFModel, and ModelConfig.from_gguf given the bare container, refuse it naming the architecture, the file
    and the families kvchat runs."""
    from kvchat.engine.model.families import supported
    expected = f"unsupported architecture 'rwkv6' in rwkv.gguf: kvchat runs the Llama family ({supported()})"
    for read in (GGUFModel, lambda p: ModelConfig.from_gguf(GGUFFile(p))):
        with pytest.raises(ModelLoadError) as info:
            read(foreign)
        assert str(info.value) == expected


def test_the_view_maps_hugging_face_names_and_the_container_does_not(tiny):
    """The view reads model.layers.0.self_attn.q_proj.weight as blk.0.attn_q.weight; the container speaks only
    the file's names, and says which one it lacks."""
    view, gf = GGUFModel(tiny), GGUFFile(tiny)
    assert view.gguf_name("model.layers.0.self_attn.q_proj.weight") == "blk.0.attn_q.weight"
    assert np.array_equal(view.raw("model.layers.0.self_attn.q_proj.weight")[1], gf.raw("blk.0.attn_q.weight")[1])
    assert GGUFModel.of(gf).family.name == "llama" and GGUFModel.of(view) is view
    with pytest.raises(ModelLoadError, match="lacks tensor model.layers.0.self_attn.q_proj.weight: "):
        gf.raw("model.layers.0.self_attn.q_proj.weight")


def test_gguf_package_imports_nothing_of_the_model():
    """Importing every module of engine/gguf/ loads no module of engine/model/ (the two no longer import each
    other)."""
    code = ("import sys; import kvchat.engine.gguf.file, kvchat.engine.gguf.blocks, kvchat.engine.gguf.tokenizer, "
            "kvchat.engine.gguf.spm; print(sorted(m for m in sys.modules if m.startswith('kvchat.engine.model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
