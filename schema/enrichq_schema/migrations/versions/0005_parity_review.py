"""parity review: verdicts by fault, accepted rules, approvals, staged cutover per tenant

parity_runs gains the fault figures of a run (shadow faults and their rate and bar, legacy
faults and how many an accepted rule covers) and the accept file it applied; runs recorded
before this revision keep NULL rates, which the cutover gate reads as "not judged by fault".
parity_approvals holds reviewers' signatures. cutover_events names the tenant a step moved
(NULL: every tenant), and enrichq_public.cutover_tenants lists the tenants whose consumers
read enrichq's rows while a cutover is staged.

Every change adds a column with a constant default, a table or a constraint that old rows
meet, so no table is rewritten; the ACCESS EXCLUSIVE locks are held briefly once granted,
but writers queue behind each one while it waits for a reader to finish.

Downgrade loses: every reviewer's approval, the fault figures and accept rules of every
parity run, and which tenant each cutover step moved (refused while a cutover is staged
per tenant: `enrichq cutover --rollback` first).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 21:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VIEW = "enrichq_public.ticket_orders"


def upgrade() -> None:
    """Apply this revision."""
    for name, type_, default in (
        ("shadow_faults", sa.BigInteger(), "0"),
        ("shadow_fault_rate", sa.Float(), None),
        ("max_shadow_fault_rate", sa.Float(), None),
        ("legacy_faults", sa.BigInteger(), "0"),
        ("accepted_legacy_faults", sa.BigInteger(), "0"),
        ("accept_rules", sa.Integer(), "0"),
        ("accept_sha256", sa.Text(), None),
    ):
        op.add_column(
            "parity_runs",
            sa.Column(name, type_, server_default=default, nullable=default is None),
            schema="enrichq",
        )
    op.create_check_constraint(
        op.f("parity_runs_accepted_within_faults"),
        "parity_runs",
        "accepted_legacy_faults BETWEEN 0 AND legacy_faults",
        schema="enrichq",
    )
    op.create_table(
        "parity_approvals",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("parity_run_id", sa.BigInteger(), nullable=False),
        sa.Column("approved_by", sa.Text(), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column(
            "approved_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "char_length(approved_by) BETWEEN 1 AND 200",
            name=op.f("parity_approvals_approver_length"),
        ),
        sa.CheckConstraint(
            "note IS NULL OR char_length(note) <= 2000", name=op.f("parity_approvals_note_length")
        ),
        sa.ForeignKeyConstraint(
            ["parity_run_id"],
            ["enrichq.parity_runs.id"],
            name=op.f("parity_approvals_parity_run_id_fkey"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("parity_approvals_pkey")),
        sa.UniqueConstraint(
            "parity_run_id",
            "approved_by",
            name=op.f("parity_approvals_parity_run_id_approved_by_key"),
        ),
        schema="enrichq",
    )
    op.add_column("cutover_events", sa.Column("tenant", sa.Text(), nullable=True), schema="enrichq")
    op.create_table(
        "cutover_tenants",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["event_id"], ["enrichq.cutover_events.id"], name=op.f("cutover_tenants_event_id_fkey")
        ),
        sa.PrimaryKeyConstraint("tenant", name=op.f("cutover_tenants_pkey")),
        schema="enrichq_public",
    )


def downgrade() -> None:
    """Revert this revision; refused while a staged cutover's view reads cutover_tenants."""
    bind = op.get_bind()
    staged = bind.execute(
        sa.text(
            "SELECT EXISTS (SELECT 1 FROM pg_depend AS d JOIN pg_rewrite AS r ON r.oid = d.objid"
            " WHERE d.classid = CAST('pg_rewrite' AS regclass)"
            " AND d.refobjid = to_regclass('enrichq_public.cutover_tenants')"
            " AND r.ev_class = to_regclass(:view))"
        ),
        {"view": VIEW},
    ).scalar_one()
    if staged:
        raise RuntimeError(
            f"{VIEW} reads enrichq_public.cutover_tenants (a staged cutover): run "
            "`enrichq cutover --rollback` before downgrading below 0005"
        )
    op.drop_table("cutover_tenants", schema="enrichq_public")
    op.drop_column("cutover_events", "tenant", schema="enrichq")
    op.drop_table("parity_approvals", schema="enrichq")
    op.drop_constraint(
        op.f("parity_runs_accepted_within_faults"), "parity_runs", schema="enrichq", type_="check"
    )
    for name in (
        "accept_sha256",
        "accept_rules",
        "accepted_legacy_faults",
        "legacy_faults",
        "max_shadow_fault_rate",
        "shadow_fault_rate",
        "shadow_faults",
    ):
        op.drop_column("parity_runs", name, schema="enrichq")
