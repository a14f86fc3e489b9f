# vigil: `make up` starts the whole system on this machine, `make test` runs every test.
.DEFAULT_GOAL := help
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help install up demo down status logs test test-fast lint fmt bench bench-quick chaos clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	@touch $(STAMP)

install: $(STAMP) ## Create .venv and install vigil with its pinned dependencies

up: $(STAMP) ## Start Kafka, PostgreSQL and the four services under .run/, then run the demo (not when already up)
	$(BIN)/vigil dev up --demo

demo: $(STAMP) ## Run the demonstration against the running stack
	. .run/env && $(BIN)/vigil demo

down: ## Stop everything `make up` started
	@if [ -x $(BIN)/vigil ]; then $(BIN)/vigil dev down; else echo "nothing to stop"; fi

status: $(STAMP) ## Show which parts of the local stack run
	$(BIN)/vigil dev status

logs: ## Follow the services' logs
	tail -F .run/logs/*.log

test: lint ## Run the linter, then every test (starts its own Kafka and PostgreSQL unless VIGIL_* name a stack)
	$(BIN)/pytest -q

lint: $(STAMP) ## ruff: lint and check formatting (settings in pyproject.toml)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP) ## ruff: fix what can be fixed and format
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP) ## Run the benchmarks (about 10 minutes) and print name: value lines
	$(BIN)/python -m vigil.bench

bench-quick: $(STAMP) ## The benchmarks' smoke mode (under 2 minutes)
	$(BIN)/python -m vigil.bench --quick

SEED ?= 1
chaos: $(STAMP) ## The nemesis under load on a stack of its own (.run/chaos): 30 faults, seeded (SEED=n); ends PASS or FAIL
	$(BIN)/python -m vigil.chaos --seed $(SEED) $(CHAOS_ARGS)

clean: down ## Stop the stack and delete .run/ (Kafka jars, data, logs)
	rm -rf .run
