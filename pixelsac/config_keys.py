"""Every configuration key with its default and its meaning, read from the comments in ``conf/``.

``conf/config.yaml`` is the one place a key's meaning is written: the comment after it (and any
comment lines below it, indented past the key) is its meaning, the comment after a group's
name is the group's. :func:`read_keys` reads them back so that ``pixelsac-train --help`` and
``docs/configuration.md`` (``tools/config_doc.py``) say the same thing, and a key without a
comment is found by a test. Standard library and PyYAML only: ``--help`` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Key:
    """One key (or group) of a configuration file."""

    name: str  # dotted, e.g. "agent.batch_size"
    default: Any  # YAML-typed; None for a group
    meaning: str  # the comment, joined into one line ("" when there is none)
    is_group: bool = False

    @property
    def default_text(self) -> str:
        """The default as written on the command line (``null``, ``true``, ``0.001``)."""
        if self.is_group:
            return ""
        return yaml.safe_dump(self.default, default_flow_style=True).strip().removesuffix("...").strip()

    @property
    def summary(self) -> str:
        """The meaning's first sentence-ish part: up to the first ``;`` or ``(`` that ends a clause,
        at most ~90 characters -- one line of ``--help``."""
        text = self.meaning
        if len(text) <= 90:
            return text
        cut = text[:90]
        for mark in ("; ", ". ", " (", ", "):
            at = cut.rfind(mark)
            if at > 30:
                return cut[:at].rstrip(" ;,.") + " ..."
        return cut.rsplit(" ", 1)[0].rstrip(" ;,.") + " ..."


def _split_comment(line: str) -> tuple[str, str]:
    """``'  key: value   # meaning'`` -> (``'  key: value'``, ``'meaning'``); a ``#`` inside quotes
    is part of the value."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def parse(text: str) -> tuple[str, list[Key]]:
    """The file's header comment and its keys, in file order (groups before their keys)."""
    values = yaml.safe_load(text) or {}
    header: list[str] = []
    keys: list[tuple[str, list[str], bool]] = []  # name, comment parts, is_group
    stack: list[tuple[int, str]] = []  # (indent, group name) of the open groups
    last_indent = -1
    for raw in text.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        body, comment = _split_comment(raw)
        if not body.strip():  # a comment line
            if not keys:
                header.append(comment)
            elif indent > last_indent:  # continues the comment of the key above
                keys[-1][1].append(comment)
            continue
        name, sep, value = body.strip().partition(":")
        if not sep:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([g for _, g in stack] + [name.strip()])
        is_group = not value.strip()
        keys.append((dotted, [comment] if comment else [], is_group))
        if is_group:
            stack.append((indent, name.strip()))
        last_indent = indent
    result = []
    for dotted, parts, is_group in keys:
        node: Any = values
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        result.append(Key(dotted, None if is_group else node, " ".join(parts), is_group))
    return " ".join(header), result


def read_keys(path: Path) -> list[Key]:
    """The keys of one configuration file (see :func:`parse`)."""
    return parse(path.read_text())[1]


def help_text(path: Path, width: int = 34) -> str:
    """Every group and key of ``path`` with its default and the first part of its meaning, one
    line each (what ``pixelsac-train --help`` lists)."""
    lines = []
    for key in read_keys(path):
        if key.is_group:
            lines.append(f"\n{key.name}.*  {key.summary}".rstrip())
            continue
        shown = f"{key.name}={key.default_text}"
        indent = "  " if "." in key.name else ""
        lines.append(f"{indent}{shown:<{width}} {key.summary}".rstrip())
    return "\n".join(lines).lstrip("\n")
