"""The documentation: every schema key in docs/configuration.md, every doc linked from the README."""

import dataclasses
import re

from tests.conftest import ROOT

DOCS = ROOT / "docs"


def run_schema():
    """The run-config schema wherever it lives (its own module after the config split, else training.config)."""
    try:
        from training.schema import RunSchema
    except ImportError:
        from training.config import RunSchema
    return RunSchema


def schema_keys(node, prefix: str = "") -> list[str]:
    """Every leaf key of a schema dataclass, dotted ("train.steps")."""
    keys = []
    for f in dataclasses.fields(node):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_schema_key_is_documented():
    keys = schema_keys(run_schema())
    assert len(keys) > 50 and "train.steps" in keys and "logger.mode" in keys
    documented = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", (DOCS / "configuration.md").read_text(), re.M))
    missing = [key for key in keys if key not in documented]
    assert not missing, f"add these keys to docs/configuration.md: {missing}"


def test_the_readme_links_every_doc_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    for doc in sorted(DOCS.glob("*.md")):
        assert f"(docs/{doc.name})" in readme, f"README.md does not link docs/{doc.name}"
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_docs_name_no_absolute_paths():
    for page in DOCS.glob("*.md"):
        assert not re.search(r"(?<![\w.])/(work|home|tmp|Users)/", page.read_text()), page.name
