"""`enrichq demo`: a help desk, a warehouse and legacy output seeded, enrichq run in
shadow, parity reported (`enrichq_service.demo`)."""

from __future__ import annotations

from enrichq_service.commands.base import Context


def demo(ctx: Context, *, keep_running: bool, tickets: int) -> int:
    """The demo's exit code."""
    from enrichq_service.demo import run_demo

    settings = ctx.settings
    with ctx.database() as url:
        return run_demo(settings, url, keep_running=keep_running, tickets=tickets)
