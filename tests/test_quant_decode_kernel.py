"""The C decode attention over quantized KV pages (cpu_quant.attn_decode_quant) against the torch path.

Both dequantize the same codes, so they agree to float rounding: the kernel is checked inside a real
engine at every decode step (every format, windows and sinks, block boundaries, heads and tails, GQA),
and on random pages against its torch reference.
"""
import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig
from kvchat.engine.model.rope import rope_table
from kvchat.engine.runtime.backends import quant_pages
from kvchat.kernels import cpu_quant
from kvchat.kernels.formats import page_format
from kvchat.kernels.reference import store_blocks
from tiny_models import random_ids

pytestmark = pytest.mark.skipif(not cpu_quant.kv_kernels_ready(wait=True), reason="no C compiler for the CPU kernels")

PAIRS = [("int8", "int8", "channel"), ("int4", "int4", "channel"), ("fp8", "fp8", "channel"),
         ("int8", "int4", "channel"), ("int8", "int8", "token"), ("int4", "int4", "token"), ("fp8", "fp8", "token")]


@pytest.fixture(scope="module", params=[(4, 2, 64), (6, 2, 32)], ids=["gqa2-d64", "gqa3-d32"])
def engine(request, tmp_path_factory):
    from tiny_models import tiny_model_dir
    heads, kv_heads, head_dim = request.param
    folder = tiny_model_dir(tmp_path_factory.mktemp("tiny-qdecode"), hidden=32 * heads, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, layers=2, max_positions=512, seed=3)
    return Engine.load(EngineConfig(model=folder))


def _relative(got, ref):
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


class Spy:
    """Wraps the engine's quantized attention: at each one-token step, the kernel and the torch path on the
    same pages (both read before the step writes), then the real call."""

    def __init__(self, monkeypatch):
        self.errors, self.kernel_steps, self.torch_steps = [], 0, 0
        real = quant_pages.attend_quantized

        def spy(kc, vc, q, k, v, st, kernel, *more):
            if q.shape[0] == 1:
                if not kernel:
                    self.torch_steps += 1
                else:
                    self.kernel_steps += 1
                    ref = quant_pages.attend_torch(kc, vc, q, k, v, st)
                    got = quant_pages.decode_kernel(q, k, v, st, *quant_pages.kernel_pages(kc, vc, st))
                    self.errors.append(_relative(got, ref))
            return real(kc, vc, q, k, v, st, kernel, *more)

        monkeypatch.setattr(quant_pages, "attend_quantized", spy)


CASES = ([(*pair, 40, 4) for pair in PAIRS]                               # every format, a sliding window
         + [("int8", "int8", "channel", None, 4), ("int4", "int4", "channel", None, 4),   # no window
            ("int8", "int8", "channel", 36, 20), ("int4", "int4", "token", 36, 20)])      # sinks over 2 blocks


@pytest.mark.parametrize("k_format, v_format, scheme, window, sinks", CASES)
def test_kernel_matches_torch_path_at_every_decode_step(engine, monkeypatch, k_format, v_format, scheme,
                                                        window, sinks):
    """Prompt then one token at a time across block boundaries (block 16), the window sliding: the kernel
    takes every step and agrees with the torch path to 1e-4 of the largest output."""
    spy = Spy(monkeypatch)
    s = engine.new_session(cache=CacheConfig(k_format=k_format, v_format=v_format, k_scheme=scheme,
                                             window=window, sinks=sinks))
    ids = random_ids(engine, 64, seed=len(k_format) + sinks)
    s.append(ids[:13])
    for t in ids[13:]:
        s.append([t])
    layers = engine.model.config.num_layers
    assert spy.kernel_steps == 51 * layers and spy.torch_steps == 0
    assert max(spy.errors) < 1e-4, max(spy.errors)


def test_mixed_full_and_quantized_formats_fall_back_to_torch(engine, monkeypatch):
    spy = Spy(monkeypatch)
    s = engine.new_session(cache=CacheConfig(k_format="fp16", v_format="int8"))
    s.append(random_ids(engine, 20))
    s.append([5])
    assert spy.kernel_steps == 0 and spy.torch_steps == engine.model.config.num_layers


