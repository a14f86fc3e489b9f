"""The rules and the dashboard against the real thing: the four services on the real broker
and ledger (the Claude agent through the real SDK and the scripted Messages API server), a
real Prometheus server scraping them every second with vigil's rule file loaded, and a little
traffic (chat messages answered and delivered, an approval asked, a timer fired).

Then: `promtool check metrics` on every service's /metrics, and every recording rule and
every dashboard panel's query evaluated through Prometheus' HTTP API, each of which must
return at least one series: a typo, or a metric renamed away, fails here.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ingest_support import cli, create_token
from prometheus_support import RULES, dashboard_panels, prometheus_tools, recording_rules, with_variables
from support import scalar, wait_for
from vigil_dev.devstack import free_port
from vigil_dev.scripted_server import ScriptedServer
from worker_support import FAST

pytestmark = pytest.mark.tools  # promtool and prometheus, Go-built: `make test` runs these after the parallel phase

SERVICES = ("ingest", "worker", "scheduler", "dispatcher")
SCRIPT = {
    "rules": [
        {"when": {"tool_result": "send_message"}, "reply": []},
        {
            "when": {"user_text": r"refund order (?P<order>\w+)"},
            "reply": [{"type": "tool_use", "name": "refund", "input": {"order_id": "{order}", "amount": 5}}],
        },
        {"when": {"user_text": "."}, "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "ok"}}]},
    ]
}


@pytest.fixture(scope="module")
def tools() -> Path:
    return prometheus_tools()


@pytest.fixture
def claude():
    with ScriptedServer(SCRIPT) as server:
        yield server


class Prometheus:
    """A prometheus server in a temp folder, scraping ``targets`` every second."""

    def __init__(self, binary: Path, folder: Path, targets: dict[str, int]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules = yaml.safe_load(RULES.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"  # the test's minute is a few seconds
        (folder / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(folder / "rules.yaml")],
            "scrape_configs": [
                {"job_name": f"vigil-{name}", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                for name, port in targets.items()
            ],
        }
        (folder / "prometheus.yaml").write_text(yaml.safe_dump(config))
        self.log = folder / "prometheus.log"
        self.args = [
            str(binary),
            f"--config.file={folder / 'prometheus.yaml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self.ready, 60, "prometheus ready")
        return self

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def query(self, expr: str) -> list[dict]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = answer.json()
        assert answer.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def targets_up(self) -> bool:
        return len(self.query('up{job=~"vigil-.+"} == 1')) == len(SERVICES)


def empty_queries(prom: Prometheus, exprs: list[str]) -> list[str]:
    return [expr for expr in exprs if not prom.query(expr)]


@pytest.mark.slow
def test_every_recording_rule_and_dashboard_query_returns_series(
    tools, claude, stack, ledger, topics, vigil_env, spawn, tmp_path
):
    ports = {name: int(vigil_env[f"VIGIL_{name.upper()}_PORT"]) for name in SERVICES}
    worker_env = {
        **vigil_env,
        **FAST,
        "VIGIL_AGENT": "claude",
        "ANTHROPIC_BASE_URL": claude.base_url,
        "ANTHROPIC_API_KEY": "scripted-test-key",
        "VIGIL_MODEL": "claude-scripted-1",
        "VIGIL_TOOL_PERMISSIONS": "refund=ask",
        "VIGIL_USER_DAILY_TOKENS": "10000000",  # a budget, for the budgets row's spend against it
        "VIGIL_KAFKA_OPT_STATISTICS_INTERVAL_MS": "1000",  # the consumer lag series without 15 s waits
    }
    envs = {
        "worker": worker_env,
        "ingest": vigil_env,
        "scheduler": {**vigil_env, "VIGIL_SCHEDULER_TICK_S": "0.2"},
        "dispatcher": {**vigil_env, "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.1"},
    }
    procs = {name: spawn([name], envs[name], name=name).wait_healthy(ports[name]) for name in SERVICES}

    with Prometheus(tools / "prometheus", tmp_path, ports) as prom:
        wait_for(prom.targets_up, 60, "prometheus scraping all four services")

        token = create_token(ledger)["token"]
        api = f"http://127.0.0.1:{ports['ingest']}"
        headers = {"Authorization": f"Bearer {token}"}
        for i, user in enumerate(["u-obs-1", "u-obs-2", "u-obs-3"]):
            answer = httpx.post(f"{api}/v1/users/{user}/messages", json={"text": f"hello {i}"}, headers=headers)
            assert answer.status_code == 202, answer.text
        answer = httpx.post(f"{api}/v1/users/u-obs-4/messages", json={"text": "refund order A1"}, headers=headers)
        assert answer.status_code == 202, answer.text
        assert httpx.post(f"{api}/v1/events", json={"nope": 1}, headers=headers).status_code == 400
        cli(ledger, "timers", "add", "u-obs-5", "soon", "--due", str(int(time.time()) + 1))

        wait_for(
            lambda: scalar(ledger, "SELECT count(*) FROM outbox WHERE delivered_at IS NOT NULL") >= 4,
            90,
            "three replies and one approval question delivered",
        )
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM events WHERE source = 'timer'") >= 1, 30, "the timer")

        # promtool's linter on what each service serves, after the traffic labelled its series.
        for name, port in ports.items():
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert "_created" not in text, f"{name} exports _created series"
            done = subprocess.run(
                [tools / "promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
            )
            assert done.returncode == 0 and not done.stdout.strip(), f"{name}: {done.stdout}{done.stderr}"

        records = [rule["record"] for rule in recording_rules()]
        panels = dashboard_panels()
        targets = [with_variables(target["expr"]) for panel in panels for target in panel["targets"]]
        assert len(records) >= 20 and len(panels) >= 40
        # The worker reports consumer lag with its librdkafka statistics (every second here), and
        # the rules run every second: wait until nothing is missing, then say what still is.
        missing: list[str] = []

        def all_answer() -> bool:
            missing[:] = empty_queries(prom, records + targets)
            return not missing

        try:
            wait_for(all_answer, 60, "every recording rule and panel query to return series", interval=1)
        except AssertionError:
            raise AssertionError("queries that return no series:\n" + "\n".join(missing)) from None
        print(json.dumps({"recording_rules": len(records), "panels": len(panels), "queries": len(targets)}))

    # Structured logs: every line a service logged is one JSON object naming the service; the
    # SDK's per-request lines (one per model call) are not there. (The dispatcher's log
    # channel writes its deliveries to stdout, also JSON, without a level.)
    for name, proc in procs.items():
        lines = proc.log().splitlines()
        records = [json.loads(line) for line in lines]  # a traceback line or a raw librdkafka line fails here
        logged = [r for r in records if "level" in r]
        assert logged, f"{name} logged nothing"
        assert all(r["service"] == name and r["msg"] and r["logger"] and r["ts"] for r in logged), name
        assert not [r for r in logged if "HTTP Request" in r["msg"]], f"{name} logs one line per HTTP request"
