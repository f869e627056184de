"""The warm-up corpus (``kvstrata warmup --prompts FILE``): JSONL, one ``{"prompt": "..."}`` or
``{"prompt_token_ids": [...]}`` per line, checked whole before any work; a bad line is an error
naming its file and line number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstrata.tools.cli import CLIError


@dataclass(frozen=True)
class Prompt:
    line: int
    text: str | None
    token_ids: list[int] | None


class CorpusError(ValueError):
    """A corpus line is not a prompt; the message names the file and line."""


def parse_line(path: Path, lineno: int, line: str) -> Prompt | None:
    if not line.strip():
        return None
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise CorpusError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise CorpusError(f'{where}: expected exactly one of "prompt" or "prompt_token_ids"')
    if has_text:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise CorpusError(f'{where}: "prompt" must be a non-empty string')
        return Prompt(lineno, text, None)
    ids = obj["prompt_token_ids"]
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise CorpusError(f'{where}: "prompt_token_ids" must be a non-empty list of token ids (ints >= 0)')
    return Prompt(lineno, None, ids)


def read_corpus(path: Path) -> Iterator[Prompt]:
    """The prompts of ``path`` in order (streamed); CorpusError on the first bad line."""
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                prompt = parse_line(path, lineno, line)
                if prompt is not None:
                    yield prompt
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not UTF-8 text ({exc.reason})") from None


@dataclass(frozen=True)
class CorpusSummary:
    prompts: int
    text_prompts: int


def validate_corpus(path: Path) -> CorpusSummary:
    """Read the whole corpus once; CLIError naming the first bad line."""
    if not path.is_file():
        raise CLIError(f"no prompts file at {path}")
    count = text = 0
    try:
        for prompt in read_corpus(path):
            count += 1
            text += prompt.text is not None
    except CorpusError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not count:
        raise CLIError(f"{path} holds no prompts")
    return CorpusSummary(count, text)
