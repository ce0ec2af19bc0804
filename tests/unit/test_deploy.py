"""Deploy files: they parse, set only real settings, and agree with the metrics, CLI and docs."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from enrichq_schema import metrics
from enrichq_schema.settings import Settings
from enrichq_schema.states import DeadReason, Kind, Outcome, State
from enrichq_service import observe
from enrichq_service.cli import cli
from enrichq_service.http import EVENT_RESULTS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"
RULES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "enrichq.json"
OPERATIONS = ROOT / "docs" / "operations.md"
OWN_DOCS = [OPERATIONS, ROOT / "docs" / "architecture.md"]
PROMETHEUS_DIR = DEPLOY / "prometheus"
RUNBOOK_BASE_FILE = PROMETHEUS_DIR / "runbook-base.txt"
SET_RUNBOOK_BASE = PROMETHEUS_DIR / "set_runbook_base.py"
AUTOSCALING = K8S / "autoscaling"
# What POST /events counts that is not a refusal (one per event, not per request).
# answered 2xx: taken, a redelivery, or a Zendesk event of a kind enrichq does not use
EVENTS_TAKEN = {"accepted", "duplicate", "ignored"}

# What each metric type exposes beside its family name (prometheus-client's text format).
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}
# Label values the queries may name, per label (the metrics' vocabulary in states.py).
LABEL_VOCABULARY = {
    "outcome": {o.value for o in Outcome},
    "state": {s.value for s in State},
    "kind": {k.value for k in Kind},
    "reason": {r.value for r in DeadReason},
    # enrichq_events_total{result} and enrichq_enqueued_total{result}
    "result": set(EVENT_RESULTS) | {"inserted", "merged"},
}
SECRET_SETTINGS = {"ENRICHQ_DATABASE_URL", "ENRICHQ_WEBHOOK_SECRET"}
SETTING_TOKEN = re.compile(r"\bENRICHQ_[A-Z0-9_]+")
METRIC_TOKEN = re.compile(r"\benrichq_[a-z0-9_]+")
LABEL_MATCHER = re.compile(r"\b([a-z_]+)\s*(?:=~|!~|!=|=)\s*\"([^\"]*)\"")


def real_settings() -> set[str]:
    """Every environment variable the service reads: one per settings field, plus the file."""
    return {f"ENRICHQ_{name.upper()}" for name in Settings.model_fields} | {"ENRICHQ_CONFIG"}


def exported_metric_names() -> set[str]:
    """Every sample name the processes can expose: metrics.py's objects and the DB gauges."""
    # The scrape-time collector's families, built from a snapshot without a database.
    families = list(observe.families(observe.QueueSnapshot(dead_tuples=0)))
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            families.extend(value.describe())
    return {f.name + suffix for f in families for suffix in SAMPLE_SUFFIXES[f.type]}


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yml", ".yaml"} and p.is_file())


def load_docs(path: Path) -> list[Any]:
    """Every document of a (possibly multi-document) YAML file, empty documents left out."""
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def load_one(path: Path) -> dict[str, Any]:
    (doc,) = load_docs(path)
    assert isinstance(doc, dict), path
    return doc


@functools.cache
def k8s_objects() -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            objects.extend(load_docs(path))
    return objects


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in k8s_objects() if o["kind"] == kind]


def one(kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in by_kind(kind) if o["metadata"]["name"] == name]
    return obj


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod template's spec of a Deployment, Job or CronJob."""
    spec = obj["spec"]
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    pod: dict[str, Any] = spec["template"]["spec"]
    return pod


def workloads() -> list[dict[str, Any]]:
    return [o for o in k8s_objects() if o["kind"] in {"Deployment", "Job", "CronJob"}]


