"""The parity report's files: its template and stylesheet ship as package data."""

from __future__ import annotations


def test_the_template_ships_in_the_package() -> None:
    """The report's template and stylesheet are package data, read through importlib."""
    from importlib import resources

    folder = resources.files("enrichq_parity").joinpath("templates")
    assert folder.joinpath("report.html.j2").is_file()
    assert folder.joinpath("report.css").is_file()
