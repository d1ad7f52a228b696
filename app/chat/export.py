"""A saved conversation written out as Markdown or JSON. No widgets: the Markdown shows code the way the chat
view split it (message_view.split_segments is plain Python)."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from kvchat.app.chat.message_view import split_segments
from kvchat.app.store.history import HistoryStore

FORMATS = {"markdown": ".md", "json": ".json"}


def conversation_dict(history: HistoryStore, conversation_id: int, model: str = "") -> dict:
    """The conversation as plain data: title, times, cache mode, system prompt, messages (with reply versions)."""
    conversation = history.get(conversation_id)
    if conversation is None:
        raise LookupError(f"there is no conversation {conversation_id}")
    messages = []
    for entry in history.entries(conversation_id):
        item = {"role": entry.role, "content": entry.content}
        if entry.reasoning:             # apart from the answer, as the chat shows it
            item["reasoning"] = entry.reasoning
        if entry.finish:
            item["finish_reason"] = entry.finish
        versions = history.versions(entry.id)
        if versions:
            item["versions"] = [v.content for v in versions]
            item["chosen_version"] = history.chosen_version(entry.id)
        messages.append(item)
    return {"title": conversation.title, "created_at": _iso(conversation.created_at),
            "updated_at": _iso(conversation.updated_at), "model": model,
            "cache": asdict(conversation.cache) if conversation.cache else None,
            "system_prompt": conversation.system_prompt, "messages": messages,
            "exported_by": "kvchat"}


def to_json(data: dict) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def to_markdown(data: dict) -> str:
    """Readable Markdown: a heading per message; a reply's text as the model wrote it, after its reasoning (if any)
    in a quote marked "Reasoning"."""
    lines = [f"# {data['title']}", ""]
    facts = [f"Exported from kvchat on {time.strftime('%Y-%m-%d %H:%M')}", f"started {data['created_at']}"]
    if data.get("model"):
        facts.append(f"model {data['model']}")
    lines += ["_" + ", ".join(facts) + "_", ""]
    if data.get("system_prompt"):
        lines += ["## System", "", data["system_prompt"], ""]
    for message in data["messages"]:
        lines += [f"## {'You' if message['role'] == 'user' else 'Assistant'}", ""]
        if message.get("reasoning"):
            quoted = [f"> {line}".rstrip() for line in message["reasoning"].split("\n")]
            lines += ["> **Reasoning**", ">", *quoted, ""]
        lines += [as_shown(message["content"]), ""]
        note = {"length": "cut at max tokens", "stopped": "stopped"}.get(message.get("finish_reason", ""))
        versions = message.get("versions")
        if versions:
            note = ", ".join(filter(None, [note, f"reply {message['chosen_version'] + 1} of {len(versions)}"]))
        if note:
            lines += [f"_({note})_", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def as_shown(text: str) -> str:
    """Markdown that reads as the chat showed the message: code the view found without a fence gets one (else a
    Markdown viewer joins its lines), and a fence a cut reply left open is closed (else it swallows the rest)."""
    parts = []
    for kind, language, body in split_segments(text):
        if kind == "code":
            fence = "```"
            while fence in body:        # a fence longer than any run of backticks inside the code
                fence += "`"
            parts.append(f"{fence}{language}\n{body}\n{fence}")
        else:
            parts.append(body)
    return "\n\n".join(parts)


def export_conversation(history: HistoryStore, conversation_id: int, path: str | os.PathLike, fmt: str,
                        model: str = "") -> Path:
    """Write the conversation to `path` as "markdown" or "json"; the path written."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: choose markdown or json")
    data = conversation_dict(history, conversation_id, model)
    text = to_markdown(data) if fmt == "markdown" else to_json(data)
    target = Path(path)
    target.write_text(text, encoding="utf-8")
    return target


def suggested_name(title: str, fmt: str) -> str:
    safe = "".join(c if c.isalnum() or c in " -_" else " " for c in title).strip()
    return ("-".join(safe.split())[:60] or "chat") + FORMATS[fmt]


def _iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(timestamp))
