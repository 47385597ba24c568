"""The README and docs/ link to each other by section: every relative link names a file that
exists and, after `#`, a heading it has (as GitHub makes anchors of headings)."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `#` in a code block is no heading
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_in_the_docs_reaches_its_file_and_section():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_readme_stays_an_introduction():
    """What it is, the two commands, compose in brief, a short path to several machines, links:
    figures live in docs/performance.md, the walkthroughs in docs/operations.md."""
    assert len((ROOT / "README.md").read_text().splitlines()) < 200
