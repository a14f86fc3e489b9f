"""``python -m vigil_dev.evals [--script FILE] [--model ID] [--only NAME]`` (``make eval``).

Offline unless ``ANTHROPIC_API_KEY`` is set and ``ANTHROPIC_BASE_URL`` is not: then the
real model is measured. Prints the mode, the model id and the table; exit status 0 when
every scenario passed, 1 when one failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vigil.agent.settings import DEFAULT_MODEL
from vigil_dev import agent_testing
from vigil_dev.evals.harness import run_all, table
from vigil_dev.evals.scenarios import SCENARIOS
from vigil_dev.scripted_server import ScriptedServer, load_script

OFFLINE_SCRIPT = Path(__file__).with_name("offline_script.json")
OFFLINE_CLASSIFIER = "claude-scripted-classifier"
LIVE_CLASSIFIER = "claude-haiku-4-5"


def live() -> bool:
    return bool(os.environ.get("ANTHROPIC_API_KEY")) and not os.environ.get("ANTHROPIC_BASE_URL")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vigil_dev.evals", description=__doc__.splitlines()[0])
    parser.add_argument("--script", type=Path, default=OFFLINE_SCRIPT, help="offline: the scripted model's rules")
    parser.add_argument("--model", default=None, help=f"live: the model id (default {DEFAULT_MODEL})")
    parser.add_argument(
        "--classifier-model",
        default=None,
        help=f"auto mode's classifier (default: offline {OFFLINE_CLASSIFIER}, live {LIVE_CLASSIFIER})",
    )
    parser.add_argument("--no-classifier", action="store_true", help="measure auto mode's per-tool rule alone")
    parser.add_argument("--only", action="append", default=[], help="run only this scenario (repeatable)")
    args = parser.parse_args(argv)
    scenarios = [s for s in SCENARIOS if not args.only or s.name in args.only]
    if not scenarios:
        parser.error(f"no scenario named {', '.join(args.only)}")
    if live():
        model = args.model or os.environ.get("VIGIL_MODEL") or DEFAULT_MODEL
        classifier = "" if args.no_classifier else args.classifier_model or LIVE_CLASSIFIER
        settings = agent_testing.settings(model=model, model_backoff_s=1.0, auto_classifier_model=classifier)
        print(f"eval: live, model {model}, classifier {classifier or 'off'}", flush=True)
        scores = run_all(scenarios, settings, {})
    else:
        classifier = "" if args.no_classifier else args.classifier_model or OFFLINE_CLASSIFIER
        model = args.model or agent_testing.SCRIPTED_MODEL
        settings = agent_testing.settings(model=model, auto_classifier_model=classifier)
        with ScriptedServer(load_script(args.script)) as server:
            print(
                f"eval: offline (scripted Messages API, {args.script.name}), model {model}, "
                f"classifier {classifier or 'off'}",
                flush=True,
            )
            scores = run_all(scenarios, settings, {"base_url": server.base_url, "api_key": "eval-offline"})
    print(table(scores))
    return 0 if all(s.passed for s in scores) else 1


if __name__ == "__main__":
    sys.exit(main())
