"""Long real-text prompts for the demo and the end-to-end benchmark, available offline.

The text is Python's own standard library source (always installed next to the interpreter), read
in a fixed module order so every process and every machine with the same Python builds the same
prompt. Prompts are token ids built with the model's ``tokenizer.json`` (the ``tokenizers``
library: fast to import, no transformers) and its chat template, to an exact token count.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Plain-prose-heavy modules first (docstrings read like text), then larger ones to reach 8k+.
STDLIB_MODULES = (
    "textwrap", "shlex", "string", "heapq", "bisect", "fractions", "argparse", "difflib",
    "calendar", "configparser", "pprint", "dataclasses",
)
DEFAULT_QUESTION = (
    "The text above is part of the Python standard library's source code. "
    "In two sentences, what does the first module do?"
)
_MARKER = "\x00KVSTRATA-DOCUMENT\x00"


class CorpusError(RuntimeError):
    """The prompt text or the tokenizer is not available."""


def stdlib_text(min_chars: int = 200_000) -> str:
    """Concatenated stdlib sources (each headed by its file name), at least ``min_chars`` long."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        try:
            src = path.read_text(encoding="utf-8")
        except OSError:
            continue  # a trimmed install: use what is there
        parts.append(f"# ===== {name}.py =====\n{src}")
        total += len(src)
        if total >= min_chars:
            break
    if not parts:
        raise CorpusError(f"no Python standard library sources under {root}")
    return "\n".join(parts)


@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    document_tokens: int
    question: str


def chat_prompt(model_dir: Path, prompt_tokens: int, question: str = DEFAULT_QUESTION) -> ChatPrompt:
    """Exactly ``prompt_tokens`` token ids: the chat template around (stdlib text + question).

    The document is cut to fit, so a longer prompt shares its whole shorter prefix with a shorter
    one's document part. Without a chat template the parts are simply concatenated.
    """
    from tokenizers import Tokenizer

    tok_file = Path(model_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise CorpusError(f"{model_dir} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tok_file))
    head, tail = _template_parts(Path(model_dir))
    head_ids = tokenizer.encode(head, add_special_tokens=False).ids
    tail_ids = tokenizer.encode("\n\n" + question + tail, add_special_tokens=False).ids
    room = prompt_tokens - len(head_ids) - len(tail_ids)
    if room < 1:
        raise CorpusError(f"prompt_tokens={prompt_tokens} leaves no room for the document")
    doc_ids: list[int] = []
    chars = max(200_000, room * 6)
    while len(doc_ids) < room:
        text = stdlib_text(chars)
        doc_ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(text) < chars:  # every module used and still short
            break
        chars *= 2
    if len(doc_ids) < room:
        raise CorpusError(f"only {len(doc_ids)} tokens of stdlib text available, need {room}")
    ids = head_ids + doc_ids[:room] + tail_ids
    return ChatPrompt(token_ids=ids, document_tokens=room, question=question)


def _template_parts(model_dir: Path) -> tuple[str, str]:
    """The chat template rendered around a marker: (text before the user content, after it)."""
    template = _chat_template(model_dir)
    if template is None:
        return "", ""
    import jinja2

    env = jinja2.Environment(keep_trailing_newline=True)
    rendered = env.from_string(template).render(
        messages=[{"role": "user", "content": _MARKER}], add_generation_prompt=True,
        bos_token="", eos_token="")
    head, _, tail = rendered.partition(_MARKER)
    return head, tail


def _chat_template(model_dir: Path) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    cfg_file = model_dir / "tokenizer_config.json"
    if cfg_file.is_file():
        template = json.loads(cfg_file.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return None
