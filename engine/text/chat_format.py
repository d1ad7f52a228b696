"""A conversation as prompt tokens, and the tokens that end a reply; no torch here (engine.runtime.quick uses it too)."""
from __future__ import annotations

import traceback

from kvchat.engine.config import ConfigError

_PLACEHOLDER = "\x00kvchat-content-{}\x00"
PROBE = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me a joke."}]
STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>")


def clean_text(text: str) -> str:
    """Lone surrogates (which UTF-8 cannot hold) become U+FFFD instead of failing deep in the tokenizer."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class ChatTemplateError(ConfigError):
    """The model's chat template failed, ran past its limits or rendered nothing; the message says which."""


def _template_line(exc: BaseException) -> str:
    lines = [n for frame, n in traceback.walk_tb(exc.__traceback__) if frame.f_code.co_filename == "<template>"]
    return f" (line {lines[-1]})" if lines else ""


def _describe(exc: Exception, where: str) -> str:
    from jinja2 import exceptions as jx
    from kvchat.engine.text.chat_template import TemplateLimit
    text = " ".join(str(getattr(exc, "message", None) or exc).split()) or type(exc).__name__
    if isinstance(exc, TemplateLimit):
        what = f"was stopped: it {text}"
    elif isinstance(exc, jx.TemplateSyntaxError):
        return f"The chat template of {where} cannot be read: {text} (line {exc.lineno})."
    elif isinstance(exc, jx.SecurityError):
        what = f"tried something the sandbox forbids: {text}"
    elif type(exc) is jx.TemplateError:        # the template's own raise_exception
        what = f"refused this conversation: {text}"
    else:
        what = f"failed: {type(exc).__name__}: {text}"
    return f"The chat template of {where} {what}{_template_line(exc)}."


# The conversation as plain text for a model whose file has no chat template (a base model): it continues the
# transcript after "Assistant:". Its BOS comes first where the tokenizer starts a text with one (bos_prefix).
PLAIN_TEMPLATE = (
    "{{ bos_prefix }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% else %}{{ 'Assistant' if m['role'] == 'assistant' else 'User' }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def has_chat_template(tokenizer) -> bool:
    source = getattr(tokenizer, "chat_template", None)
    return bool(source) and isinstance(source, str)


def chat_format_notice(tokenizer, where: str = "this model") -> str | None:
    """What to tell the user before a chat with a model whose file has no chat template (None for the others):
    the chat is a plain-text continuation, which a base model follows loosely."""
    if has_chat_template(tokenizer):
        return None
    return (f"{where} has no chat template (a base model?): the chat is sent as plain text, 'User:' and "
            f"'Assistant:' lines it continues; its replies may ramble or speak for the user")


def _bos_prefix(tokenizer) -> str:
    """The BOS text where the tokenizer starts a plain text with it (its add_bos rule), else ""."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    ids = tokenizer.encode("x", add_special_tokens=True)
    return bos if ids and ids[0] == bos_id else ""


def render_chat(tokenizer, messages: list[dict], where: str = "this model") -> str:
    """The conversation through the model's chat template (PLAIN_TEMPLATE where it has none: chat_format_notice
    says so), with the generation prompt, under chat_template's limits; any failure is a ChatTemplateError of one
    line naming `where` (the model file)."""
    from kvchat.engine.text.chat_template import render
    specials = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items()}
    if has_chat_template(tokenizer):
        source = tokenizer.chat_template
    else:
        source, specials = PLAIN_TEMPLATE, {**specials, "bos_prefix": _bos_prefix(tokenizer)}
    try:
        text = render(source, messages, True, **specials)
    except Exception as exc:  # noqa: BLE001 - whatever a template does wrong, the user hears it in one line
        raise ChatTemplateError(_describe(exc, where)) from None
    if not text:
        raise ChatTemplateError(f"The chat template of {where} rendered nothing for this conversation.")
    return text


def check_template(tokenizer, where: str) -> None:
    """Refuse, at load, a model whose template cannot render a small conversation within the limits."""
    if getattr(tokenizer, "chat_template", None):
        encode_conversation(tokenizer, None, PROBE, where=where)


def encode_conversation(tokenizer, system_prompt: str | None, messages: list[dict],
                        where: str = "this model") -> tuple[str, list[tuple[str, bool]]]:
    """The rendered chat (with the generation prompt) and its pieces: (text, is_content). Message contents are
    tokenized as plain text, so a special-token string inside a message is never the template's own token."""
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
    marked = [dict(m, content=_PLACEHOLDER.format(i)) for i, m in enumerate(msgs)]
    rendered = render_chat(tokenizer, marked, where)
    pieces: list[tuple[str, bool]] = []
    rest = rendered
    for i, m in enumerate(msgs):
        mark = _PLACEHOLDER.format(i)
        before, found, rest = rest.partition(mark)
        if not found:          # the template dropped or changed this content: render it as it is
            plain = render_chat(tokenizer, msgs, where)
            return plain, [(plain, False)]
        pieces += [(before, False), (m["content"], True)]
    pieces.append((rest, False))
    return "".join(p for p, _ in pieces), [(p, c) for p, c in pieces if p]


def tokenize_pieces(tokenizer, pieces: list[tuple[str, bool]], skip_chars: int = 0) -> list[int]:
    """The pieces' tokens, from character skip_chars of their text on. Every piece but the text's very first is
    encoded as a continuation where the tokenizer knows how (engine.text.tokenizer: no SentencePiece "▁" added
    before it)."""
    ids: list[int] = []
    knows = getattr(tokenizer, "encodes_continuations", False)
    continues = knows and skip_chars > 0
    for text, content in pieces:
        if skip_chars >= len(text):
            skip_chars -= len(text)
            continue
        text, skip_chars = text[skip_chars:], 0
        more = {"continuation": True} if continues else {}
        ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=content, **more)
        continues = knows
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
