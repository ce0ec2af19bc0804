"""One line for the operator on stderr: how every enrichq process speaks outside its log."""

from __future__ import annotations

import sys
from typing import TextIO


def say(message: str, stream: TextIO | None = None) -> None:
    """Tell the operator one line on stderr (or `stream`), secrets scrubbed."""
    from enrichq_schema.secrets import scrubbed

    print(scrubbed(f"enrichq: {message}"), file=sys.stderr if stream is None else stream)
