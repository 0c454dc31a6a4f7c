"""The documentation: every doc linked from the README, links resolve, no machine paths (the key tables: test_schema_home)."""

import re

from tests.conftest import ROOT

DOCS = ROOT / "docs"


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
