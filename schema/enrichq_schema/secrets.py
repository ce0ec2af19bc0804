"""Secrets that must never reach an operator's screen, a log line or a stored error: URLs
redacted, and every secret the settings hold masked wherever it appears."""

from __future__ import annotations

import threading

from sqlalchemy.engine import URL, make_url

# libpq connection options whose value is a secret (passfile and sslkey name files: the
# file's contents are the secret, and enrichq never prints them)
SECRET_OPTIONS = frozenset({"password", "sslpassword"})
MASK = "***"
# shorter values would mask ordinary words of a message; libpq and webhook secrets are longer
MIN_REMEMBERED = 4


class _Remembered:
    """The process's secrets, longest first (a secret that contains another is masked whole);
    replaced whole under a lock, read without one."""

    lock = threading.Lock()
    values: tuple[str, ...] = ()


def redacted_url(url: str | URL) -> str:
    """The URL as an operator may see it: its password and secret options masked."""
    parsed = make_url(url)
    hidden = {name: MASK for name in parsed.query if name.lower() in SECRET_OPTIONS}
    if hidden:
        parsed = parsed.update_query_dict(hidden)
    # the query's mask comes back percent-encoded; the userinfo's is written as it is
    return parsed.render_as_string(hide_password=True).replace("%2A%2A%2A", MASK)


def secrets_of_url(url: str | URL) -> list[str]:
    """The secret values a URL holds: its password and its secret options' values."""
    parsed = make_url(url)
    found = [] if parsed.password is None else [str(parsed.password)]
    for name, value in parsed.query.items():
        if name.lower() in SECRET_OPTIONS:
            found.extend([value] if isinstance(value, str) else list(value))
    return found


def remember(*values: str) -> None:
    """Mask these values in every line `scrubbed` sees from now on, in this process."""
    kept = {v for v in values if len(v) >= MIN_REMEMBERED}
    if not kept - set(_Remembered.values):
        return
    with _Remembered.lock:
        _Remembered.values = tuple(sorted({*_Remembered.values, *kept}, key=len, reverse=True))


def scrubbed(text: str) -> str:
    """`text` with every remembered secret masked."""
    for secret in _Remembered.values:
        if secret in text:
            text = text.replace(secret, MASK)
    return text