@pytest.mark.parametrize("k_format, v_format", [("int8", "int8"), ("int4", "int4")])
def test_decoded_logits_match_with_the_kernel_off(engine, monkeypatch, k_format, v_format):
    """End to end: the same decode logits with the kernel and with the torch path, to rounding carried over
    steps (a last-bit difference in a new key can round differently into the 16-bit tail): 1e-3 of the
    largest logit, and the same greedy token at every step."""
    cache = CacheConfig(k_format=k_format, v_format=v_format, window=48, sinks=4)
    ids = random_ids(engine, 80, seed=7)

    def run():
        s = engine.new_session(cache=cache)
        s.append(ids[:30])
        return torch.stack([s.append([t])[-1] for t in ids[30:]])

    with_kernel = run()
    monkeypatch.setattr(cpu_quant, "kv_kernels_ready", lambda *a, **k: False)    # the backend is chosen again
    without = run()
    assert _relative(with_kernel, without) < 1e-3, _relative(with_kernel, without)
    assert torch.equal(with_kernel.argmax(-1), without.argmax(-1))


def _pages(fmt, n_blocks, bs, hkv, d, gen):
    data = torch.zeros(n_blocks, *fmt.shapes(bs, hkv, d)["data"][0], dtype=fmt.data_dtype())
    scale = torch.zeros(n_blocks, *fmt.shapes(bs, hkv, d)["scale"][0], dtype=fmt.shapes(bs, hkv, d)["scale"][1])
    zero = None if fmt.symmetric else torch.zeros(n_blocks, *fmt.shapes(bs, hkv, d)["zero"][0], dtype=torch.float16)
    src = torch.randn(n_blocks, bs, hkv, d, generator=gen) * 2 + torch.randn(1, 1, hkv, d, generator=gen)
    store_blocks(src, torch.arange(n_blocks), data, scale, zero, fmt)
    return data, scale, zero


@pytest.mark.parametrize("fmt_name", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("full", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_head", [True, False])
@pytest.mark.parametrize("hq, hkv, d, n_full, tail_len, drop", [(8, 2, 64, 5, 7, 0), (3, 3, 32, 3, 0, 9),
                                                                 (6, 1, 128, 9, 15, 30), (4, 2, 64, 0, 5, 0),
                                                                 (10, 2, 40, 4, 3, 5), (8, 2, 512, 3, 4, 0)])
def test_kernel_matches_its_reference_on_random_pages(fmt_name, full, with_head, hq, hkv, d, n_full, tail_len, drop):
    """Random pages in a shuffled block table, a head block or none, a tail, some slots left out (a window);
    1 to 6 query heads per kv head (the vector path takes 4 at a time), head_dim 40 on the scalar path, 512 (Gemma 4's
    global layers) at the widest."""
    if d % 32 and fmt_name == "int4":
        pytest.skip("int4 values come in groups of 32 channels")
    gen = torch.Generator().manual_seed(hq * d + n_full)
    bs = 16
    kf, vf = page_format(fmt_name, "k"), page_format(fmt_name, "v")
    n_blocks = n_full + 3
    table = torch.randperm(n_blocks, generator=gen)[:n_full + 1]
    kp, vp = [], []
    for fmt in (kf, vf):
        data, scale, zero = _pages(fmt, n_blocks, bs, hkv, d, gen)
        head = torch.randn(bs, hkv, d, generator=gen).to(full) if with_head else None
        tail = torch.randn(bs, hkv, d, generator=gen).to(full)
        (kp if fmt is kf else vp).append(cpu_quant.QuantPages(fmt, data, scale, zero, head, tail))
    seq_len = n_full * bs + tail_len
    slots = torch.cat((torch.arange(min(4, seq_len)), torch.arange(min(4 + drop, seq_len), seq_len)))
    cos_h, sin_h = rope_table(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 5000)
    pos = torch.cat((slots + 3000, torch.tensor([3000 + seq_len + drop])))
    q = torch.randn(hq, d, generator=gen)
    k_new, v_new = torch.randn(hkv, d, generator=gen), torch.randn(hkv, d, generator=gen)
    args = (q, k_new, v_new, kp[0], vp[0], slots, table, n_full, bs, cos_h, sin_h, pos, d ** -0.5)
    got, ref = cpu_quant.attn_decode_quant(*args), cpu_quant.attn_decode_quant_ref(*args)
    assert _relative(got, ref) < 1e-5
