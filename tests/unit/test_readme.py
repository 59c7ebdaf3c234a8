from raylora.config import reference_markdown


def test_readme_config_reference_matches_the_schema(root):
    readme = (root / "README.md").read_text()
    block = readme.split("<!-- config-reference:start -->\n")[1].split("\n<!-- config-reference:end -->")[0]
    assert block == reference_markdown()


def test_readme_shows_both_commands(root):
    readme = (root / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (root / ".ci" / "run").read_text()
