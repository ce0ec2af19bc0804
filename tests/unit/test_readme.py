"""The README stays true: every setting is documented and CI runs the test command it shows."""

from __future__ import annotations

from pathlib import Path

from enrichq_schema.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_in_the_readme_table() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    missing = [
        f"ENRICHQ_{name.upper()}"
        for name in Settings.model_fields
        if f"`ENRICHQ_{name.upper()}`" not in readme
    ]
    assert missing == []


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert ".venv/bin/pytest" in readme
    assert ".venv/bin/pytest" in ci
    assert "pip install -q -e '.[test]'" in readme
    assert "pip install -q -e '.[test]'" in ci
