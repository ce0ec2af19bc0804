"""Reading EXPLAIN (FORMAT JSON) plans: the nodes, the indexes, the rows a scan read."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa

SCAN_TYPES = {"Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Tid Scan"}


def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of a plan tree, depth first."""
    yield node
    for child in node.get("Plans", []):
        yield from walk(child)


def explain(
    conn: sa.Connection,
    sql: str,
    params: dict[str, Any],
    *,
    analyze: bool = False,
    generic: bool = False,
) -> dict[str, Any]:
    """The JSON plan of `sql` (ANALYZE runs it: roll back after).

    By default the plan is made with the parameter values, as for an unprepared statement.
    `generic=True` gives the plan a prepared statement keeps once Postgres stops planning
    it per call (what the claim engine's sessions force, and what `auto` may choose for
    the statements marked `prepared`): the statement is PREPAREd with `$n` parameters and
    EXPLAINed through EXECUTE under plan_cache_mode = force_generic_plan.
    """
    options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
    if not generic:
        raw = conn.execute(sa.text(f"EXPLAIN ({options}) {sql}"), params).scalar_one()
    else:
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        body = PARAMETER.sub(number, sql)
        values = ", ".join(sql_literal(params[name]) for name in names)
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE generic_probe AS {body}")
        try:
            raw = conn.exec_driver_sql(
                f"EXPLAIN ({options}) EXECUTE generic_probe({values})"
            ).scalar_one()
        finally:
            conn.exec_driver_sql("DEALLOCATE generic_probe")
    document = json.loads(raw) if isinstance(raw, str) else raw
    plan: dict[str, Any] = document[0]["Plan"]
    return plan


PARAMETER = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def sql_literal(value: object) -> str:
    """A parameter value as SQL text, for EXECUTE's arguments (test values only). Arrays are
    untyped array literals, so they take the type the statement casts its parameter to."""
    if value is None:
        return "NULL"
    if isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, list):
        items = (
            "NULL" if v is None else '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
            for v in value
        )
        return sql_literal("{" + ",".join(items) + "}")
    raise TypeError(f"no literal for {value!r}")


def scans_of(plan: dict[str, Any], relation: str) -> list[dict[str, Any]]:
    """The nodes that read `relation` (not the ones that write it)."""
    return [
        n for n in walk(plan) if n["Node Type"] in SCAN_TYPES and n.get("Relation Name") == relation
    ]


def queue_scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes that read enrichq.queue (not the ones that write it)."""
    return scans_of(plan, "queue")


def indexes_used(plan: dict[str, Any]) -> set[str]:
    """Names of the queue's indexes a plan reads, bitmap index scans included."""
    names = {n["Index Name"] for n in queue_scans(plan) if "Index Name" in n}
    for heap in (n for n in queue_scans(plan) if n["Node Type"] == "Bitmap Heap Scan"):
        names |= {n["Index Name"] for n in walk(heap) if n["Node Type"] == "Bitmap Index Scan"}
    return names


def work(
    plan: dict[str, Any], index_filter: Callable[[str], bool], relation: str = "queue"
) -> tuple[float, int]:
    """Rows read (kept or filtered away, all loops) and buffers touched by the scans of
    `relation` through matching indexes; a sequential scan counts whatever the filter."""
    rows, blocks = 0.0, 0
    for node in scans_of(plan, relation):
        name = node.get("Index Name")
        if node["Node Type"] == "Seq Scan" or (name is not None and index_filter(name)):
            per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            rows += per_loop * node["Actual Loops"]
            blocks += node["Shared Hit Blocks"] + node["Shared Read Blocks"]
    return rows, blocks
