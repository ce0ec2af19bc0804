"""A pause's scope is checked where it enters: a bad kind or tenant is one clear refusal."""

from __future__ import annotations

import re

import pytest

from enrichq_service.controls.errors import PauseError
from enrichq_service.controls.pauses import PauseScope


@pytest.mark.parametrize(
    ("kind", "tenant", "message"),
    [
        ("teleport", None, "--kind: 'teleport' is not a kind"),
        (None, "", "--tenant: must be 1 to 200 characters"),
        (None, "a\x1b[2Jb", "--tenant: must not contain control or format characters (U+001B)"),
        (None, "x" * 201, "--tenant: must be 1 to 200 characters"),
    ],
)
def test_bad_scopes_are_refused(kind: str | None, tenant: str | None, message: str) -> None:
    with pytest.raises(PauseError, match=re.escape(message)):
        PauseScope.build(kind=kind, tenant=tenant)
