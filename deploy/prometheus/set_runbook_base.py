#!/usr/bin/env python3
"""Set the base of every alert's runbook_url, the one place it is configured.

The base is the address where your operators read docs/operations.md (your fork, your git
host, your wiki); each alert links to it plus `#` and the alert's anchor. It lives in
runbook-base.txt beside this script; Prometheus rule files cannot template it, so this
script writes it into every `runbook_url:` of rules/*.yml and of the rule tests
tests/*.yml (which must expect the same links).

    python3 deploy/prometheus/set_runbook_base.py https://git.example.com/ops/enrichq/blob/main/docs/operations.md
    python3 deploy/prometheus/set_runbook_base.py           # re-apply runbook-base.txt
    python3 deploy/prometheus/set_runbook_base.py --check   # exit 1 if a link disagrees

Standard library only, so it runs wherever the deploy files are.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_FILE = HERE / "runbook-base.txt"
URL_LINE = re.compile(
    r"^(?P<lead>\s*runbook_url:\s*)(?P<base>[^\s#]+)#(?P<anchor>[a-z0-9-]+)\s*$", re.M
)
BASE = re.compile(r"https?://[^\s#]+")


def files() -> list[Path]:
    return sorted([*(HERE / "rules").glob("*.yml"), *(HERE / "tests").glob("*.yml")])


def read_base() -> str:
    return BASE_FILE.read_text(encoding="utf-8").strip()


def disagreements(base: str) -> list[str]:
    """`file: line` for every runbook_url that is not `base#anchor` on one unquoted line
    (a quoted or folded link would escape the rewrite, so it counts as one)."""
    wrong = []
    for path in files():
        for line in path.read_text(encoding="utf-8").splitlines():
            if "runbook_url" not in line or line.lstrip().startswith("#"):
                continue
            m = URL_LINE.fullmatch(line)
            if m is None or m.group("base") != base:
                wrong.append(f"{path.relative_to(HERE)}: {line.strip()}")
    return wrong


def apply(base: str) -> int:
    """Write `base` into every runbook_url; the number of files changed."""
    changed = 0
    for path in files():
        text = path.read_text(encoding="utf-8")
        new = URL_LINE.sub(lambda m: f"{m.group('lead')}{base}#{m.group('anchor')}", text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed += 1
    return changed


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        wrong = disagreements(read_base())
        for line in wrong:
            print(f"runbook_url not under {read_base()}: {line}", file=sys.stderr)
        return 1 if wrong else 0
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: set_runbook_base.py [BASE_URL | --check]", file=sys.stderr)
        return 2
    base = argv[0].rstrip("/") if argv else read_base()
    if not BASE.fullmatch(base):
        print(f"not an http(s) URL without '#' or spaces: {base!r}", file=sys.stderr)
        return 2
    BASE_FILE.write_text(base + "\n", encoding="utf-8")
    changed = apply(base)
    print(f"runbook base {base}: {changed} file(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
