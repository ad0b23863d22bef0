"""Prompt sets: the shipped ones (``loadtest/prompts/*.jsonl``) and user files in the same shapes.

Each line of a ``.jsonl`` file is a JSON object with a ``prompt`` string (completion style, e.g. the
demo pair's held-out ``$AUGUR_HOME/demo/prompts.jsonl``), or with ``messages`` (chat style), or a
bare JSON string. Either kind works with either API: a plain prompt becomes one user message for
chat, and a conversation's contents joined by newlines become the prompt for completions. An optional
``category`` string groups the lines of a benchmark suite (``suite``: see ``loadtest.suite``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SHIPPED = {
    "code": "code_prefixes.jsonl",
    "chat": "chat.jsonl",
    "tutorial": "tutorial.jsonl",
    "suite": "suite.jsonl",
}


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    category: str | None = None  # a suite's task category (code, chat, summarization, ...)

    def as_messages(self) -> list[dict]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.text}]

    def as_text(self) -> str:
        if self.text is not None:
            return self.text
        return "\n".join(str(m.get("content", "")) for m in self.messages or ())


def _parse_line(obj, where: str) -> Prompt:
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object or string, got {type(obj).__name__}")
    category = obj.get("category")
    if category is not None and (not isinstance(category, str) or not category):
        raise ValueError(f"{where}: 'category' must be a non-empty string")
    messages = obj.get("messages")
    if messages is not None:
        ok = isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)
        if not ok:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return Prompt(text=obj.get("prompt"), messages=tuple(messages), category=category)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")
    return Prompt(text=prompt, category=category)


def parse_jsonl(text: str, name: str = "<prompts>") -> list[Prompt]:
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{lineno}: not valid JSON ({e.msg})") from None
        prompts.append(_parse_line(obj, f"{name}:{lineno}"))
    if not prompts:
        raise ValueError(f"{name}: no prompts")
    return prompts


def load_prompts(spec: str) -> list[Prompt]:
    """``spec`` is a shipped set's name (code, chat, tutorial, suite) or a path to a ``.jsonl`` file."""
    if spec in SHIPPED:
        text = resources.files("loadtest").joinpath("prompts", SHIPPED[spec]).read_text(encoding="utf-8")
        return parse_jsonl(text, SHIPPED[spec])
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"--prompts: {spec!r} is neither a shipped set ({', '.join(SHIPPED)}) nor a file")
    return parse_jsonl(path.read_text(encoding="utf-8"), str(path))