@functools.cache
def alerts() -> list[dict[str, Any]]:
    found = [
        rule
        for path in RULES
        for group in load_one(path)["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]
    assert found, "no alert rules found"
    return found


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def markdown_anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            anchors.add(github_anchor(m.group(1)))
    return anchors


def cli_commands() -> set[str]:
    return set(cli.commands)


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = load_one(COMPOSE)["services"]
    return services


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with an empty environment; a bare ${VAR} is refused."""

    def default(m: re.Match[str]) -> str:
        if m.group(2) is None:
            raise AssertionError(f"{value!r}: ${{{m.group(1)}}} has no default")
        return m.group(2)

    return re.sub(r"\$\{([A-Za-z0-9_]+)(?::-([^}]*))?\}", default, value)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ENRICHQ_ variable of this shell leaks into the settings the manifests build."""
    import os

    for name in list(os.environ):
        if name.startswith("ENRICHQ_"):
            monkeypatch.delenv(name)


def load_settings(env: dict[str, str]) -> Settings:
    overrides: dict[str, Any] = {k.removeprefix("ENRICHQ_").lower(): v for k, v in env.items()}
    return Settings.load(**overrides)


# -- every file parses ------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert load_docs(path), f"{path} holds no YAML document"


def test_the_deploy_tree_has_what_the_issue_asks_for() -> None:
    for name in [
        "Dockerfile",
        "compose.yaml",
        "k8s/kustomization.yaml",
        "prometheus/prometheus.yml",
        "grafana/dashboards/enrichq.json",
        "grafana/provisioning/datasources/prometheus.yml",
        "grafana/provisioning/dashboards/enrichq.yml",
    ]:
        assert (DEPLOY / name).is_file(), name
    assert RULES
    assert RULE_TESTS
    json.loads(DASHBOARD.read_text(encoding="utf-8"))


# -- settings ---------------------------------------------------------------------------


def test_every_enrichq_variable_named_under_deploy_and_in_the_docs_is_a_real_setting() -> None:
    known = real_settings()
    files = [p for p in DEPLOY.rglob("*") if p.is_file()] + OWN_DOCS
    unknown = {
        f"{path.relative_to(ROOT)}: {token}"
        for path in files
        for token in SETTING_TOKEN.findall(path.read_text(encoding="utf-8", errors="replace"))
        if token not in known
    }
    assert not unknown, sorted(unknown)


def manifest_settings() -> dict[str, set[str]]:
    """ENRICHQ_ variables each manifest sets, found structurally (not by text search)."""
    found: dict[str, set[str]] = {}
    for name, service in compose_services().items():
        keys = {k for k in compose_environment(service) if k.startswith("ENRICHQ_")}
        if keys:
            found[f"compose:{name}"] = keys
    for obj in k8s_objects():
        where = f"k8s:{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "ConfigMap":
            found[where] = set(obj.get("data", {}))
        elif obj["kind"] == "Secret":
            found[where] = set(obj.get("stringData", {})) | set(obj.get("data", {}))
        elif obj["kind"] in {"Deployment", "Job", "CronJob"}:
            for c in pod_spec(obj)["containers"]:
                keys = {e["name"] for e in c.get("env", []) if e["name"].startswith("ENRICHQ_")}
                if keys:
                    found[f"{where}/{c['name']}"] = keys
    return found


def test_every_enrichq_variable_the_manifests_set_is_a_real_setting() -> None:
    found = manifest_settings()
    assert "k8s:ConfigMap/enrichq-settings" in found
    assert "k8s:Secret/enrichq-secrets" in found
    assert {"compose:migrate", "compose:serve", "compose:sweep"} <= set(found)
    known = real_settings()
    unknown = {f"{where}: {key}" for where, keys in found.items() for key in keys - known}
    assert not unknown, sorted(unknown)


def test_secrets_live_in_the_secret_never_in_the_configmap() -> None:
    config = one("ConfigMap", "enrichq-settings")["data"]
    secret = one("Secret", "enrichq-secrets")["stringData"]
    assert not SECRET_SETTINGS & set(config)
    assert not {k for k in config if k.endswith("_URL")}, "URLs carry passwords: Secret only"
    assert set(secret) >= SECRET_SETTINGS
    for key, value in secret.items():
        assert "REPLACE-ME" in value, f"{key} must be an obvious placeholder"


@pytest.mark.usefixtures("clean_env")
def test_the_k8s_settings_load() -> None:
    env = dict(one("ConfigMap", "enrichq-settings")["data"])
    env.update(one("Secret", "enrichq-secrets")["stringData"])
    settings = load_settings(env)
    assert settings.database_url is not None
    assert settings.mode.value == "shadow"


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("service", ["migrate", "serve", "worker", "sweep"])
def test_the_compose_settings_load(service: str) -> None:
    env = {
        k: interpolate(v)
        for k, v in compose_environment(compose_services()[service]).items()
        if k.startswith("ENRICHQ_")
    }
    settings = load_settings(env)
    assert settings.database_url is not None
    assert "@postgres:5432/" in settings.database_url


def test_compose_takes_secrets_from_the_environment_not_the_file() -> None:
    for name, service in compose_services().items():
        for key, value in compose_environment(service).items():
            if key in SECRET_SETTINGS or key.endswith("PASSWORD"):
                assert "${" in value, f"{name}: {key} must come from the environment"


# -- alerts, runbooks, rule tests --------------------------------------------------------


def runbook_base() -> str:
    return RUNBOOK_BASE_FILE.read_text(encoding="utf-8").strip()


def test_every_alert_has_severity_summary_description_and_a_runbook_that_exists() -> None:
    anchors = markdown_anchors(OPERATIONS)
    base = runbook_base()
    for rule in alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = rule["annotations"]
        assert annotations["summary"].strip(), name
        assert annotations["description"].strip(), name
        # the one base of runbook-base.txt, then the section named after the alert
        url = annotations["runbook_url"]
        assert url == f"{base}#{name.lower()}", f"{name}: {url}"
        assert name.lower() in anchors, f"{name}: docs/operations.md has no heading #{name}"


def run_set_runbook_base(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, check=False
    )


def test_the_rule_tests_expect_the_same_runbook_base() -> None:
    result = run_set_runbook_base(SET_RUNBOOK_BASE, "--check")
    assert result.returncode == 0, result.stderr
    assert "runbook_url" in (PROMETHEUS_DIR / "tests" / "enrichq_test.yml").read_text("utf-8")


def test_one_command_moves_every_runbook_link_to_a_new_base(tmp_path: Path) -> None:
    copy = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS_DIR, copy)
    script = copy / SET_RUNBOOK_BASE.name
    new = "https://git.example.com/ops/enrichq/-/blob/main/docs/operations.md"
    result = run_set_runbook_base(script, new + "/")
    assert result.returncode == 0, result.stderr
    assert (copy / RUNBOOK_BASE_FILE.name).read_text(encoding="utf-8") == new + "\n"
    urls = [
        line.split("runbook_url:", 1)[1].strip()
        for path in [*(copy / "rules").glob("*.yml"), *(copy / "tests").glob("*.yml")]
        for line in path.read_text(encoding="utf-8").splitlines()
        if "runbook_url:" in line
    ]
    assert len(urls) > len(alerts())  # the rules' and the rule tests' links
    assert all(url.startswith(new + "#") for url in urls), urls
    assert {url.removeprefix(new + "#") for url in urls} == {r["alert"].lower() for r in alerts()}
    assert run_set_runbook_base(script, "--check").returncode == 0
    # a link edited by hand is caught
    rules = copy / "rules" / RULES[0].name
    rules.write_text(rules.read_text("utf-8").replace(new, "https://elsewhere", 1), "utf-8")
    assert run_set_runbook_base(script, "--check").returncode == 1
    # so is one the rewrite cannot see (quoted)
    assert run_set_runbook_base(script, new).returncode == 0
    quoted = re.sub(r"runbook_url: (\S+)", r'runbook_url: "\1"', rules.read_text("utf-8"), count=1)
    assert 'runbook_url: "' in quoted
    rules.write_text(quoted, "utf-8")
    assert run_set_runbook_base(script, "--check").returncode == 1
    for bad in ["not a url", "https://x.example/ops.md#anchor", "ftp://x.example/a", "https://a b"]:
        assert run_set_runbook_base(script, bad).returncode == 2, bad


def test_the_refusal_alert_covers_every_refused_result_of_post_events() -> None:
    (rule,) = [r for r in alerts() if r["alert"] == "EnrichqEventsRefused"]
    matchers = re.findall(r'enrichq_events_total\{result=~"([^"]+)"\}', str(rule["expr"]))
    assert len(matchers) == 2
    for alternatives in matchers:
        assert set(alternatives.split("|")) == set(EVENT_RESULTS) - EVENTS_TAKEN
    assert set(EVENT_RESULTS) > EVENTS_TAKEN


def test_every_alert_has_a_rule_test_that_fires_and_one_that_does_not() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        doc = load_one(path)
        for rule_file in doc["rule_files"]:
            assert (path.parent / rule_file).is_file(), f"{path}: {rule_file}"
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert not names - fired, f"no firing case: {sorted(names - fired)}"
    assert not names - quiet, f"no quiet case: {sorted(names - quiet)}"
    assert not (fired | quiet) - names, f"tests of unknown alerts: {(fired | quiet) - names}"


def test_alert_names_are_unique() -> None:
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names))


