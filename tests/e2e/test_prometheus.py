"""A live Prometheus (Debian's `prometheus`) with deploy/prometheus/prometheus.yml, its
targets pointed at real `serve`, `worker` and `sweep` processes: every enrichq_* family
the dashboard and the alert rules use is there after two scrapes, every PromQL expression
of the dashboard, of the rules and of the worker autoscalers (deploy/k8s/autoscaling)
evaluates without error, the scalers' queries answer one number each, events signed with a
wrong secret make EnrichqEventsRefused pending or firing, and killing the worker makes
EnrichqWorkerDown pending or firing (a copy of the rules with test-sized `for:`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from tests.support.procs import REPO, enrichq_env, spawn, stop, wait_for
from tests.support.web import answers, event, free_port, post_event
from tests.support.world import add_tickets, seeded

from enrichq_service.controls import pauses

pytestmark = pytest.mark.slow

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
DEPLOY = REPO / "deploy"
CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "enrichq.json"
SCALED_OBJECT = DEPLOY / "k8s" / "autoscaling" / "keda" / "scaledobject.yaml"
SECRET = "prometheus-e2e-secret"
SCRAPE = "1s"
# The test-sized `for:` of every alert in the copy of the rules Prometheus loads.
FOR = "2s"
# Grafana's variables, as the dashboard's "All" and a rate window of a few scrapes.
GRAFANA_VARIABLES = {"$kind": ".*", "$__rate_interval": "15s"}
METRIC = re.compile(r"\benrichq_[a-z0-9_]+")
JOBS = ("enrichq-serve", "enrichq-worker", "enrichq-sweep")


def require() -> None:
    if not Path(PROMETHEUS).is_file():
        pytest.skip("prometheus is not installed (Debian package prometheus; .ci/run installs it)")


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule
        for path in RULES
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def scaler_queries() -> list[str]:
    """The PromQL of the KEDA ScaledObject's Prometheus triggers (the HPA's metrics are the
    same selections, tests/unit/test_deploy.py checks)."""
    scaled = yaml.safe_load(SCALED_OBJECT.read_text(encoding="utf-8"))
    return [str(t["metadata"]["query"]) for t in scaled["spec"]["triggers"]]


def with_variables(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def used_metrics() -> set[str]:
    """Every enrichq_* sample name the dashboard and the alert rules query."""
    exprs = dashboard_exprs() + [str(rule["expr"]) for rule in alert_rules()] + scaler_queries()
    return {name for expr in exprs for name in METRIC.findall(expr)}


def write_config(tmp: Path, ports: dict[str, int], prometheus_port: int) -> Path:
    """The deploy config with its targets on this machine's ports and a short interval;
    the rules copied beside it with test-sized `for:`."""
    config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    config["global"]["scrape_interval"] = SCRAPE
    config["global"]["evaluation_interval"] = SCRAPE
    for job in config["scrape_configs"]:
        name = job["job_name"]
        port = prometheus_port if name == "prometheus" else ports[name]
        job.pop("dns_sd_configs", None)
        labels = {}
        if job.get("static_configs"):
            labels = job["static_configs"][0].get("labels", {})
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"], "labels": labels}]
    rules = tmp / "rules"
    rules.mkdir()
    for path in RULES:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        for group in doc["groups"]:
            group["interval"] = SCRAPE
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = FOR
        (rules / path.name).write_text(yaml.safe_dump(doc), encoding="utf-8")
    out = tmp / "prometheus.yml"
    out.write_text(yaml.safe_dump(config), encoding="utf-8")
    return out


class Prometheus:
    """A prometheus process and its HTTP API."""

    def __init__(self, config: Path, data: Path, port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={data}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.base}{path}", params=params, timeout=10)
        body = response.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def ready(self) -> bool:
        return answers(f"{self.base}/-/ready")


@pytest.fixture
def prometheus_dir(tmp_path: Path) -> Path:
    require()
    return tmp_path


def test_a_live_prometheus_scrapes_every_process_and_sees_the_worker_go_down(
    db_url: str, db_engine: sa.Engine, prometheus_dir: Path
) -> None:
    keys = seeded(db_engine, 30)
    with db_engine.begin() as conn:
        # a pause of a tenant with no work: the pause gauges exist only while one is in place
        pauses.pause(conn, pauses.PauseScope(None, "nobody-at-all"), actor="test")
        # a ticket of the mirror changed an hour ago that no event announced: the
        # sweeper's reconcile pass enqueues it, so enrichq_reconciled_total has a sample
        add_tickets(conn, ["never-announced"])
        conn.execute(
            sa.text(
                "UPDATE helpdesk.tickets SET updated_at = now() - interval '1 hour'"
                " WHERE id = 'never-announced'"
            )
        )
    ports = {job: free_port() for job in JOBS}
    fast = {"lease_seconds": 3, "heartbeat_seconds": 0.5, "poll_seconds": 0.2}
    serve = spawn(
        ["serve"],
        enrichq_env(
            db_url,
            **fast,
            http_host="127.0.0.1",
            http_port=ports["enrichq-serve"],
            webhook_secret=SECRET,
        ),
        log=prometheus_dir / "serve.log",
    )
    worker = spawn(
        ["worker"],
        enrichq_env(db_url, **fast, metrics_port=ports["enrichq-worker"]),
        log=prometheus_dir / "worker.log",
    )
    sweep = spawn(
        ["sweep"],
        enrichq_env(
            db_url,
            sweep_interval_seconds=1,
            reconcile_interval_seconds=1,
            metrics_port=ports["enrichq-sweep"],
        ),
        log=prometheus_dir / "sweep.log",
    )
    prometheus_port = free_port()
    config = write_config(prometheus_dir, ports, prometheus_port)
    prom = Prometheus(config, prometheus_dir / "data", prometheus_port, prometheus_dir / "p.log")
    try:
        base = f"http://127.0.0.1:{ports['enrichq-serve']}"
        wait_for(lambda: answers(f"{base}/readyz"), timeout=60, what="serve ready")
        post_event(base, SECRET, event(keys[0], "updated")).raise_for_status()
        wait_for(prom.ready, timeout=60, what="prometheus ready")

        def scraped_twice() -> bool:
            counts = prom.query('count_over_time(up{job=~"enrichq-.*"}[1m])')
            ups = prom.query('up{job=~"enrichq-.*"} == 1')
            jobs = {s["metric"]["job"] for s in counts if float(s["value"][1]) >= 2}
            return jobs == set(JOBS) and {s["metric"]["job"] for s in ups} == set(JOBS)

        wait_for(scraped_twice, timeout=90, interval=0.5, what="two scrapes of every process")

        present = set(prom.get("/api/v1/label/__name__/values"))
        used = used_metrics()
        assert len(used) > 30
        assert used - present == set()
        for expr in dashboard_exprs():
            prom.query(with_variables(expr))  # a bad expression: status "error"
        for rule in alert_rules():
            prom.query(str(rule["expr"]))
        for query in scaler_queries():
            # one number, whatever the number of processes exporting the gauge
            (sample,) = prom.query(query)
            assert float(sample["value"][1]) >= 0, query
        # the worker's own /metrics, labelled as the deploy config labels it
        assert prom.query('enrichq_build_info{job="enrichq-worker", component="worker"}')

        # a secret rotation done in the wrong order: every event refused with 401
        for i in range(20):
            refused = post_event(base, "not-" + SECRET, event(keys[i % len(keys)], "updated"))
            assert refused.status_code == 401

        def firing(name: str) -> Callable[[], dict[str, Any] | None]:
            def check() -> dict[str, Any] | None:
                for alert in prom.get("/api/v1/alerts")["alerts"]:
                    if alert["labels"]["alertname"] == name and alert["state"] in (
                        "pending",
                        "firing",
                    ):
                        found: dict[str, Any] = alert
                        return found
                return None

            return check

        alert = wait_for(firing("EnrichqEventsRefused"), timeout=60, interval=0.5, what="refused")
        assert alert["labels"]["result"] == "unauthorized"

        worker.kill()
        worker.wait(10)

        def worker_down() -> str | None:
            for alert in prom.get("/api/v1/alerts")["alerts"]:
                if alert["labels"]["alertname"] == "EnrichqWorkerDown":
                    state: str = alert["state"]
                    if state in ("pending", "firing"):
                        return state
            return None

        state = wait_for(worker_down, timeout=60, interval=0.5, what="EnrichqWorkerDown")
        assert state in ("pending", "firing")
        (down,) = prom.query('up{job="enrichq-worker"}')
        assert down["value"][1] == "0"
    finally:
        stop(prom.proc)
        for proc in (serve, worker, sweep):
            stop(proc)
