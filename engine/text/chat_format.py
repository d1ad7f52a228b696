"""A conversation as prompt tokens, and the tokens that end a reply; no torch here (engine.runtime.quick uses it too)."""
from __future__ import annotations

import re
import secrets
import traceback

from kvchat.engine.config import ConfigError
from kvchat.engine.text.reasoning import without_reasoning
from kvchat.engine.text.reply import reply_format

# A message's content goes through the template as a sentinel: private-use brackets around a random number and the
# message's index. No letters (a template's upper / lower / title leaves it as it is), no whitespace (trim), no
# escapes (tojson, e); the random number keeps any other text the template writes from passing for one.
_OPEN, _CLOSE = "\ue000", "\ue001"
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
# A reply is written as the model gave it after "Assistant:": its own leading space, if any, is the only one (the
# messages in `glued`), so the chat rendered again reads as the tokens in the cache.
PLAIN_TEMPLATE = (
    "{{ bos_prefix }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% else %}{{ 'Assistant' if m['role'] == 'assistant' else 'User' }}:{{ '' if loop.index0 in glued else ' ' }}"
    "{{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


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


def render_chat(tokenizer, messages: list[dict], where: str = "this model", glued: list[int] = ()) -> str:
    """The conversation through the model's chat template (PLAIN_TEMPLATE where it has none: chat_format_notice
    says so), with the generation prompt, under chat_template's limits; any failure is a ChatTemplateError of one
    line naming `where` (the model file). glued: PLAIN_TEMPLATE's messages written without a space after the
    speaker."""
    from kvchat.engine.text.chat_template import render
    specials = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items()}
    if has_chat_template(tokenizer):
        source = tokenizer.chat_template
    else:
        source, specials = PLAIN_TEMPLATE, {**specials, "bos_prefix": _bos_prefix(tokenizer), "glued": list(glued)}
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
    tokenized as plain text, so a special-token string inside a message is never the template's own token.

    Each content goes through the template as a sentinel, found wherever the template put it (moved, as Mistral
    v0.3 moves the system prompt into the last user turn, repeated, in any order); the content takes its place.
    A template that leaves a message out, or cuts or rewrites its sentinel, is refused (ChatTemplateError): its
    text could not be kept apart from the template's own tokens, and the model would not read what was sent.

    A reply's reasoning (engine.text.reasoning) is left out: earlier turns' reasoning is no part of a prompt."""
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [without_reasoning(m) for m in messages]
    nonce = f"{secrets.randbelow(10 ** 18):018d}"
    marked = [dict(m, content=f"{_OPEN}{nonce}:{i}{_CLOSE}") for i, m in enumerate(msgs)]
    # a reply the model began with a space, after PLAIN_TEMPLATE's "Assistant:", is written without another
    glued = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and m["content"][:1].isspace()]
    rendered = render_chat(tokenizer, marked, where, glued)
    pieces: list[tuple[str, bool]] = []
    found, at = set(), 0
    for match in re.finditer(re.escape(_OPEN + nonce) + r":(\d+)" + _CLOSE, rendered):
        i = int(match.group(1))
        if i >= len(msgs):          # rewritten: left in the template's text, refused below
            continue
        found.add(i)
        pieces += [(rendered[at:match.start()], False), (msgs[i]["content"], True)]
        at = match.end()
    pieces.append((rendered[at:], False))
    if any(_OPEN in text or _CLOSE in text for text, content in pieces if not content):
        raise ChatTemplateError(f"The chat template of {where} cuts or rewrites a message's text, so that text "
                                f"cannot be kept apart from the template's own control tokens: kvchat does not "
                                f"send this conversation to this model.")
    missing = [i for i in range(len(msgs)) if i not in found]
    if missing:
        raise ChatTemplateError(_left_out(msgs[missing[0]]["role"], where))
    return "".join(p for p, _ in pieces), [(p, c) for p, c in pieces if p]


def _left_out(role: str, where: str) -> str:
    what = "the system prompt" if role == "system" else f"a message of the {role}"
    advice = ("clear the system prompt to chat with this model" if role == "system"
              else "this conversation cannot be sent to this model as it is")
    return (f"The chat template of {where} leaves out {what}: the model would not read it, so kvchat does not "
            f"send the conversation; {advice}.")


def tokenize_pieces(tokenizer, pieces: list[tuple[str, bool]], skip_chars: int = 0,
                    starts: list[int | None] | None = None) -> list[int]:
    """The pieces' tokens, from character skip_chars of their text on. Every piece but the text's very first is
    encoded as a continuation where the tokenizer knows how (engine.text.tokenizer: no SentencePiece "▁" added
    before it). starts: where given, filled with the index in the result where each piece's tokens begin (None for
    a piece skipped whole)."""
    ids: list[int] = []
    knows = getattr(tokenizer, "encodes_continuations", False)
    continues = knows and skip_chars > 0
    for text, content in pieces:
        if starts is not None:
            starts.append(None if skip_chars >= len(text) else len(ids))
        if skip_chars >= len(text):
            skip_chars -= len(text)
            continue
        text, skip_chars = text[skip_chars:], 0
        more = {"continuation": True} if continues else {}
        ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=content, **more)
        continues = knows
    return ids


def last_message(pieces: list[tuple[str, bool]], starts: list[int | None], offset: int = 0) -> int | None:
    """offset + where the newest message's tokens begin in a tokenize_pieces result (its `starts`), or None: the
    rendered chat's last content piece, where it was tokenized (a recurrent state is kept there:
    runtime/overflow.state_cuts)."""
    last = max((i for i, (_, content) in enumerate(pieces) if content), default=None)
    return None if last is None or starts[last] is None else offset + starts[last]


def held_prefix(tokenizer, rendered: str, ids: list[int], cached: int,
                reply_start: int | None = None) -> tuple[int, int] | None:
    """How much of a conversation's tokens `ids` (the first `cached` of them in its cache) the chat rendered again
    starts with, as (tokens, characters): all of them; the cached ones, where the rest is an end-of-text token
    the format does not write (the plain format's, never fed); those before the last reply (`reply_start`), where
    the format writes that reply otherwise than the model did (Harmony drops its analysis); or None: the
    conversation changed."""
    for n in (len(ids), cached) + ((reply_start,) if reply_start is not None and reply_start <= cached else ()):
        held = tokenizer.decode(ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if rendered.startswith(held):
            return n, len(held)
    return None


def stop_ids(tokenizer) -> frozenset[int]:
    """The end-of-sequence token and the chat templates' end-of-turn tokens this vocabulary has, as its reply format
    has them (Harmony: <|return|> and <|call|>, never <|end|>, which ends only the analysis message)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    lookup = getattr(tokenizer, "token_to_id", None)     # engine.tokenizer: no 49k-entry dict (11 MiB) built for this
    if lookup is not None:
        ids.update(i for i in map(lookup, STOP_TOKENS) if i is not None)
    else:
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in STOP_TOKENS if t in vocab)
    return reply_format(tokenizer).stop_ids(frozenset(ids))
