"""The files a measuring tool leaves with ``--out OUT``: ``OUT.md`` (the command that made it,
then its markdown table) and ``OUT.json`` (the command and the tool's data)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any


def write_table_files(out: Path, tool: str, argv: list[str] | None, table: str, data: dict[str, Any]) -> str:
    """Write ``out.md`` and ``out.json`` for ``tools/<tool>`` (its path under tools/, and its
    subcommand where it has one: ``"fidelity.py grad"``) run with ``argv`` (None: this process's
    arguments); returns the command line recorded in both."""
    # quoted where an argument needs it (a variant's overrides, with spaces), so the line runs as written
    command = f"python tools/{tool} " + shlex.join(argv if argv is not None else sys.argv[1:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(f"Command: `{command}`\n\n{table}")
    out.with_suffix(".json").write_text(json.dumps({"command": command, **data}, indent=2) + "\n")
    return command
