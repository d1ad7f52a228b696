"""A Gated DeltaNet layer's mixer in one C call (kernels/cpu_gdn.h: gdn_mix, what the layer path and the one-call step
run on the CPU): the torch mixer's numbers (transformers' arithmetic) within rounding, the state it is given left as it
was, and a sequence's rows giving the same bits whether they come at once or cut in two."""
import pytest
import torch

from kvchat.engine.model import linear_attention as gdn
from kvchat.engine.model.spec import LinearAttention
from kvchat.engine.model.transformer import MixerWeights
from kvchat.kernels import cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="the C kernels are not built here")

LA = LinearAttention(key_heads=2, value_heads=4, key_dim=16, value_dim=16, conv_kernel=4)
EPS = 1e-6


def _parts(seed: int, rows: int):
    gen = torch.Generator().manual_seed(seed)
    C, H, Dv = LA.channels, LA.value_heads, LA.value_dim

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    weights = MixerWeights(conv=rnd(LA.conv_kernel, C, scale=0.5), dt_bias=rnd(H), A=-rnd(H).abs() - 0.1,
                           norm=1 + rnd(Dv, scale=0.1))
    proj = rnd(rows, C + H * Dv + 2 * H)
    proj[0, -1] = 30.0                         # an `a` past softplus's threshold of 20
    state = (rnd(LA.conv_kernel - 1, C), rnd(H, LA.key_dim, Dv, scale=0.3))
    table = cpu_quant.gdn_table(weights.conv, weights.A, weights.dt_bias, weights.norm, LA.key_heads, LA.key_dim)
    assert table is not None
    return weights, proj, state, table


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_the_c_mixer_is_the_torch_mixer_and_leaves_the_state_it_reads(rows):
    weights, proj, (tail, matrices), table = _parts(rows, rows)
    before = tail.clone(), matrices.clone()
    out, new_tail, new_matrices = gdn.mix(proj, weights, LA, EPS, tail, matrices, rows == 1, table)
    ref_out, ref_tail, ref_matrices = gdn.mix(proj, weights, LA, EPS, tail, matrices, rows == 1, None)
    assert torch.equal(tail, before[0]) and torch.equal(matrices, before[1])
    assert torch.equal(new_tail, ref_tail)                  # the last inputs, copied
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new_matrices, ref_matrices, rtol=1e-4, atol=1e-5)


def test_rows_at_once_and_rows_cut_in_two_give_the_same_bits():
    weights, proj, (tail, matrices), table = _parts(3, 6)
    whole = cpu_quant.gdn_mix(table, proj, EPS, tail, matrices)
    first = cpu_quant.gdn_mix(table, proj[:2], EPS, tail, matrices)
    second = cpu_quant.gdn_mix(table, proj[2:], EPS, first[1], first[2])
    assert torch.equal(whole[0], torch.cat((first[0], second[0])))
    assert torch.equal(whole[1], second[1]) and torch.equal(whole[2], second[2])


def test_a_mixer_the_kernel_cannot_take_gets_none():
    weights, proj, (tail, matrices), _ = _parts(4, 1)
    assert cpu_quant.gdn_table(weights.conv, weights.A, weights.dt_bias, weights.norm, 3, 16) is None     # widths
    assert cpu_quant.gdn_table(weights.conv.double(), weights.A, weights.dt_bias, weights.norm, 2, 16) is None
    table = cpu_quant.gdn_table(weights.conv, weights.A, weights.dt_bias, weights.norm, 2, 16)
    assert cpu_quant.gdn_mix(table, proj.double(), EPS, tail, matrices) is None
    assert cpu_quant.gdn_mix(table, proj[:, :10], EPS, tail, matrices) is None      # rows too narrow: C says -3
