"""The KV cache's one owner (engine/kv/cache.py): positioned blocks, drop, truncate as a result, export / import."""
import pytest
import torch

from kvchat.engine.config import CacheConfig

FP32 = dict(k_format="fp32", v_format="fp32", block_size=16)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab - 5, (n,), generator=g).tolist()


@pytest.fixture
def runner(tiny_engine):
    r = tiny_engine.runner
    for seq in r.cache.sequences():
        r.close(seq)
    r.clear_prefix_cache()
    budget = r.budget_bytes / 2**20
    r.set_budget(64)              # earlier tests may have left a budget too small for two conversations
    yield r
    r.cache.check()
    for seq in r.cache.sequences():
        r.close(seq)
    r.set_budget(budget)


def _reference_without(folder, ids: list[int], new: int, gone: range) -> torch.Tensor:
    """transformers' logits for `new` after ids, its cache without the positions in `gone` (the others keep theirs)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        past = model(torch.tensor([ids]), use_cache=True).past_key_values
        keep = torch.tensor([p for p in range(len(ids)) if p not in gone])
        for layer in past.layers:
            layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
        out = model(torch.tensor([[new]]), past_key_values=past, position_ids=torch.tensor([[len(ids)]]),
                    use_cache=True)
    return out.logits[0, -1]


def test_a_dropped_block_leaves_a_null_and_attention_goes_on_without_it(runner, tiny_llama):
    """Drop the third block of a 70-token conversation: the table keeps its length with a null there, the pool takes
    the block back, and the next token's logits are transformers' with those 16 positions gone from its cache (the
    later blocks keep their positions: nothing is rotated again)."""
    vocab = runner.config.vocab_size
    ids, new = _ids(70, 1, vocab), _ids(1, 2, vocab)[0]
    seq = runner.new_sequence(CacheConfig(**FP32))
    runner.step([(seq, ids)], hash_ids=False)
    held, table = runner.held_bytes, list(seq.table)
    freed = runner.cache.drop(seq, 2)
    assert freed == seq.layout.block_bytes and runner.held_bytes == held - freed
    assert seq.table == table[:2] + [None] + table[3:] and seq.evicted == 1 and seq.seq_len == 54
    assert [p for p, _ in runner.cache.held(seq)] == [0, 16, 48, 64]
    runner.cache.check()
    logits = runner.step([(seq, [new])])[0][0]
    ref = _reference_without(tiny_llama, ids, new, range(32, 48))
    assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), (logits - ref).abs().max()
    assert len(seq.table) == 5 and seq.table[2] is None
    runner.close(seq)


def test_drop_refuses_the_head_the_tail_and_a_block_already_gone(runner):
    seq = runner.new_sequence(CacheConfig(**FP32))
    runner.step([(seq, _ids(50, 3, runner.config.vocab_size))])
    runner.cache.drop(seq, 1)
    for position in (0, 3, 1, 7):        # the quantized head, the block being filled, a null, past the end
        with pytest.raises(ValueError, match="cannot be dropped"):
            runner.cache.drop(seq, position)
    assert len(seq.table) == 4 and seq.evicted == 1
    runner.close(seq)


def test_a_dropped_block_ends_prefix_indexing(runner):
    """Blocks computed after a drop did not see it: another conversation must not reuse them as full attention's."""
    vocab = runner.config.vocab_size
    ids = _ids(40, 4, vocab)
    seq = runner.new_sequence(CacheConfig(**FP32))
    runner.step([(seq, ids)])
    runner.cache.drop(seq, 1)
    more = _ids(40, 5, vocab)
    runner.step([(seq, more)])
    other = runner.new_sequence(CacheConfig(**FP32))
    assert runner.match_prefix(other, ids + more + [1]) <= 32      # only the blocks written before the drop
    runner.close(other)
    runner.close(seq)


def test_the_window_leaves_nulls_after_the_sinks_and_positions_come_from_the_table(runner):
    """Window 32 with 4 sinks over 200 tokens: one entry per block seen, nulls right after the sink block, and every
    held slot's position read off the table equals the token it holds."""
    seq = runner.new_sequence(CacheConfig(**FP32, window=32, sinks=4))
    for chunk in range(0, 200, 40):
        runner.step([(seq, _ids(40, chunk, runner.config.vocab_size))])
    assert len(seq.table) == 13 and seq.table[0] is not None
    nulls = [i for i, b in enumerate(seq.table) if b is None]
    assert nulls == list(range(1, 1 + len(nulls))) and seq.evicted == len(nulls) > 0
    slots = torch.arange(seq.seq_len)
    expect = torch.tensor([p + j for p, _ in runner.cache.held(seq) for j in range(16)])[:seq.seq_len]
    assert torch.equal(seq.positions(slots), expect)
    runner.close(seq)


def test_truncate_says_why_it_cannot_and_changes_nothing(runner):
    seq = runner.new_sequence(CacheConfig(**FP32, window=32, sinks=4))
    runner.step([(seq, _ids(120, 6, runner.config.vocab_size))])
    before = (list(seq.table), seq.num_tokens, runner.held_bytes)
    done = runner.cache.truncate(seq, 100)
    assert not done and done.taken == 0 and "cannot take back 100" in done.reason
    assert (list(seq.table), seq.num_tokens, runner.held_bytes) == before
    done = runner.cache.truncate(seq, 5)
    assert done and done.taken == 5 and seq.num_tokens == 115
    runner.close(seq)

    q = runner.new_sequence(CacheConfig(k_format="int8", v_format="int8", block_size=16))
    runner.step([(q, _ids(40, 7, runner.config.vocab_size))])
    done = runner.cache.truncate(q, 20)               # into a block already quantized
    assert not done and "quantized" in done.reason and q.num_tokens == 40
    runner.close(q)


@pytest.mark.parametrize("mode", [dict(FP32), dict(k_format="int8", v_format="int4", block_size=16),
                                  dict(FP32, window=32, sinks=4)], ids=["fp32", "int8-int4", "window"])
def test_export_then_import_gives_the_same_next_token_bit_for_bit(runner, mode):
    vocab = runner.config.vocab_size
    seq = runner.new_sequence(CacheConfig(**mode))
    runner.step([(seq, _ids(90, 8, vocab))])
    groups, tensors = runner.cache.export(seq)
    copy = runner.new_sequence(CacheConfig(**mode))
    runner.cache.import_(copy, groups, tensors)
    assert copy.table != seq.table and [b is None for b in copy.table] == [b is None for b in seq.table]
    assert (copy.num_tokens, copy.seq_len) == (seq.num_tokens, seq.seq_len)
    runner.cache.check()
    new = _ids(1, 9, vocab)
    a, b = runner.step([(seq, new)])[0], runner.step([(copy, new)])[0]
    assert torch.equal(a, b)
    runner.close(copy)
    runner.close(seq)
