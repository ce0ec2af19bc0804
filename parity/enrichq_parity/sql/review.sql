-- The review of parity runs: reviewers' approvals and the list of recorded runs.

-- name: review_run_for_approval
-- The run :id as an approval judges it (locked against a concurrent delete); none: unknown.
SELECT id, finished_at, passed, max_shadow_fault_rate, min_order_coverage,
       min_ticket_match_rate, report -> 'total' AS total, report -> 'tenants' AS tenants,
       report ->> 'error' AS error
FROM enrichq.parity_runs
WHERE id = :id
FOR SHARE

-- name: review_approve
-- Records :approved_by's approval of run :run_id; no row when they approved it already
-- (under that name in any case: :reviewer_key is the name case-folded).
INSERT INTO enrichq.parity_approvals (
    parity_run_id, approved_by, reviewer_key, note, approved_at
) VALUES (
    :run_id, :approved_by, :reviewer_key, :note, coalesce(CAST(:now AS timestamptz), now())
)
ON CONFLICT (parity_run_id, reviewer_key) DO NOTHING
RETURNING id, approved_at

-- name: review_approval_by
-- The approval of run :run_id by the reviewer whose case-folded name is :reviewer_key.
SELECT approved_by, note, approved_at
FROM enrichq.parity_approvals
WHERE parity_run_id = :run_id AND reviewer_key = :reviewer_key

-- name: review_approvals
-- Every approval of the runs :run_ids, oldest first.
SELECT parity_run_id, approved_by, note, approved_at
FROM enrichq.parity_approvals
WHERE parity_run_id = ANY(CAST(:run_ids AS bigint[]))
ORDER BY approved_at, id

-- name: review_latest_finished
-- The id of the latest finished run (the one cutover judges), if any.
SELECT id FROM enrichq.parity_runs
WHERE finished_at IS NOT NULL
ORDER BY finished_at DESC, id DESC
LIMIT 1

-- name: review_runs
-- The :limit most recent runs, newest first, with what a listing shows of each (no samples).
SELECT id, started_at, finished_at, window_since, window_until, tickets_compared,
       order_coverage, shadow_fault_rate, legacy_faults, accepted_legacy_faults, accept_rules,
       accept_sha256, max_shadow_fault_rate, min_order_coverage, min_ticket_match_rate,
       report -> 'total' AS total,
       report ->> 'error' AS error,
       (
           SELECT count(*) FROM jsonb_array_elements(
               CASE WHEN jsonb_typeof(report -> 'rules') = 'array' THEN report -> 'rules'
                    ELSE CAST('[]' AS jsonb) END
           ) AS r (rule)
           WHERE CAST(r.rule ->> 'matched' AS bigint) = 0
       ) AS unused_rules
FROM enrichq.parity_runs
ORDER BY id DESC
LIMIT :limit

-- name: review_report
-- The stored report of run :id (finished runs only have one).
SELECT id, finished_at, report FROM enrichq.parity_runs WHERE id = :id
