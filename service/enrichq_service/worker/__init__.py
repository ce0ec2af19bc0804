"""The worker runtime (DESIGN §3, §4): claim, heartbeat, enrich, settle.

See `runtime` for how the parts fit together; each part is a module of its own.
"""

from enrichq_service.worker.db import ThreadConnection
from enrichq_service.worker.engines import WorkerEngines, build_engines
from enrichq_service.worker.runtime import (
    KINDS,
    RunResult,
    Worker,
    run_worker,
    worker_process,
)

__all__ = [
    "KINDS",
    "RunResult",
    "ThreadConnection",
    "Worker",
    "WorkerEngines",
    "build_engines",
    "run_worker",
    "worker_process",
]
