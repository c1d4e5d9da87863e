"""Every relative link in README.md and docs/*.md points to a file that exists, and every `#anchor`
into a Markdown file to one of its headings (GitHub's slugs), so moving a section breaks a test, not
a reader's click."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target "title") and ![alt](target); the target may be wrapped in <...>
INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose_lines(text: str, keep_code: bool = False) -> list[str]:
    """The lines outside fenced code blocks, inline code removed unless `keep_code` (a heading's
    inline code is part of its anchor; a link inside inline code is no link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line if keep_code else INLINE_CODE.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but '-' and '_' dropped,
    spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The page's heading anchors, repeated headings numbered -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text(encoding="utf-8"), keep_code=True):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            out.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return out


def links(page: Path) -> list[str]:
    """The relative link targets of a page (external and empty ones left out)."""
    out = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        targets = INLINE_LINK.findall(line)
        reference = REFERENCE_LINK.match(line)
        targets += [reference.group(1)] if reference else []
        out += [t for t in targets if t and not EXTERNAL.match(t)]
    return out


def broken(page: Path, target: str, root: Path = ROOT) -> str | None:
    """Why `target`, linked from `page`, does not resolve inside `root` (None when it does)."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{page.name}: {target} -> no such file"
    if root not in dest.parents and dest != root:
        return f"{page.name}: {target} -> outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{page.name}: {target} -> no heading '#{anchor}' in {dest.name}"
    return None


def test_the_pages_exist_and_link_somewhere() -> None:
    assert (ROOT / "README.md").exists()
    assert len(PAGES) > 1, "docs/ holds no Markdown pages"
    assert sum(len(links(page)) for page in PAGES) > len(PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    problems = [why for target in links(page) if (why := broken(page, target))]
    assert not problems, "\n".join(problems)


def test_slugs_follow_github() -> None:
    assert slug("First run, choosing a model") == "first-run-choosing-a-model"
    assert slug("What a model needs: `localllm info`") == "what-a-model-needs-localllm-info"
    assert slug("Quantize, convert, perplexity") == "quantize-convert-perplexity"
    assert slug("The [OpenAI](https://openai.com) API") == "the-openai-api"


def test_a_missing_file_a_missing_heading_and_an_outside_file_are_caught(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    (tmp_path / "outside.md").write_text("# Outside\n", encoding="utf-8")
    page = root / "page.md"
    page.write_text("# Title\n\n## A section\n\n```\n## not a heading\n```\n", encoding="utf-8")
    assert anchors(page) == {"title", "a-section"}
    assert broken(page, "#a-section", root) is None
    assert "no heading" in (broken(page, "#not-a-heading", root) or "")
    assert "no such file" in (broken(page, "nowhere.md", root) or "")
    assert "outside" in (broken(page, "../outside.md", root) or "")
