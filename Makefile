# shmstore — `make help` lists the targets. Every target does its own set-up on a fresh machine.
.DEFAULT_GOAL := help
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)

.PHONY: help venv build test test-rust test-python demo bench lint format clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.deps ## create .venv with the build and test dependencies

build: venv ## release build of the extension, installed into .venv
	$(VENV)/bin/maturin develop --release -q

test-rust: ## cargo test of the pure-Rust layers (no Python needed)
	cargo test --release -q

test-python: build ## pytest (slow tests included)
	$(PY) -m pytest -q

test: build test-rust test-python ## set up everything, then run the Rust and Python tests

demo: build ## memory comparison: plain list vs pickle buffer vs shmstore (< 2 min)
	$(PY) benchmarks/demo.py

bench: build ## all acceptance benchmarks; results go to benchmarks/results/
	$(PY) benchmarks/run_all.py

lint: build ## rustfmt, clippy, ruff, mypy stubtest of the hand-kept _native.pyi
	cargo fmt --check
	cargo clippy --all-targets -q -- -D warnings
	cargo clippy --all-targets --features python -q -- -D warnings
	$(VENV)/bin/ruff check python tests benchmarks
	$(VENV)/bin/ruff format --check python tests benchmarks
	$(PY) -m mypy.stubtest shmstore._native

format: venv ## format Rust and Python
	cargo fmt
	$(VENV)/bin/ruff format python tests benchmarks
	$(VENV)/bin/ruff check --fix python tests benchmarks

clean: ## remove build products and the venv
	cargo clean
	rm -rf $(VENV) target
