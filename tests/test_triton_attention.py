"""The Triton paged decode attention against its torch reference: GQA, several sequences of different lengths over
shuffled pages, sinks turned by their delta, keys stored before RoPE turned per row, soft-caps, 16-bit pages, a
head dim whose half is not a power of two. Without a GPU it runs under triton's interpreter (conftest)."""
import pytest
import torch

pytest.importorskip("triton")

from kvchat.engine.model.rope import rope_cos_sin  # noqa: E402
from kvchat.kernels import reference  # noqa: E402
from kvchat.kernels.formats import page_format  # noqa: E402
from kvchat.kernels.triton_attention import QuantPages, decode_attention, decode_attention_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(lengths, hkv=2, hq=6, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = sum(lengths) + 40
    k = torch.randn(R, hkv, d, generator=g).to(dtype)
    v = torch.randn(R, hkv, d, generator=g).to(dtype)
    rows = torch.randperm(R, generator=g)[:sum(lengths)]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    q = torch.randn(len(lengths), hq, d, generator=g)
    return q, k, v, rows, offsets


def _to(a):
    if isinstance(a, QuantPages):
        return QuantPages(a.data.to(DEVICE), a.scale.to(DEVICE), None if a.zero is None else a.zero.to(DEVICE), a.fmt)
    return a.to(DEVICE) if isinstance(a, torch.Tensor) else a


def _same(args, **kw):
    want = decode_attention_ref(*args, **kw)
    got = decode_attention(*map(_to, args), **{k: _to(v) for k, v in kw.items()}).cpu()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    return got


@pytest.mark.parametrize("lengths", [[1], [5], [70], [3, 130, 64]])
def test_plain_rotated_pages(lengths):
    q, k, v, rows, offsets = _case(lengths)
    _same((q, k, v, rows, offsets, lengths, 0.25))


def test_sixteen_bit_pages_and_one_kv_head_for_all():
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, rows, offsets = _case([33, 9], hkv=1, hq=4, dtype=dtype, seed=1)
        _same((q, k, v, rows, offsets, [33, 9], 0.25))


def test_sinks_turned_by_each_sequences_delta():
    lengths = [40, 12, 7]
    q, k, v, rows, offsets = _case(lengths, seed=2)
    n_sink = torch.tensor([4, 0, 7], dtype=torch.int32)
    cos, sin = rope_cos_sin(torch.tensor([100, 0, 13]), 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
    got = _same((q, k, v, rows, offsets, lengths, 0.25), n_sink=n_sink, delta_cos=cos, delta_sin=sin)
    plain = decode_attention_ref(q, k, v, rows, offsets, lengths, 0.25)
    assert not torch.allclose(got[0], plain[0]) and torch.allclose(got[1], plain[1], atol=2e-5)


def test_keys_stored_before_rope_are_turned_per_row():
    lengths = [20, 66]
    q, k, v, rows, offsets = _case(lengths, seed=3)
    pos = torch.cat([torch.arange(n) + 5 * b for b, n in enumerate(lengths)])
    cos, sin = rope_cos_sin(pos, 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
    _same((q, k, v, rows, offsets, lengths, 0.25), key_cos=cos, key_sin=sin)


def test_soft_cap_and_an_odd_half_head_dim():
    lengths = [50, 3]
    q, k, v, rows, offsets = _case(lengths, hkv=2, hq=4, d=24, seed=4)
    q = q * 8            # scores large enough for the cap to matter
    got = _same((q, k, v, rows, offsets, lengths, 24 ** -0.5), softcap=5.0)
    uncapped = decode_attention_ref(q, k, v, rows, offsets, lengths, 24 ** -0.5)
    assert not torch.allclose(got, uncapped, atol=1e-3)


def test_a_sequence_does_not_depend_on_the_others_in_the_batch():
    q, k, v, rows, offsets = _case([30, 90], seed=5)
    both = decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), rows.to(DEVICE), offsets.to(DEVICE), [30, 90],
                            0.25)
    alone = decode_attention(q[:1].to(DEVICE), k.to(DEVICE), v.to(DEVICE), rows[:30].to(DEVICE),
                             offsets[:2].to(DEVICE), [30], 0.25)
    assert torch.equal(both[0], alone[0])


def _quant_pages(fmt, n_blocks, bs, hkv, d, g) -> QuantPages:
    pages = {name: torch.zeros((n_blocks, *shape), dtype=dtype) for name, (shape, dtype) in fmt.shapes(bs, hkv, d).items()}
    src = torch.randn(n_blocks, bs, hkv, d, generator=g) * 2 + torch.randn(1, 1, hkv, d, generator=g)
    reference.store_blocks(src, torch.arange(n_blocks), pages["data"], pages.get("scale"), pages.get("zero"), fmt)
    return QuantPages(pages["data"], pages.get("scale"), pages.get("zero"), fmt)


@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("scheme", ["channel", "token"])
def test_quantized_pages_are_read_in_place(name, scheme):
    """Keys and values in their stored formats (kvchat's recipes: keys per channel or per token, values per token or
    in groups of 32; fp8 from its bytes and power-of-two scales), dequantized in the kernel, keys turned per row."""
    g = torch.Generator().manual_seed(6)
    bs, hkv, d, n_blocks = 16, 2, 32, 9
    kp = _quant_pages(page_format(name, "k", scheme), n_blocks, bs, hkv, d, g)
    vp = _quant_pages(page_format(name, "v", scheme), n_blocks, bs, hkv, d, g)
    lengths = [37, 100]
    rows = torch.randperm(n_blocks * bs, generator=g)[:sum(lengths)]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    q = torch.randn(2, 6, d, generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cos, sin = rope_cos_sin(pos, 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    _same((q, kp, vp, rows, offsets, lengths, d ** -0.5), key_cos=cos, key_sin=sin)
