"""docs/rules.md is generated from the rule list and must match it."""

from __future__ import annotations

from lptrain.config.compose import repo_root
from lptrain.config.render import rules_markdown
from lptrain.config.rules import all_rules


def test_committed_rules_page_is_current() -> None:
    page = (repo_root() / "docs" / "rules.md").read_text()
    assert page == rules_markdown(), (
        "docs/rules.md is stale: regenerate with `lptrain rules --markdown > docs/rules.md`"
    )


def test_every_rule_is_on_the_page() -> None:
    page = rules_markdown()
    for r in all_rules():
        assert f"| {r.id} | {r.severity} |" in page
