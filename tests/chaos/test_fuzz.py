"""The generative fault harness (`tests/chaos/fuzz.py`), bounded for CI: a fixed set of
draws, without the behaviours and faults of KNOWN_DEFECTS. More draws:
`python -m tests.chaos.fuzz --draws N --seed S`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.fuzz import CONDITIONS, FAULTS, KNOWN_DEFECTS, MODES, describe, draw, run_draw
from tests.support.behaviours import BEHAVIOURS
from tests.support.pg import Databases

# Seeds chosen to cover every mode (per ticket, batches of 1 and 50), a budget, a cap, a
# database restart, lost COMMIT replies and a blackhole between them; about 90 s in all.
CI_SEEDS = (10, 15, 25, 168)


@pytest.mark.slow
@pytest.mark.parametrize("seed", CI_SEEDS)
def test_draw_keeps_every_invariant(seed: int, databases: Databases, tmp_path: Path) -> None:
    result = run_draw(draw(seed, exclude=KNOWN_DEFECTS), databases, tmp_path, KNOWN_DEFECTS)
    assert result.violations == [], describe(result)


def test_a_seed_reproduces_its_draw() -> None:
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_the_ci_seeds_cover_modes_settings_and_faults() -> None:
    draws = [draw(seed, exclude=KNOWN_DEFECTS) for seed in CI_SEEDS]
    assert {d.mode for d in draws} == set(MODES)
    assert any(d.budget for d in draws)
    assert any(d.cap for d in draws)
    struck = {kind for d in draws for _, kind in d.faults}
    assert {"db_restart", "blackhole"} <= struck, struck
    assert struck & {"drop_claim_reply", "drop_settle_reply"}, struck


def test_excluded_behaviours_and_faults_are_never_drawn() -> None:
    excluded = KNOWN_DEFECTS | {"exit_always", "permanent", "sigkill"}
    for seed in range(200):
        d = draw(seed, exclude=excluded)
        assert not excluded & set(d.behaviours)
        assert not excluded & {kind for _, kind in d.faults}
    assert excluded <= {*BEHAVIOURS, *FAULTS, *CONDITIONS}


def test_the_report_puts_the_harness_section_in_and_replaces_it() -> None:
    from tests.chaos.report import FUZZ_HEADING, replace_section

    doc = "# Reliability\n\ntable\n\n## How long a blackholed connection hangs\n\nrows\n"
    once = replace_section(doc, [FUZZ_HEADING, "", "draws 1", ""])
    assert once.index(FUZZ_HEADING) < once.index("## How long")
    twice = replace_section(once, [FUZZ_HEADING, "", "draws 2", ""])
    assert "draws 2" in twice
    assert "draws 1" not in twice
    assert twice.count(FUZZ_HEADING) == 1
    assert twice.endswith("## How long a blackholed connection hangs\n\nrows\n")


def test_the_cap_check_excuses_only_what_a_freeze_leaves_running() -> None:
    """The harness's cap oracle (cap 1, a 2 s deadline, worker 7 frozen at t=100, worker 8
    not): the frozen worker's queries, and its isolated child's, may run beside the next
    lookup until the deadline (and the child's overrun) has passed; another worker's query
    beyond the cap is a violation, as is anything seen past that reach. In a partition
    (every worker cut off) a query begun before it is excused."""
    from types import SimpleNamespace

    from tests.chaos.fuzz import _check_cap

    d = SimpleNamespace(cap=1, deadline_seconds=2.0)
    h = SimpleNamespace(frozen=[(100.0, 101.0, 7)], cut_off=[])

    def check(seen: float, *queries: tuple[tuple[int, ...], float]) -> list[str]:
        running = [
            (i, "enrichq-warehouse", "SELECT", seen - began, lineage)
            for i, (lineage, began) in enumerate(queries)
        ]
        return _check_cap(d, h, SimpleNamespace(over=[(seen, running)]))  # type: ignore[arg-type]

    frozen, its_child, other = (7, 1), (70, 7, 1), (8, 1)
    assert check(101.5, (frozen, 99.0), (other, 101.2)) == []
    assert check(101.5, (frozen, 99.0), (frozen, 99.5), (other, 101.2)) == []  # two slots
    assert check(101.5, (its_child, 100.8), (other, 101.2)) == []
    assert check(101.5, (other, 99.0), (other, 101.2)) != []  # not the frozen worker's
    assert check(101.5, (frozen, 99.0), (other, 99.0), (other, 101.2)) != []
    assert check(110.0, (frozen, 99.0), (other, 109.0)) != []  # long past the deadline
    assert check(101.5, ((), 99.0), (other, 101.2)) == []  # not told: begun before
    assert check(101.5, ((), 100.8), (other, 101.2)) != []
    h.frozen, h.cut_off = [], [(100.0, 101.0)]  # a partition: everyone's, begun before
    assert check(101.5, (other, 99.0), (other, 101.2)) == []
    assert check(101.5, (other, 100.8), (other, 101.2)) != []
