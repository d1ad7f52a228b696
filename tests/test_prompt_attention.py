"""Prompt rows' attention in C over full-precision pages read in place (kernels/cpu_prompt_attn.h: attn_prompt): held
to the torch path (softmax_attention) in every variant the CPU runs, each row's bits independent of the chunk it is
read in, and used by the C backend for prompt and verification rows."""
import pytest
import torch

from kvchat.engine.runtime.attention import softmax_attention
from kvchat.kernels import cpu_lib, cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="C kernels unavailable")

CASES = [  # T, P, Hq, Hkv, D, dtype, window, sink logits, turned sink keys, softcap
    (24, 700, 9, 3, 64, torch.bfloat16, None, False, 0, None),
    (5, 37, 4, 1, 256, torch.float32, 20, False, 0, None),
    (33, 300, 8, 2, 80, torch.float32, None, True, 0, None),
    (7, 50, 8, 8, 128, torch.bfloat16, None, False, 4, None),
    (1, 0, 6, 2, 16, torch.float32, None, False, 0, 30.0),
    (40, 0, 4, 2, 32, torch.bfloat16, 9, True, 0, None),
]


def _case(T, P, Hq, Hkv, D, dtype, window, sinks, n_sink, cap, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = P + T + 17
    kp, vp = (torch.randn(R, Hkv, D, generator=g).to(dtype) for _ in range(2))
    rows = torch.randperm(R, generator=g)[:P + T]
    q = torch.randn(T, Hq, D, generator=g)
    outside = None
    if window:
        outside = torch.arange(P + T)[None, :] <= (torch.arange(P, P + T) - window)[:, None]
    sink_logits = torch.randn(Hq, generator=g) if sinks else None
    sink_keys = torch.randn(n_sink, Hkv, D, generator=g) if n_sink else None
    return q, kp, vp, rows, outside, sink_logits, sink_keys


def _reference(q, kp, vp, rows, outside, sink_logits, sink_keys, scale, cap):
    k_all, v_all = kp[rows].float(), vp[rows].float()
    if sink_keys is not None:
        k_all[:sink_keys.shape[0]] = sink_keys
    return softmax_attention(q, k_all, v_all, False, scale, cap, outside, sink_logits)


@pytest.fixture(scope="module", params=cpu_lib.runnable_variants())
def variant(request):
    return cpu_lib._build(variant=request.param)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-P{c[1]}-{c[2]}x{c[3]}-D{c[4]}")
def test_attn_prompt_equals_the_torch_path_in_every_variant(case, variant):
    *shape, cap = case
    q, kp, vp, rows, outside, sink_logits, sink_keys = _case(*case)
    scale = 0.11
    want = _reference(q, kp, vp, rows, outside, sink_logits, sink_keys, scale, cap)
    old = cpu_quant._lib
    try:
        cpu_quant._lib = variant
        got = cpu_quant.attn_prompt(q, kp, vp, rows, scale, cap, sink_keys, outside, sink_logits)
    finally:
        cpu_quant._lib = old
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 2e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("name", [v for v in cpu_lib.runnable_variants() if v != "baseline"])
def test_the_simd_variants_give_the_same_bits(name):
    """AVX-512 holds 16 keys' scores in one register and AVX2 in two, with half the queries a pass and one 16-float
    chunk of values a pass: the same multiply-add per lane in the same order, so the same bits in every case (the
    baseline's plain loops round twice a step: held to the reference above)."""
    lib = cpu_lib._build(variant=name)
    for case in CASES:
        q, kp, vp, rows, outside, sink_logits, sink_keys = _case(*case)
        args = (q, kp, vp, rows, 0.11, case[-1], sink_keys, outside, sink_logits)
        want = cpu_quant.attn_prompt(*args)
        old = cpu_quant._lib
        try:
            cpu_quant._lib = lib
            got = cpu_quant.attn_prompt(*args)
        finally:
            cpu_quant._lib = old
        assert torch.equal(got, want), (name, case)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"T{c[0]}-P{c[1]}")
def test_a_row_gives_the_same_bits_in_any_chunk(case):
    """Rows 0 .. T read whole, or their last rows as a later chunk over the same keys: the same bits (as the torch
    path's blocks of 32 guarantee a prompt restored from the prefix cache)."""
    q, kp, vp, rows, outside, sink_logits, sink_keys = _case(*case)
    T, cap = q.shape[0], case[-1]
    whole = cpu_quant.attn_prompt(q, kp, vp, rows, 0.125, cap, sink_keys, outside, sink_logits)
    for cut in {1, T // 2, T - 1} - {0, T}:
        part = cpu_quant.attn_prompt(q[cut:], kp, vp, rows, 0.125, cap, sink_keys,
                                     None if outside is None else outside[cut:], sink_logits)
        assert torch.equal(part, whole[cut:]), cut
    with_one = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_quant.attn_prompt(q, kp, vp, rows, 0.125, cap, sink_keys, outside, sink_logits)
    finally:
        torch.set_num_threads(with_one)
    assert torch.equal(alone, whole)


def test_shapes_the_kernel_does_not_take_are_said_and_left_to_torch():
    q = torch.randn(3, 4, 72)
    pages = torch.randn(10, 2, 72)
    assert not cpu_quant.can_attend_prompt(4, pages)
    with pytest.raises(ValueError, match="head_dim 72"):
        cpu_quant.attn_prompt(q, pages, pages, torch.arange(5), 0.1)


def _count_rows(monkeypatch, kernel: str) -> list[int]:
    """cpu_quant.<kernel> wrapped to note each call's query rows (its first argument's length); -> the notes."""
    calls, real = [], getattr(cpu_quant, kernel)

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)
    monkeypatch.setattr(cpu_quant, kernel, counted)
    return calls