# -- metric names and label values -------------------------------------------------------


def promql_sources() -> list[tuple[str, str]]:
    exprs = [(f"rule {rule['alert']}", str(rule["expr"])) for rule in alerts()]
    exprs += [("dashboard", expr) for expr in dashboard_exprs()]
    return exprs


def test_every_metric_the_rules_and_dashboard_query_is_exported() -> None:
    exported = exported_metric_names()
    missing = {
        f"{where}: {name}"
        for where, expr in promql_sources()
        for name in METRIC_TOKEN.findall(expr)
        if name not in exported
    }
    assert not missing, sorted(missing)


def test_every_label_value_the_queries_match_is_in_the_vocabulary() -> None:
    wrong = set()
    for where, expr in promql_sources():
        for label, value in LABEL_MATCHER.findall(expr):
            if label not in LABEL_VOCABULARY or "$" in value:
                continue
            for alternative in value.split("|"):
                if alternative not in LABEL_VOCABULARY[label]:
                    wrong.add(f"{where}: {label}={alternative!r}")
    assert not wrong, sorted(wrong)


def test_every_metric_an_alert_uses_is_on_the_dashboard() -> None:
    """Whoever is paged can see the alert's signal over time (EnrichqPausedTooLong had none)."""
    shown = {name for expr in dashboard_exprs() for name in METRIC_TOKEN.findall(expr)}
    missing = {
        f"{rule['alert']}: {name}"
        for rule in alerts()
        for name in METRIC_TOKEN.findall(str(rule["expr"]))
        if name not in shown
    }
    assert not missing, sorted(missing)


