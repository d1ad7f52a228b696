"""GGUF files read in place: every supported type kept packed, exact against gguf's dequantize, bad files refused."""
import numpy as np
import pytest
import torch

from kvchat.engine import Engine, EngineConfig, ModelLoadError
from kvchat.engine.model.linears import ROWS_IN_C, _Packed
from kvchat.engine.model.gguf_view import GGUFModel
from kvchat.bench.gguf_writer import write_random_gguf
from kvchat.engine.plan.fit import check_fits
from kvchat.engine.model.config import ModelConfig

from kvchat.engine.config import CacheConfig as _CacheConfig

FP32_CACHE = _CacheConfig(k_format="fp32", v_format="fp32")   # exact comparisons need the 32-bit cache

TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q4_K_M", "Q5_0", "Q5_1", "Q6_K", "Q8_0", "F16", "BF16")
# what each type is held as: 4-bit grids as q4, 5-8 bit grids as q8 codes with the file's scales, 16-bit as is
HELD = {"Q4_0": {"q4", "q8"}, "Q4_1": {"q4", "q8"}, "Q4_K": {"q4"}, "Q4_K_M": {"q4", "q6", "q8"}, "Q5_0": {"q5", "q8"},
        "Q5_1": {"q5", "q8"}, "Q6_K": {"q6"}, "Q8_0": {"q8"}, "F16": {"fp16"}, "BF16": {"bf16"}}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {t: str(write_random_gguf(folder / f"tiny-{t}.gguf", "tiny", t, seed=3)) for t in TYPES}


def _linears(model):
    return [("head", model.lm_head)] + [(f"{i}.{n}", getattr(L, n)) for i, L in enumerate(model.layers)
                                        for n in ("qkv", "o", "gate_up", "down")]


@pytest.mark.parametrize("kind", TYPES)
def test_packed_weights_equal_gguf_dequantize(tiny_ggufs, kind):
    """Each packed linear dequantizes to exactly what gguf's dequantize gives (codes never re-rounded)."""
    packed = Engine.load(EngineConfig(model=tiny_ggufs[kind]))
    dense = Engine.load(EngineConfig(model=tiny_ggufs[kind], weights="dense"))
    kinds = {k for name in packed.model.linear_kinds() for k in name.split("+")}    # "q4+q8": q|k in Q4_K, v in Q6_K
    assert packed.model.weights == "gguf" and kinds <= HELD[kind] | {"q8"} and kinds & HELD[kind]
    for (name, a), (_, b) in zip(_linears(packed.model), _linears(dense.model)):
        wa, wb = a.dequantize(), b.dequantize()
        assert torch.allclose(wa, wb, rtol=1e-6, atol=1e-7), (kind, name, (wa - wb).abs().max().item())


@pytest.mark.parametrize("kind", TYPES)
def test_embedding_rows_in_c_are_the_references_bits(tiny_ggufs, kind):
    """A decode step's embedding lookup (a few ids: the C dequantizer row by row) gives the torch reference's bits,
    for every packed kind the file holds, the first and the last row among them."""
    model = Engine.load(EngineConfig(model=tiny_ggufs[kind])).model
    tables = [lin for _, lin in _linears(model) if isinstance(lin, _Packed)] + \
        ([model.table] if isinstance(model.table, _Packed) else [])
    if kind in ("F16", "BF16"):
        assert not tables
        return
    assert tables
    for lin in tables:
        n = lin.out_features
        for ids in ([0], [n - 1], [5, n - 1, 5], list(range(ROWS_IN_C))):
            t = torch.tensor(ids)
            got, ref = lin.rows(t), lin._rows_ref(t)
            assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape == (len(ids), lin.in_features)
            assert torch.equal(got, ref), (kind, type(lin).__name__, ids)


