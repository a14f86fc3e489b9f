# vigil: `make up` starts the whole system on this machine, `make test` runs every test.
.DEFAULT_GOAL := help
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
UV_VERSION := 0.13.9
# The dev stack's run dir: vigil-dev reads the same setting.
RUN_DIR := $(or $(VIGIL_DEV_RUN_DIR),.run)

.PHONY: help install up demo down status logs test suite test-fast lint fmt bench bench-quick chaos eval clean lock tools

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml examples/vigil-refund-tool/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# uv installs what pip would, in seconds where pip takes a minute and a half on a fresh machine.
	$(BIN)/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	# The demo's refund tool is a tool package (docs/agent.md, "Adding tools"): the dev stack and the tests use it.
	# Compiled once here: where PYTHONDONTWRITEBYTECODE is set (CI's image sets it) no process
	# writes a .pyc, and every one would compile what it imports (anthropic's types alone: 4.9 s
	# of CPU without them, 2.1 s with) at each of the suite's thousands of process starts.
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e ".[test]" -e examples/vigil-refund-tool
	$(BIN)/python -m compileall -q -j 0 services examples >/dev/null
	@touch $(STAMP)

install: $(STAMP) ## Create .venv and install vigil with its pinned dependencies and the example tool package

up: $(STAMP) ## Start Kafka, PostgreSQL, the five services and the offline model under .run/, then the demo; SCRIPT=FILE: the model answers from FILE (no demo)
	$(BIN)/vigil-dev up --demo $(if $(SCRIPT),--script "$(SCRIPT)")

demo: $(STAMP) ## Run the demonstration against the running stack
	. $(RUN_DIR)/env && $(BIN)/vigil-dev demo

down: ## Stop everything `make up` started
	@if [ -x $(BIN)/vigil-dev ]; then $(BIN)/vigil-dev down; else echo "nothing to stop"; fi

status: $(STAMP) ## Show which parts of the local stack run
	$(BIN)/vigil-dev status

logs: ## Follow the services' logs
	tail -F $(RUN_DIR)/logs/*.log

test: lint suite ## Run the linter, then every test (starts its own Kafka and PostgreSQL unless VIGIL_* name a stack)

# Parallel test processes (pytest-xdist): measured on 2 cores, docs/architecture.md "Tests".
TEST_WORKERS ?= 4
# Three phases; each runs, whatever the others' outcome, and the target fails if any failed.
# pytest's exit 5 (no test selected, e.g. PYTEST_ARGS naming only solo tests) fails none. After
# the parallel phase the solo phase runs beside the tools phase, which first builds the Go tools
# (or waits for `make tools` building them in the background, as CI does): only its `tools`
# tests use them, and they load the machine little. The tools phase's output follows the solo
# phase's.
suite: $(STAMP) ## Every test without the linter: in parallel, then the solo tests (@pytest.mark.solo) one at a time beside the Go-tool tests (.tools)
	@status=0; started=$$SECONDS; \
	echo "tests: parallel phase (-n $(TEST_WORKERS) --dist loadgroup -m 'not solo and not tools')"; \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not solo and not tools" --durations=25 $(PYTEST_ARGS); rc=$$?; \
	[ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=$$rc; parallel=$$((SECONDS - started)); \
	tools_out=$$(mktemp); \
	( t0=$$SECONDS; $(MAKE) --no-print-directory tools || exit 2; built=$$((SECONDS - t0)); \
	  echo "tests: tools phase (-m tools, one at a time; the Go tools waited for $${built}s)"; \
	  $(BIN)/pytest -q -m "tools" --durations=10 $(PYTEST_ARGS); rc=$$?; \
	  echo "tests: tools phase took $$((SECONDS - t0))s in all"; \
	  [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc ) > $$tools_out 2>&1 & tools_pid=$$!; \
	echo "tests: solo phase (-m 'solo and not tools', one at a time; the tools phase beside it)"; \
	$(BIN)/pytest -q -m "solo and not tools" --durations=10 $(PYTEST_ARGS); rc=$$?; \
	[ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=$$rc; solo=$$((SECONDS - started - parallel)); \
	wait $$tools_pid || status=$$?; cat $$tools_out; rm -f $$tools_out; \
	echo "tests: parallel phase $${parallel}s, solo phase $${solo}s (the tools phase beside it), total $$((SECONDS - started))s"; \
	exit $$status

test-fast: $(STAMP) tools ## The tests that start no Kafka and no PostgreSQL (pytest -m "not stack"), under two minutes
	$(BIN)/pytest -q -m "not stack"

lint: $(STAMP) ## ruff (lint, formatting), import-linter (the layers), mypy (types); settings in pyproject.toml
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

fmt: $(STAMP) ## ruff: fix what can be fixed and format
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP) ## Run the benchmarks (about 12 minutes on 2 cores; River's CLI is built once per machine) and print name: value lines
	$(BIN)/python -m vigil_dev.bench

bench-quick: $(STAMP) ## The benchmarks' smoke mode (under 3 minutes; skips River)
	$(BIN)/python -m vigil_dev.bench --quick

SEED ?= 1
SHARDS ?= 1
MODEL_EXAMPLES ?= 300
chaos: $(STAMP) ## The ledger's model test with MODEL_EXAMPLES examples (a random seed, printed), then the nemesis under load on a stack of its own (.run/chaos): 30 faults, seeded (SEED=n), SHARDS=n ledger shards; ends PASS or FAIL
	VIGIL_MODEL_EXAMPLES=$(MODEL_EXAMPLES) VIGIL_MODEL_SEED=random $(BIN)/pytest -q -s -o timeout=1800 tests/test_ledger_model.py
	$(BIN)/python -m vigil_dev.chaos --seed $(SEED) --shards $(SHARDS) $(CHAOS_ARGS)

MODEL ?=
eval: $(STAMP) ## The agent's behaviour across scenarios, as a table: offline (scripted model) unless ANTHROPIC_API_KEY is set (MODEL=id)
	$(BIN)/python -m vigil_dev.evals $(if $(MODEL),--model $(MODEL)) $(EVAL_ARGS)

clean: down ## Stop the stack and delete .run/ (Kafka jars, data, logs)
	rm -rf .run

# Go-built checkers for deploy/ (tests/test_deploy.py) and the bench's peer (River's CLI,
# tests/test_bench_river.py), built once per machine outside the repo.
TOOLS := $(HOME)/.cache/vigil/tools
KUBE_SCORE_VERSION := v1.20.0
KUSTOMIZE_VERSION := v5.8.2
$(TOOLS)/kube-score-$(KUBE_SCORE_VERSION)/kube-score:
	@bash deploy/tools/build-go-install.sh kube-score github.com/zegl/kube-score/cmd/kube-score $(KUBE_SCORE_VERSION) >/dev/null
$(TOOLS)/kustomize-$(KUSTOMIZE_VERSION)/kustomize:
	@bash deploy/tools/build-go-install.sh kustomize sigs.k8s.io/kustomize/kustomize/v5 $(KUSTOMIZE_VERSION) >/dev/null

tools: $(TOOLS)/kube-score-$(KUBE_SCORE_VERSION)/kube-score $(TOOLS)/kustomize-$(KUSTOMIZE_VERSION)/kustomize ## Build kube-score, kustomize, promtool, prometheus and River's CLI (Go) under ~/.cache/vigil/tools, once
	@bash deploy/tools/build-prometheus.sh >/dev/null
	@bash deploy/tools/build-river.sh >/dev/null

lock: $(STAMP) ## Refresh deploy/requirements.lock (exact versions and hashes the image installs) from pyproject.toml
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes --upgrade -o deploy/requirements.lock