def test_the_metric_name_check_can_fail() -> None:
    exported = exported_metric_names()
    assert "enrichq_claims_total" in exported
    assert "enrichq_job_duration_seconds_bucket" in exported
    assert "enrichq_build_info" in exported
    assert "enrichq_queue_rows" in exported
    assert "enrichq_oldest_transaction_age_seconds" in exported
    assert "enrichq_claims" not in exported
    assert "enrichq_job_duration_seconds" not in exported


# -- dashboard ---------------------------------------------------------------------------


def test_the_dashboard_uses_its_datasource_variable_everywhere() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_grafana_provisioning_points_at_the_dashboard_folder_compose_mounts() -> None:
    provider = load_one(DEPLOY / "grafana/provisioning/dashboards/enrichq.yml")["providers"][0]
    grafana = compose_services()["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    datasource = load_one(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


# -- compose -----------------------------------------------------------------------------


def test_compose_runs_migrate_once_before_serve_and_sweep() -> None:
    services = compose_services()
    assert {"postgres", "migrate", "serve", "sweep", "prometheus", "grafana"} <= set(services)
    assert services["postgres"]["image"].startswith("postgres:15")
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    for name in ["serve", "worker", "sweep"]:
        assert services[name]["depends_on"]["migrate"]["condition"] == (
            "service_completed_successfully"
        ), name
    commands = cli_commands()
    for name, service in services.items():
        if service.get("image", "").startswith("enrichq"):
            assert service["command"][0] in commands, name
            build = service["build"]
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()


def test_compose_bind_mounts_exist() -> None:
    for name, service in compose_services().items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"


def test_prometheus_scrapes_every_process_on_the_settings_ports() -> None:
    config = load_one(DEPLOY / "prometheus" / "prometheus.yml")
    services = compose_services()
    defaults = Settings.model_fields
    targets: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.split(":")
                targets[host] = int(port)
        for dns in job.get("dns_sd_configs", []):
            for host in dns["names"]:
                targets[host] = int(dns["port"])
    assert targets["serve"] == defaults["http_port"].default
    assert targets["sweep"] == defaults["metrics_port"].default
    assert targets["worker"] == defaults["metrics_port"].default
    assert {h for h in targets if h != "localhost"} <= set(services)
    rule_globs = [DEPLOY / "prometheus" / g for g in config["rule_files"]]
    loaded = {p for g in rule_globs for p in g.parent.glob(g.name)}
    assert loaded == set(RULES)


def test_docker_compose_accepts_the_file() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker is not installed, so `docker compose config` cannot run")
    version = subprocess.run(
        [docker, "compose", "version"], capture_output=True, text=True, check=False
    )
    if version.returncode != 0:
        reason = (version.stderr.strip().splitlines() or ["no output"])[0]
        pytest.skip(f"the docker compose plugin is not installed ({reason})")
    result = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# -- kubernetes --------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_one(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert "namespace" not in kustomization
    for obj in k8s_objects():
        assert "namespace" not in obj["metadata"], obj["metadata"]["name"]


def test_the_sweeper_runs_two_replicas() -> None:
    sweep = one("Deployment", "enrichq-sweep")
    assert sweep["spec"]["replicas"] == 2
    (container,) = pod_spec(sweep)["containers"]
    assert container["args"] == ["sweep"]


def test_serve_is_probed_on_readyz_and_healthz() -> None:
    (container,) = pod_spec(one("Deployment", "enrichq-serve"))["containers"]
    assert container["args"] == ["serve"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == Settings.model_fields["http_port"].default


def test_the_migrate_job_and_parity_cronjob_run_their_commands() -> None:
    (migrate,) = pod_spec(one("Job", "enrichq-migrate"))["containers"]
    assert migrate["args"] == ["migrate"]
    cron = one("CronJob", "enrichq-parity")
    assert len(cron["spec"]["schedule"].split()) == 5
    (parity,) = pod_spec(cron)["containers"]
    assert parity["args"][:3] == ["parity", "--json", "/tmp/parity.json"]


@pytest.mark.parametrize("name", ["enrichq-worker", "enrichq-sweep"])
def test_workers_and_sweepers_wait_for_the_schema_to_reach_head(name: str) -> None:
    """An init container runs `enrichq migrate --check` (non-zero while the schema is
    behind), with the settings and secrets of the main container, so it checks the same
    database."""
    pod = pod_spec(one("Deployment", name))
    (init,) = pod["initContainers"]
    (main,) = pod["containers"]
    assert init["args"][:2] == ["migrate", "--check"]
    assert init["image"] == main["image"]
    assert init["envFrom"] == main["envFrom"]
    assert "--wait" in init["args"]
    wait = float(init["args"][init["args"].index("--wait") + 1])
    deadline = one("Job", "enrichq-migrate")["spec"]["activeDeadlineSeconds"]
    assert wait >= deadline  # it outwaits the migration it waits for
    assert "migrate" in cli_commands()
    (migrate,) = [c for c in cli.commands.values() if c.name == "migrate"]
    assert {"--check", "--wait"} <= {o for p in migrate.params for o in p.opts}


def test_every_workload_is_locked_down_and_reads_its_settings() -> None:
    configmaps = {o["metadata"]["name"] for o in by_kind("ConfigMap")}
    secrets = {o["metadata"]["name"] for o in by_kind("Secret")}
    commands = cli_commands()
    assert len(workloads()) >= 4
    for obj in workloads():
        pod = pod_spec(obj)
        name = obj["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            assert c["image"] == "enrichq", name
            assert c["args"][0] in commands, name
            security = c["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, name
            assert c["resources"]["requests"], name
            assert c["resources"]["limits"]["memory"], name
            refs = c["envFrom"]
            assert {r["configMapRef"]["name"] for r in refs if "configMapRef" in r} <= configmaps
            assert {r["secretRef"]["name"] for r in refs if "secretRef" in r} <= secrets
            assert len(refs) == 2, name


def test_services_and_servicemonitor_reach_named_container_ports() -> None:
    deployments = by_kind("Deployment")
    service_ports: set[str] = set()
    for service in by_kind("Service"):
        selector = service["spec"]["selector"]
        (target,) = [
            d
            for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        container_ports = {
            p["name"] for c in pod_spec(target)["containers"] for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in container_ports, service["metadata"]["name"]
            service_ports.add(port["name"])
    (monitor,) = by_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    endpoints = monitor["spec"]["endpoints"]
    assert {e["port"] for e in endpoints} == service_ports
    assert {e["path"] for e in endpoints} == {"/metrics"}
    wanted = monitor["spec"]["selector"]["matchLabels"].items()
    for service in by_kind("Service"):
        assert wanted <= service["metadata"]["labels"].items()


# -- image -------------------------------------------------------------------------------


def test_the_dockerfile_installs_the_wheel_as_a_non_root_user() -> None:
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    instructions = [
        line.split(None, 1) for line in text.splitlines() if line and not line.startswith("#")
    ]
    froms = [rest for word, *rest in instructions if word == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder and a runtime"
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    users = [rest[0] for word, *rest in instructions if word == "USER"]
    assert users
    assert users[-1].split(":")[0] not in {"0", "root"}
    assert 'ENTRYPOINT ["enrichq"]' in text
    assert 'CMD ["serve"]' in text
    assert re.search(r"^EXPOSE 8080 9464$", text, re.MULTILINE)
    assert "pip wheel" in text
    assert " -e " not in text
    assert "--editable" not in text
    for word, *rest in instructions:
        if word == "COPY" and "--from" not in rest[0]:
            for source in rest[0].split()[:-1]:
                assert (ROOT / source).exists(), source
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    assert {".git", ".venv"} <= set(ignored)


# -- autoscaling (deploy/k8s/autoscaling: KEDA or a plain HPA, one or the other) --------


def component(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A component's kustomization and its one autoscaler object."""
    directory = AUTOSCALING / name
    kustomization = load_one(directory / "kustomization.yaml")
    assert kustomization["kind"] == "Component"
    on_disk = {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk, name
    ((obj,),) = [load_docs(directory / r) for r in kustomization["resources"]]
    return kustomization, obj


def keda() -> dict[str, Any]:
    return component("keda")[1]


def hpa() -> dict[str, Any]:
    return component("hpa")[1]


def config_int(name: str) -> int:
    config = one("ConfigMap", "enrichq-settings")["data"]
    value = config.get(name, Settings.model_fields[name.removeprefix("ENRICHQ_").lower()].default)
    return int(value)


def test_there_are_exactly_the_two_autoscaling_alternatives() -> None:
    assert {p.name for p in AUTOSCALING.iterdir()} == {"keda", "hpa"}
    assert keda()["apiVersion"] == "keda.sh/v1alpha1"
    assert keda()["kind"] == "ScaledObject"
    assert hpa()["apiVersion"] == "autoscaling/v2"
    assert hpa()["kind"] == "HorizontalPodAutoscaler"
    # neither is in the base: both at once would fight over the replicas
    listed = load_one(K8S / "kustomization.yaml")
    assert "components" not in listed
    assert not any(r.startswith("autoscaling") for r in listed["resources"])


@pytest.mark.parametrize("name", ["keda", "hpa"])
def test_the_autoscaler_targets_the_worker_and_owns_its_replicas(name: str) -> None:
    kustomization, obj = component(name)
    target = obj["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment"
    worker = one("Deployment", target["name"])
    assert pod_spec(worker)["containers"][0]["args"] == ["worker"]
    (patch,) = kustomization["patches"]
    assert patch["target"]["kind"] == "Deployment"
    assert patch["target"]["name"] == target["name"]
    assert yaml.safe_load(patch["patch"]) == [{"op": "remove", "path": "/spec/replicas"}]
    assert "replicas" in worker["spec"]  # so the remove applies


def keda_queries() -> list[str]:
    triggers = keda()["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"prometheus"}
    return [t["metadata"]["query"] for t in triggers]


def test_the_scalers_query_exported_metrics_with_known_labels_taking_max() -> None:
    exported = exported_metric_names()
    queries = keda_queries()
    names = {n for q in queries for n in METRIC_TOKEN.findall(q)}
    assert names == {"enrichq_queue_oldest_visible_age_seconds", "enrichq_queue_rows"}
    for query in queries:
        # a database gauge every process exports: a sum would scale with the pod count
        assert query.startswith("max("), query
        assert "sum" not in query, query
        for label, value in LABEL_MATCHER.findall(query):
            assert value in LABEL_VOCABULARY[label], query
    hpa_metrics = {
        m["external"]["metric"]["name"]: m["external"]["metric"]["selector"]["matchLabels"]
        for m in hpa()["spec"]["metrics"]
    }
    assert set(hpa_metrics) == names
    assert set(hpa_metrics) <= exported
    for selector in hpa_metrics.values():
        for label, value in selector.items():
            assert value in LABEL_VOCABULARY[label], selector
    # the same scaling either way: the same selections, thresholds and bounds
    for trigger, metric in zip(keda()["spec"]["triggers"], hpa()["spec"]["metrics"], strict=True):
        query = trigger["metadata"]["query"]
        external = metric["external"]
        assert external["metric"]["name"] in query
        assert dict(LABEL_MATCHER.findall(query)) == external["metric"]["selector"]["matchLabels"]
        assert trigger["metricType"] == external["target"]["type"] == "AverageValue"
        assert float(trigger["metadata"]["threshold"]) == float(external["target"]["averageValue"])
    assert keda()["spec"]["minReplicaCount"] == hpa()["spec"]["minReplicas"]
    assert keda()["spec"]["maxReplicaCount"] == hpa()["spec"]["maxReplicas"]


def test_the_age_threshold_scales_to_the_max_before_the_alert_fires() -> None:
    (trigger,) = [
        t for t in keda()["spec"]["triggers"] if "oldest_visible" in t["metadata"]["query"]
    ]
    (rule,) = [r for r in alerts() if r["alert"] == "EnrichqOldestQueuedTooOld"]
    bar = float(re.search(r'\{kind="enrich"\}\) > (\d+)', str(rule["expr"])).group(1))  # type: ignore[union-attr]
    replicas_at_bar = bar / float(trigger["metadata"]["threshold"])
    assert replicas_at_bar >= keda()["spec"]["maxReplicaCount"]


def test_max_replicas_respect_the_warehouse_cap_and_min_is_at_least_one() -> None:
    """More workers do not make more warehouse slots: at max replicas, the fleet's lookups
    in flight (workers and serve replicas, ENRICHQ_CONCURRENCY each) fit under the cap
    when the ConfigMap sets one; and the bound is explained beside it."""
    spec = keda()["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["minReplicaCount"] <= spec["fallback"]["replicas"] <= spec["maxReplicaCount"]
    serve = one("Deployment", "enrichq-serve")["spec"]["replicas"]
    demand = (spec["maxReplicaCount"] + serve) * config_int("ENRICHQ_CONCURRENCY")
    cap = config_int("ENRICHQ_WAREHOUSE_MAX_CONCURRENCY")
    assert cap == 0 or demand <= cap, f"{demand} lookups at max replicas > cap {cap}"
    text = (AUTOSCALING / "keda" / "scaledobject.yaml").read_text(encoding="utf-8")
    assert "ENRICHQ_WAREHOUSE_MAX_CONCURRENCY" in text
    assert f"(maxReplicaCount + {serve}) x ENRICHQ_CONCURRENCY" in text
    assert "#autoscaling-workers" in (AUTOSCALING / "keda" / "kustomization.yaml").read_text(
        "utf-8"
    )
    assert "autoscaling-workers" in markdown_anchors(OPERATIONS)


@pytest.mark.parametrize("name", ["keda", "hpa"])
def test_kustomize_builds_the_base_with_each_autoscaler(name: str, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed, so `kubectl kustomize` cannot run")
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    with (copy / "kustomization.yaml").open("a", encoding="utf-8") as f:
        f.write(f"components:\n  - autoscaling/{name}\n")
    result = subprocess.run(
        [kubectl, "kustomize", str(copy)], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr
    built = [d for d in yaml.safe_load_all(result.stdout) if d]
    (worker,) = [
        d for d in built if d["kind"] == "Deployment" and "worker" in d["metadata"]["name"]
    ]
    assert "replicas" not in worker["spec"]
    (scaler,) = [d for d in built if d["kind"] in {"ScaledObject", "HorizontalPodAutoscaler"}]
    assert scaler["metadata"]["labels"]["app.kubernetes.io/part-of"] == "enrichq"
