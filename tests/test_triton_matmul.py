"""The Triton dequantize-and-multiply kernels against their torch reference, over every packed kind the loader
makes, odd shapes and both kernels' row counts. Without a GPU they run under triton's interpreter (conftest)."""
import pytest
import torch

pytest.importorskip("triton")

from kvchat.kernels import cpu_quant  # noqa: E402
from kvchat.kernels.triton_matmul import DECODE_ROWS, packed_matmul, packed_matmul_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _q4(n, k, kind, g):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    G = k // 32
    if kind == "fp32":
        s = cpu_quant.Scales(torch.rand(n, G, generator=g) * 0.1 + 0.01, torch.randn(n, G, generator=g) * 0.1)
    elif kind == "fp16":
        s = cpu_quant.Scales((torch.rand(n, G, generator=g) * 0.1 + 0.01).half(), torch.randn(n, G, generator=g).half())
    elif kind == "offset8":           # GGUF Q4_0
        s = cpu_quant.Scales((torch.rand(n, G, generator=g) * 0.1 + 0.01).half(), offset8=True)
    else:                             # Q4_K: 6-bit codes of a super-scale per 8 groups, zeros likewise
        per = 8 if G % 8 == 0 else 1
        s = cpu_quant.Scales(torch.randint(0, 64, (n, G), dtype=torch.uint8, generator=g),
                             torch.randint(0, 64, (n, G), dtype=torch.uint8, generator=g),
                             torch.rand(n, G // per, generator=g) * 0.01, -torch.rand(n, G // per, generator=g) * 0.01,
                             per)
    return codes, s


def _q8(n, k, kind, g):
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    if kind == "q6k":                 # Q6_K: int8 scale codes per group of 16, a super-scale per 16 groups
        G = k // 16
        per = 16 if G % 16 == 0 else 1
        return codes, cpu_quant.Scales(torch.randint(-128, 128, (n, G), dtype=torch.int8, generator=g), None,
                                       torch.rand(n, G // per, generator=g) * 1e-3, None, per), 16
    G = k // 32
    if kind == "q8_0":
        return codes, cpu_quant.Scales((torch.rand(n, G, generator=g) * 1e-2).half()), 32
    if kind == "q5_1":
        return codes, cpu_quant.Scales(torch.rand(n, G, generator=g) * 1e-2, torch.randn(n, G, generator=g) * 0.1), 32
    per = 8 if G % 8 == 0 else 1       # Q5_K
    return codes, cpu_quant.Scales(torch.randint(0, 64, (n, G), dtype=torch.uint8, generator=g),
                                   torch.randint(0, 64, (n, G), dtype=torch.uint8, generator=g),
                                   torch.rand(n, G // per, generator=g) * 1e-3,
                                   -torch.rand(n, G // per, generator=g) * 1e-2, per), 32


def _check(x, codes, scales, bits, group, bias=None):
    want = packed_matmul_ref(x, codes, scales, bits, group, bias)
    dev = lambda t: None if t is None else t.to(DEVICE)      # noqa: E731
    got = packed_matmul(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), bits, group, dev(bias)).cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("kind", ["fp32", "fp16", "offset8", "two-level"])
@pytest.mark.parametrize("rows", [1, 3, DECODE_ROWS, DECODE_ROWS + 1, 70])
def test_q4_every_kind_and_row_count(kind, rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 37, 96 if kind != "two-level" else 256
    codes, scales = _q4(n, k, kind, g)
    _check(torch.randn(rows, k, generator=g), codes, scales, 4, 32)


@pytest.mark.parametrize("kind", ["q8_0", "q5_1", "q6k", "q5k"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_q8_every_kind_and_row_count(kind, rows):
    g = torch.Generator().manual_seed(100 + rows)
    n, k = 45, 256 if kind in ("q6k", "q5k") else 160
    codes, scales, group = _q8(n, k, kind, g)
    _check(torch.randn(rows, k, generator=g), codes, scales, 8, group)


def test_bias_half_inputs_and_empty_rows():
    g = torch.Generator().manual_seed(7)
    codes, scales = _q4(19, 64, "fp32", g)
    bias = torch.randn(19, generator=g)
    _check(torch.randn(2, 64, generator=g), codes, scales, 4, 32, bias)
    _check(torch.randn(20, 64, generator=g).half().float(), codes, scales, 4, 32, bias)
    x16 = torch.randn(3, 64, generator=g).bfloat16()
    got = packed_matmul(x16.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), 4, 32).cpu()
    torch.testing.assert_close(got, packed_matmul_ref(x16, codes, scales, 4, 32), rtol=1e-4, atol=1e-4)
    assert packed_matmul(torch.zeros(0, 64, device=DEVICE), codes.to(DEVICE), scales.to(DEVICE), 4, 32).shape == (0, 19)


def test_a_decode_row_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(3)
    codes, scales = _q4(40, 128, "offset8", g)
    x = torch.randn(DECODE_ROWS, 128, generator=g).to(DEVICE)
    codes, scales = codes.to(DEVICE), scales.to(DEVICE)
    alone = packed_matmul(x[:1], codes, scales, 4, 32)
    batched = packed_matmul(x, codes, scales, 4, 32)
    assert torch.equal(alone[0], batched[0])


def test_the_linears_weights_through_the_kernel_match_their_cpu_path():
    """Q4Linear / Q8Linear as the loader builds them: the GPU-path matmul equals the CPU one (the C kernels or
    their references), so a linear's two paths are interchangeable."""
    from kvchat.engine.model.linears import Q4Linear, Q8Linear
    g = torch.Generator().manual_seed(11)
    w = torch.randn(24, 128, generator=g)
    x = torch.randn(4, 128, generator=g)
    for lin in (Q4Linear.from_float(w), Q8Linear.from_float(w)):
        want = x @ lin.dequantize().t()
        got = packed_matmul(x.to(DEVICE), lin.codes.to(DEVICE), lin.scales.to(DEVICE), lin.bits, lin.group).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_mismatched_shapes_are_refused():
    g = torch.Generator().manual_seed(1)
    codes, scales = _q4(8, 64, "fp32", g)
    with pytest.raises(AssertionError):
        packed_matmul(torch.randn(1, 96), codes, scales, 4, 32)
