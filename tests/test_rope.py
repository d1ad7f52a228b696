"""RoPE rows looked up instead of computed: the same values as rope_cos_sin of the positions alone."""
import pytest
import torch

from kvchat.engine.model import rope
from kvchat.engine.model.rope import rope_cos_sin, rope_rows, rope_table


def _inv(d: int, base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, d, 2).float() / d)


@pytest.mark.parametrize("base", [10_000.0, 500_000.0, 1_000_000.0])
def test_looked_up_rows_are_the_positions_own(base):
    """Decode positions one after another (through a run's end and past it), a jump back, a verification's rows
    across a run's edge and a jump far ahead: every row is rope_cos_sin's of that position alone, bit for bit."""
    inv = _inv(128, base)
    rope._runs.clear()
    starts = [(p, 1) for p in range(0, 300)] + [(3, 1), (250, 9), (rope.ROWS_AHEAD * 3 - 2, 5), (123_456, 1),
                                                 (123_455, 2), (200_000, 300)]
    for first, n in starts:
        cos, sin = rope_rows(first, n, inv)
        want_cos, want_sin = rope_cos_sin(torch.arange(first, first + n), inv)
        assert cos.shape == (n, 128) and torch.equal(cos, want_cos) and torch.equal(sin, want_sin), (first, n)


def test_two_frequency_sets_keep_their_own_rows():
    """Gemma's local and global layers ask by turns: neither reads the other's run."""
    a, b = _inv(64, 10_000.0), _inv(64, 1_000_000.0)
    for p in range(300, 320):
        for inv in (a, b):
            cos, _ = rope_rows(p, 1, inv)
            assert torch.equal(cos, rope_cos_sin(torch.tensor([p]), inv)[0])


def test_the_half_table_is_the_rows_first_half():
    inv = _inv(64, 10_000.0)
    cos_h, sin_h = rope_table(inv, 2000)
    cos, sin = rope_rows(1500, 20, inv)
    assert torch.equal(cos[:, :32], cos_h[1500:1520]) and torch.equal(sin[:, 32:], sin_h[1500:1520])