def test_the_c_backend_reads_prompts_through_it_and_answers_as_torch_does(tiny_engine, monkeypatch):
    """A prompt and a follow-up through FullPagesC (attn_prompt), then the same with the kernel refused (the torch
    path): logits within float rounding, and the kernel was the one called."""
    from kvchat.engine.config import CacheConfig

    def logits():
        s = tiny_engine.new_session(cache=CacheConfig(k_format="bf16", v_format="bf16"), prefix_cache=False)
        try:
            first = s.append(list(range(5, 300)), all_logits=False)
            return torch.cat([first, s.append(list(range(40, 64)), all_logits=False)])
        finally:
            s.close()
    calls = _count_rows(monkeypatch, "attn_prompt")
    with_c = logits()
    assert calls and 24 in calls
    monkeypatch.setattr(cpu_quant, "can_attend_prompt", lambda *a: False)
    calls.clear()
    with_torch = logits()
    assert not calls
    assert (with_c - with_torch).abs().max() <= 1e-4 * with_torch.abs().max()


def test_gathering_backends_take_the_kernel_for_prompt_rows_and_torch_for_a_decode():
    """prompt_attention (quantized pages, layers reading another layer's KV): prompt rows through attn_prompt over the
    gathered keys, within float rounding of softmax_attention; a one-token decode is softmax_attention's, bit for
    bit; the observed mass is softmax_attention's either way."""
    from kvchat.engine.runtime.attention import RowMass, prompt_attention
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(12, 8, 64, generator=g), torch.randn(40, 2, 64, generator=g), torch.randn(40, 2, 64, generator=g)
    outside = torch.arange(40)[None, :] <= (torch.arange(28, 40) - 10)[:, None]
    cols = torch.arange(40)
    seen, want_seen = (RowMass(cols, torch.zeros(2, 8, 41), mean_of=4) for _ in range(2))
    got = prompt_attention(q, k, v, False, 0.125, None, outside, None, seen)
    want = softmax_attention(q, k, v, False, 0.125, None, outside, None, want_seen)
    assert (got - want).abs().max() <= 2e-5 * want.abs().max() and not torch.equal(got, want)
    assert torch.equal(seen.out, want_seen.out)
    one = prompt_attention(q[-1:], k, v, True, 0.125)
    assert torch.equal(one, softmax_attention(q[-1:], k, v, True, 0.125))


@pytest.mark.parametrize("mode", ["int8", "fp8", "int4", "int8-int4-window"])
def test_quantized_pages_are_read_in_place_with_the_torch_paths_bits(tiny_engine, monkeypatch, mode):
    """Prompt rows over int8 / fp8 / int4 pages (and a window with sinks) through attn_prompt_quant, the held rows
    dequantized and rotated in the kernel, against the torch path's gathered copy through attn_prompt: the same
    logits bit for bit, a prompt's chunks and a follow-up's; the kernel was the one called."""
    from kvchat.engine.config import CacheConfig
    from kvchat.engine.runtime.backends import quant_pages
    if not cpu_quant.kv_kernels_ready(wait=True):
        pytest.skip("the quantized-KV kernels did not build")
    k, v = mode.split("-")[:2] if "-" in mode else (mode, mode)
    cache = CacheConfig(k_format=k, v_format=v, **({"window": 48, "sinks": 4} if "window" in mode else {}))
    def logits():
        s = tiny_engine.new_session(cache=cache, prefix_cache=False)
        try:
            first = s.append(list(range(5, 140)), all_logits=True)          # chunks over their own pages
            return torch.cat([first, s.append(list(range(40, 64)), all_logits=True), s.append([9], True)])
        finally:
            s.close()
    calls = _count_rows(monkeypatch, "attn_prompt_quant")
    in_place = logits()
    assert 24 in calls
    monkeypatch.setattr(quant_pages, "prompt_kernel_attend",
                        lambda q, k, v, st, kc, vc, scores: quant_pages.attend_torch(kc, vc, q, k, v, st, scores))
    calls.clear()
    gathered = logits()
    assert not calls
    d = (in_place - gathered).abs().amax(-1)
    assert torch.equal(in_place, gathered), (d.nonzero().flatten().tolist()[:20], d.max().item())
