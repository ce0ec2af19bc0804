"""Lease recovery's hook is loaded by path: a bad path is a one-line error."""

from __future__ import annotations

import pytest

from enrichq_sweeper import recovery
from enrichq_sweeper.errors import HookError


def test_unknown_hook_path_is_a_one_line_error() -> None:
    with pytest.raises(HookError, match="cannot import"):
        recovery.load_hook("tests.no_such_module:hook")
    with pytest.raises(HookError, match="has no function"):
        recovery.load_hook("tests.unit.test_sweeper_recovery:no_such_hook")
