"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`) as a `tokenizers` BPE with byte fallback:
the model, its merges and its text handling per architecture, as transformers' GGUF converter makes them (see
engine/gguf/tokenizer.py for the whole tokenizer)."""
from __future__ import annotations

SPACE = "\u2581"            # SentencePiece's visible space
# architectures whose SentencePiece files are Gemma's: no leading space, merges in vocabulary order, a token of
# spaces stored as real spaces
GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})


def respell(tokens: list[str], arch: str) -> list[str]:
    """The vocabulary as the tokenizer looks tokens up: a Gemma file stores a token of two or more spaces as real
    spaces ("  "), which its text reaches as "▁▁"."""
    if arch not in GEMMA_ARCHS:
        return tokens
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def merges(tokens: list[str], scores: list[float] | None, arch: str) -> list[tuple[str, str]]:
    """The merges a vocabulary without them implies: every split of a token into two tokens of the vocabulary is
    a merge that makes it, ranked by the token's score, best first (ties: the longer left part, then the longer
    right, then the token's place in the vocabulary, then the parts' ids). Gemma's scores do not follow its merge
    order, the order of its tokens does: their rank is minus their index."""
    ids = {t: i for i, t in enumerate(tokens)}
    if arch in GEMMA_ARCHS:
        rank = {t: -i for t, i in ids.items()}
    else:
        rank = dict(zip(tokens, scores or [0.0] * len(tokens)))
    found = []
    for token, score in rank.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        found += [(score, left, right) for left, right in splits]
    # stable and descending on (score, len(left), len(right)): equal keys keep the order above
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def build_model(tokens: list[str], pairs: list[tuple[str, str]], arch: str, unk: str | None):
    """(tokenizers.Tokenizer without added tokens or post-processor) over the respelled vocabulary."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    gemma = arch in GEMMA_ARCHS
    # Gemma's converter names its unknown token; Llama's and Phi-3's fall back to bytes for everything
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=unk if gemma else None, fuse_unk=True,
                        byte_fallback=True))
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        # the leading space comes from a normalizer: "  hi" -> "▁▁▁hi" (with Metaspace it would be "▁▁hi")
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if not gemma:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok
