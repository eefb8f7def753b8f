"""The front door: every configuration key is documented (and docs/configuration.md is what
tools/config_doc.py writes from conf/); the README is a short guide with no absolute paths and no
links that leave the repository; every relative link in the README and docs/ resolves."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import yaml
from conftest import REPO

from pixelsac.config_keys import read_keys

CONFIG_DOC = REPO / "docs" / "configuration.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
FRONT = [REPO / "README.md", REPO / "CHANGELOG.md", *PAGES]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _flat(tree, prefix=""):
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flat(value, name + ".")
        else:
            yield name


def _config_doc_tool():
    spec = importlib.util.spec_from_file_location("pixelsac_tools_config_doc", REPO / "tools" / "config_doc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,prefix", [("config", ""), ("evaluate", ""), ("bench", "bench.")])
def test_every_config_key_has_a_meaning_and_appears_in_configuration_md(name, prefix):
    path = REPO / "conf" / f"{name}.yaml"
    keys = {key.name: key for key in read_keys(path)}
    text = CONFIG_DOC.read_text()
    for dotted in _flat(yaml.safe_load(path.read_text())):  # YAML's own view: the parser misses nothing
        assert dotted in keys, f"{path.name}: {dotted} not parsed"
        assert keys[dotted].meaning, f"{path.name}: {dotted} has no comment saying what it means"
        assert f"| `{prefix}{dotted}` |" in text, f"{prefix}{dotted} is not in docs/configuration.md"


def test_configuration_md_is_what_the_tool_writes():
    assert CONFIG_DOC.read_text() == _config_doc_tool().render(REPO / "conf"), (
        "docs/configuration.md is out of date: run .venv/bin/python tools/config_doc.py"
    )


def test_readme_is_a_short_guide():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    headings = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    order = ["Quickstart", "Training", "Precision", "Outputs", "Stop and resume", "Results", "Citation", "Licence"]
    assert [h for h in headings if h in order] == order
    for page in PAGES:  # every docs page is reachable from the README
        assert f"(docs/{page.name})" in text, page.name


@pytest.mark.parametrize("path", FRONT, ids=lambda p: p.name)
def test_no_absolute_paths_no_outside_links_and_every_link_resolves(path):
    text = path.read_text()
    assert not re.search(r"(?<![\w.])/(work|home|tmp|Users|root|mnt)/", text), "absolute path"
    assert "../shared" not in text and not re.search(r"\bsession\b", text, re.IGNORECASE)
    anchors = {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in text.splitlines()
        if line.startswith("#")
    }
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://")):
            assert path.name != "README.md", f"README links outside the repository: {target}"
            continue
        file, _, anchor = target.partition("#")
        if not file:
            assert anchor in anchors, f"{path.name}: no heading for #{anchor}"
            continue
        resolved = (path.parent / file).resolve()
        assert resolved.exists(), f"{path.name}: {target} does not resolve"
        assert resolved.is_relative_to(REPO), f"{path.name}: {target} leaves the repository"
