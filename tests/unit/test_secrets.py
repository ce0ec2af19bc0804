"""Secrets never show: a database URL's passwords and the settings' secrets are hidden
in what is logged or printed."""

from __future__ import annotations

from enrichq_schema.db import redact
from enrichq_schema.settings import Settings

SECRET = "S3cr3tPw-do-not-print"


def test_redact_and_safe_dump_hide_every_secret() -> None:
    url = f"postgresql://u:{SECRET}@h/db?sslpassword={SECRET}&password={SECRET}&sslmode=require"
    assert SECRET not in redact(url)
    assert "sslmode=require" in redact(url)
    dumped = Settings(database_url=url, webhook_secret=SECRET).safe_dump()
    assert SECRET not in repr(dumped)
