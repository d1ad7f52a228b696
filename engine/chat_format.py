"""A conversation as prompt tokens, and the tokens that end a reply; no torch here (engine.quick uses it too)."""
from __future__ import annotations

_PLACEHOLDER = "\x00kvchat-content-{}\x00"
STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>")


def clean_text(text: str) -> str:
    """Lone surrogates (which UTF-8 cannot hold) become U+FFFD instead of failing deep in the tokenizer."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def encode_conversation(tokenizer, system_prompt: str | None,
                        messages: list[dict]) -> tuple[str, list[tuple[str, bool]]]:
    """The rendered chat (with the generation prompt) and its pieces: (text, is_content). Message contents are
    tokenized as plain text, so a special-token string inside a message is never the template's own token."""
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
    marked = [dict(m, content=_PLACEHOLDER.format(i)) for i, m in enumerate(msgs)]
    rendered = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    pieces: list[tuple[str, bool]] = []
    rest = rendered
    for i, m in enumerate(msgs):
        mark = _PLACEHOLDER.format(i)
        before, found, rest = rest.partition(mark)
        if not found:          # the template dropped or changed this content: render it as it is
            plain = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            return plain, [(plain, False)]
        pieces += [(before, False), (m["content"], True)]
    pieces.append((rest, False))
    return "".join(p for p, _ in pieces), [(p, c) for p, c in pieces if p]


def tokenize_pieces(tokenizer, pieces: list[tuple[str, bool]], skip_chars: int = 0) -> list[int]:
    """The pieces' tokens, from character skip_chars of their text on."""
    ids: list[int] = []
    for text, content in pieces:
        if skip_chars >= len(text):
            skip_chars -= len(text)
            continue
        text, skip_chars = text[skip_chars:], 0
        ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=content)
    return ids


def stop_ids(tokenizer) -> frozenset[int]:
    """The end-of-sequence token and the chat templates' end-of-turn tokens this vocabulary has."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    lookup = getattr(tokenizer, "token_to_id", None)     # engine.tokenizer: no 49k-entry dict (11 MiB) built for this
    if lookup is not None:
        ids.update(i for i in map(lookup, STOP_TOKENS) if i is not None)
    else:
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in STOP_TOKENS if t in vocab)
    return frozenset(ids)
