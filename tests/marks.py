"""Marker files that the helper scripts write and the tests poll for."""

from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` aside and rename it into place: a test polling ``path.exists()`` must never
    read the file while it is still empty (CI once did, between create and write)."""
    aside = path.with_name(path.name + ".partial")
    aside.write_text(text)
    aside.replace(path)