@pytest.mark.parametrize("kind", TYPES)
def test_packed_logits_track_dense(tiny_ggufs, kind):
    """Decode steps (C kernels, int16 activations) and prefill (dequantized slabs, the fp32 GEMM: a CPU with AMX
    would take bf16 by default) track the dense fp32 forward."""
    packed = Engine.load(EngineConfig(model=tiny_ggufs[kind], prefill="fp32"))
    dense = Engine.load(EngineConfig(model=tiny_ggufs[kind], weights="dense"))
    ids = torch.randint(3, 49152, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    # bf16 weights multiply bf16 activations (8-bit mantissas); every other kind keeps activations at >= 11 bits
    rel = 1e-2 if kind == "BF16" else 2e-3
    prefill, ref = packed.new_session(cache=FP32_CACHE).append(ids), dense.new_session(cache=FP32_CACHE).append(ids)
    assert (prefill - ref).abs().max().item() <= rel * ref.abs().max().item()
    sp, sd = packed.new_session(cache=FP32_CACHE), dense.new_session(cache=FP32_CACHE)
    for t in ids:
        lp, ld = sp.append([t])[-1], sd.append([t])[-1]
        assert (lp - ld).abs().max().item() <= rel * ld.abs().max().item()


# 5- and 6-bit codes are held at their own bits (Q5_0 / Q5_1: the file's bytes); the tiny Q4_K_M is mostly its
# Q6_K embedding table, where a real 1B Q4_K_M holds 1.1x its file
RESIDENT_BOUND = {"Q5_0": 1.02, "Q5_1": 1.02, "Q6_K": 1.05, "Q4_K_M": 1.35}


@pytest.mark.parametrize("kind", TYPES)
def test_resident_bytes_close_to_file(tiny_ggufs, kind):
    """Resident weight bytes stay within 1.3x the file's tensor bytes (no dense copy anywhere)."""
    packed = Engine.load(EngineConfig(model=tiny_ggufs[kind]))
    file_bytes = GGUFModel(tiny_ggufs[kind]).tensor_bytes
    bound = RESIDENT_BOUND.get(kind, 1.3)
    assert packed.model.weight_bytes() <= bound * file_bytes, (packed.model.weight_bytes(), file_bytes)


def test_gguf_matches_transformers(tiny_ggufs):
    """Our dense read of a GGUF (names, q/k row order, tied head) matches transformers' own GGUF loader."""
    from kvchat.engine.runtime.engine import load_transformers_reference
    path = tiny_ggufs["Q8_0"]
    ref = load_transformers_reference(path)
    ids = list(range(100, 140))
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    ours = Engine.load(EngineConfig(model=path, weights="dense")).new_session(cache=FP32_CACHE).append(ids)
    assert (ours - theirs).abs().max().item() <= 1e-3


def test_truncated_and_foreign_gguf_refused(tiny_ggufs, tmp_path):
    """A GGUF cut short, or of an architecture outside the Llama family, is refused with a clear message."""
    data = open(tiny_ggufs["Q4_0"], "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="past the end|not a readable GGUF"):
        Engine.load(EngineConfig(model=str(cut)))
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(_with_arch(data, b"falcon"))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'falcon'"):
        Engine.load(EngineConfig(model=str(foreign)))


def _with_arch(data: bytes, arch: bytes) -> bytes:
    # general.architecture is a length-prefixed string: rewrite the length and the bytes
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4                   # past the key and the value type
    old_len = int.from_bytes(data[at:at + 8], "little")
    return data[:at] + len(arch).to_bytes(8, "little") + arch + data[at + 8 + old_len:]


def test_model_too_big_refused_before_loading():
    """A model whose weights cannot fit in this machine's memory is refused with the numbers, before any read."""
    big = ModelConfig("llama", 128256, 8192, 80, 64, 8, 128, 28672, 1e-5, 500000.0, (), 8192, False, False, False,
                      False)
    with pytest.raises(ModelLoadError, match=r"needs about \d+\.\d GiB .* GiB is free"):
        check_fits(big, 40 * 2**30, "dense", "cpu", "llama-70b.gguf")


def test_gguf_metadata_read_without_gguf_reader(tiny_ggufs):
    """Our header reader gives the architecture numbers (and skips the vocabulary) quickly."""
    gf = GGUFModel(tiny_ggufs["Q4_K_M"])
    cfg = gf.hf_config()
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) \
        == (2, 256, 4, 2)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"]
    assert gf.type_name("blk.0.attn_q.weight") == "Q4_K" and np.asarray(gf.tensors["output_norm.weight"].data).dtype == np.float32


def test_weight_fidelity_bench_on_requantized_file(tiny_ggufs, tmp_path):
    """bench quality --weight-fidelity: a file requantized by gguf into Q4_0 keeps its metadata, and packed
    decode agrees with dense fp32 on it."""
    from kvchat.bench.weights import fidelity, requantize_gguf
    out = requantize_gguf(GGUFModel(tiny_ggufs["Q8_0"]).path, tmp_path / "q4.gguf", "Q4_0")
    gf = GGUFModel(out)
    assert gf.type_name("blk.0.attn_q.weight") == "Q4_0" and gf.hf_config()["num_hidden_layers"] == 2
    r = fidelity(str(out), list(range(200, 232)))
    assert r["top1_agreement"] >= 0.95 and r["mean_kl"] <= 1e-3 and r["kinds"].get("q4")
