"""Settings: bad values fail at start, naming the variable; secrets are never shown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vigil.settings import CommonSettings, SettingsError, load


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        ("VIGIL_PARTITIONS", "abc", "VIGIL_PARTITIONS='abc'"),
        ("VIGIL_PARTITIONS", "0", "VIGIL_PARTITIONS='0'"),
        ("VIGIL_KAFKA_BOOTSTRAP", "localhost", "VIGIL_KAFKA_BOOTSTRAP"),
        ("VIGIL_LOG_LEVEL", "LOUD", "VIGIL_LOG_LEVEL"),
        ("VIGIL_PRODUCE_TIMEOUT_S", "-1", "VIGIL_PRODUCE_TIMEOUT_S"),
    ],
)
def test_bad_value_names_the_variable(monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load(CommonSettings)
    assert expected in str(caught.value)


def test_bad_database_url_is_named_but_not_shown(monkeypatch):
    monkeypatch.setenv("VIGIL_DATABASE_URL", "mysql://root:hunter2@db/x")
    with pytest.raises(SettingsError) as caught:
        load(CommonSettings)
    assert "VIGIL_DATABASE_URL" in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_secret_not_in_repr(monkeypatch):
    monkeypatch.setenv("VIGIL_DATABASE_URL", "postgresql://u:hunter2@db/x")
    assert "hunter2" not in repr(load(CommonSettings))


def test_kafka_pass_through(monkeypatch):
    monkeypatch.setenv("VIGIL_KAFKA_OPT_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("VIGIL_KAFKA_OPT_SASL_MECHANISMS", "PLAIN")
    options = load(CommonSettings).kafka_client_options()
    assert options["security.protocol"] == "SASL_SSL" and options["sasl.mechanisms"] == "PLAIN"


@pytest.mark.parametrize("service", ["worker", "ingest", "scheduler", "dispatcher"])
def test_service_refuses_to_start_with_a_bad_setting(service):
    result = subprocess.run(
        [sys.executable, "-m", "vigil", service],
        env={"PATH": "/usr/bin:/bin", "VIGIL_PARTITIONS": "lots"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "VIGIL_PARTITIONS='lots'" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_subcommand_has_help():
    import click
    from click.testing import CliRunner

    from vigil.cli import main

    runner = CliRunner()
    ctx = click.Context(main)
    names = main.list_commands(ctx)
    assert len(names) >= 25  # the lazy table's commands, not only those imported
    for name in names:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, name
        command = main.get_command(ctx, name)
        if isinstance(command, click.Group):
            for sub in command.list_commands(ctx):
                assert runner.invoke(main, [name, sub, "--help"]).exit_code == 0, f"{name} {sub}"


def test_worker_fetch_batching_is_a_default_an_operator_can_override(monkeypatch):
    """The worker's consumer asks the broker for batched fetches (64 KB or 10 ms), which
    librdkafka accepts as given, and VIGIL_KAFKA_OPT_* still wins over them."""
    from confluent_kafka import Consumer

    from vigil.worker.consumer import consumer_config
    from vigil.worker.settings import WorkerSettings

    monkeypatch.setenv("VIGIL_DATABASE_URL", "postgresql://unused@127.0.0.1/unused")
    config = consumer_config(load(WorkerSettings), on_stats=lambda _: None)
    assert (config["fetch.min.bytes"], config["fetch.wait.max.ms"]) == (65536, 10)
    Consumer(config).close()  # librdkafka refuses an unknown property or a bad value here
    monkeypatch.setenv("VIGIL_KAFKA_OPT_FETCH_WAIT_MAX_MS", "100")
    assert consumer_config(load(WorkerSettings), on_stats=lambda _: None)["fetch.wait.max.ms"] == "100"


def test_the_worker_heartbeats_ten_times_per_session_timeout(monkeypatch):
    """A member learns of a rebalance from its next heartbeat, so every rebalance waits up to
    an interval per member: a tenth of the session timeout, never under 500 ms."""
    from vigil.worker.consumer import consumer_config
    from vigil.worker.settings import WorkerSettings

    monkeypatch.setenv("VIGIL_DATABASE_URL", "postgresql://unused@127.0.0.1/unused")
    assert consumer_config(load(WorkerSettings), on_stats=lambda _: None)["heartbeat.interval.ms"] == 1000
    monkeypatch.setenv("VIGIL_KAFKA_SESSION_TIMEOUT_MS", "3000")
    assert consumer_config(load(WorkerSettings), on_stats=lambda _: None)["heartbeat.interval.ms"] == 500


def test_a_revoke_grace_past_the_rebalance_timeout_is_refused(monkeypatch):
    """The revoke holds the consumer for its grace: longer than half the rebalance timeout
    (max.poll.interval.ms) and the group could drop the worker mid-revoke."""
    from vigil.worker.settings import WorkerSettings

    monkeypatch.setenv("VIGIL_KAFKA_MAX_POLL_INTERVAL_MS", "10000")
    with pytest.raises(SettingsError) as caught:
        load(WorkerSettings)
    assert "VIGIL_REVOKE_GRACE_S" in str(caught.value)
    monkeypatch.setenv("VIGIL_REVOKE_GRACE_S", "5")
    assert load(WorkerSettings).revoke_grace_s == 5.0
