# shmstore — `make help` lists the targets. Every target does its own set-up on a fresh machine.
.DEFAULT_GOAL := help
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)

.PHONY: soak soak-short help venv build test test-rust test-python test-torch fuzz wheels test-wheel demo bench bench-format lint doctest format clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.deps ## create .venv with the build and test dependencies

build: venv ## release build of the extension, installed into .venv
	rm -f python/shmstore/_native.*.so  # a stale build of the other kind (abi3 or not) would shadow it
	$(VENV)/bin/maturin develop --release -q

test-rust: ## cargo test of the pure-Rust layers (no Python needed)
	cargo test --release -q

test-python: build ## pytest (slow tests included)
	$(PY) -m pytest -q

test: build test-rust test-python ## set up everything, then run the Rust and Python tests

# torch (~6 GB installed with its CUDA libraries from PyPI; about 2 min to download and install
# here) is kept out of .venv and `make test`; this target runs the tests that skip without it
# (real DataLoader, torch.distributed, torchrun --nnodes=2 across namespace machines) in
# .venv-torch. CI runs it after `make test` (.ci/run).
TORCH_VENV ?= .venv-torch
test-torch: venv ## the integration tests with real torch, in .venv-torch (~6 GB, installed once)
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q torch -r requirements-dev.txt
	rm -rf target/torch-wheel
	$(VENV)/bin/maturin build --release -q -o target/torch-wheel -i $(TORCH_VENV)/bin/python
	$(TORCH_VENV)/bin/python -m pip install -q --force-reinstall --no-deps target/torch-wheel/*.whl
	$(TORCH_VENV)/bin/python -m pytest -q tests/test_integrations.py tests/test_examples.py \
		tests/test_cluster.py

# CI runs 20k cases each way inside `make test`; this runs many more, from other seeds.
FUZZ_CASES ?= 1000000
FUZZ_SEED ?= 100000
fuzz: build ## structure-aware fuzzing of the readers (FUZZ_CASES Rust cases, 1/10 as many in Python)
	SHMSTORE_FUZZ_CASES=$(FUZZ_CASES) SHMSTORE_FUZZ_SEED=$(FUZZ_SEED) \
		cargo test --release -q --lib fuzz_cases_never_crash_the_reader -- --nocapture
	SHMSTORE_FUZZ_CASES=$$(( $(FUZZ_CASES) / 10 )) SHMSTORE_FUZZ_SEED=$(FUZZ_SEED) \
		$(PY) -m pytest -q -s tests/test_fuzz.py

# Fault campaign (benchmarks/soak.py): random traffic in several processes, SIGKILL/SIGSTOP of
# workers and of the supervisor, a full tmpfs and planted state directories (as root). CI runs
# the short one; the long one (SOAK_FAULTS injected faults) writes benchmarks/results/soak.md.
SOAK_FAULTS ?= 100000
SOAK_SECONDS ?= 1500
soak: build ## long fault campaign (100,000 faults, ~10 min alone on 2 cores), report in benchmarks/results/soak.md
	$(PY) benchmarks/soak.py --seed 1 --faults $(SOAK_FAULTS) --seconds $(SOAK_SECONDS) \
		--interval 0.005 --out benchmarks/results/soak.md
soak-short: build ## bounded fault campaign for CI (under 3 minutes)
	$(PY) benchmarks/soak.py --seed 1 --faults 10000 --seconds 90 --settle 30 --interval 0.005

# Release artifacts (docs/install.md), linked for glibc 2.17 (manylinux2014) with zig (ziglang
# from PyPI): one version-specific wheel per CPython found here (the fast build), one abi3 wheel
# that every later CPython installs (the fallback: a little slower, benchmarks/results/abi3.md),
# and the sdist.
WHEEL_INTERPRETERS ?= $(shell for v in 3.11 3.12 3.13 3.14; do \
	for p in python$$v $$HOME/.pyenv/versions/$$v*/bin/python$$v /usr/bin/python$$v; do \
	if $$p -c "" 2>/dev/null; then command -v $$p; break; fi; done; done)
ZIG_BUILD = $(VENV)/bin/maturin build --release --zig --compatibility manylinux2014 \
	--target x86_64-unknown-linux-gnu -o dist
wheels: venv ## manylinux2014 x86_64 wheels (per CPython found + abi3 fallback) and sdist into dist/
	$(PY) -m pip install -q "ziglang>=0.13"
	rm -rf dist
	$(ZIG_BUILD) -i $(WHEEL_INTERPRETERS)
	$(ZIG_BUILD) --features python,abi3 -i $(PY)
	$(VENV)/bin/maturin sdist -o dist
	ls -l dist

# The wheel as a user gets it: a fresh venv of WHEEL_PYTHON (any CPython >= 3.11), the test
# dependencies, then shmstore from dist/ as pip picks it (or WHEEL=dist/<file>.whl), and the
# suite against the installed package.
WHEEL_PYTHON ?= $(PYTHON)
WHEEL_VENV ?= target/venv-wheel
WHEEL ?= shmstore
test-wheel: ## the suite against a wheel from dist/ in a fresh venv of WHEEL_PYTHON
	rm -rf $(WHEEL_VENV)
	$(WHEEL_PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip install -q -r requirements-dev.txt
	$(WHEEL_VENV)/bin/python -m pip install -q --no-index --find-links dist $(WHEEL)
	$(WHEEL_VENV)/bin/python -m pytest -q -p no:cacheprovider

demo: build ## memory: plain list vs pickle buffer vs shmstore, fork/spawn/forkserver (~3 min)
	$(PY) benchmarks/demo.py

# Baselines only the benchmarks need (msgpack, pyarrow), kept out of the test dependencies.
$(VENV)/.bench-deps: benchmarks/requirements.txt $(VENV)/.deps
	$(PY) -m pip install -q -r benchmarks/requirements.txt
	touch $@

bench: build $(VENV)/.bench-deps ## all acceptance benchmarks; results go to benchmarks/results/
	$(PY) benchmarks/run_all.py

BENCH_FORMAT_ARGS ?=
bench-format: build $(VENV)/.bench-deps ## the compact-format targets in one run (~10 min) -> benchmarks/results/format.md
	$(PY) benchmarks/bench_format.py $(BENCH_FORMAT_ARGS)

PY_SOURCES := python tests benchmarks examples build_backend

lint: build ## everything CI checks besides the tests (also run by pre-commit)
	cargo fmt --check
	cargo clippy --all-targets -q -- -D warnings
	cargo clippy --all-targets --features python -q -- -D warnings
	.ci/check-exceptions
	$(VENV)/bin/ruff check $(PY_SOURCES)
	$(VENV)/bin/ruff format --check $(PY_SOURCES)
	$(PY) -m mypy --strict python
	MYPYPATH=typings $(PY) -m mypy --strict examples/typed_usage.py
	$(VENV)/bin/basedpyright examples/typed_usage.py
	$(PY) -m mypy.stubtest shmstore._native
	$(MAKE) --no-print-directory doctest

doctest: build ## run the examples in the docstrings
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules python/shmstore

format: venv ## format Rust and Python
	cargo fmt
	$(VENV)/bin/ruff format $(PY_SOURCES)
	$(VENV)/bin/ruff check --fix $(PY_SOURCES)

clean: ## remove build products and the venv
	cargo clean
	rm -rf $(VENV) $(TORCH_VENV) target dist
