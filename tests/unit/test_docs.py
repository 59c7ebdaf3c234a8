import re
from pathlib import Path

from raylora.config import reference_markdown

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE = re.compile(r"`[^`\n]*`")


def _pages(root: Path) -> list[Path]:
    return [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md"))]


def _links(page: Path) -> list[str]:
    """The link targets of a markdown page, leaving out code blocks and inline code."""
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return LINK.findall(text)


def test_config_reference_matches_the_schema(root):
    page = (root / "docs" / "config.md").read_text()
    block = page.split("<!-- config-reference:start -->\n")[1].split("\n<!-- config-reference:end -->")[0]
    assert block == reference_markdown()


def test_readme_shows_both_commands(root):
    readme = (root / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (root / ".ci" / "run").read_text()


def test_readme_is_short(root):
    lines = (root / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"


def test_relative_links_point_inside_the_repository(root):
    assert (root / "docs").is_dir()
    problems = []
    for page in _pages(root):
        for target in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # a URL, or a place on this page
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(root.resolve()):
                problems.append(f"{page.relative_to(root)}: {target} leaves the repository")
            elif not path.exists():
                problems.append(f"{page.relative_to(root)}: {target} does not exist")
    assert not problems, "\n".join(problems)
