# One command each; every target installs what it needs first (.venv, via scripts/install.py).
PY := .venv/bin/python
# The interpreter that builds .venv (>= 3.11 with venv; install.py says how to get one).
PYTHON ?= python3

.PHONY: install lock demo test check chaos hosts bench bench-models bench-fleet bench-scale bench-prefix gpu-check gpu-check-compose lint clean

install:
	@$(PYTHON) scripts/install.py

lock: install        ## rewrite locks/ after a change to pyproject.toml (ARGS=--upgrade: newest allowed)
	$(PY) scripts/lock.py $(ARGS)

demo: install        ## a demo batch end to end on embedded PostgreSQL and Redis
	$(PY) -m demo

# The in-process tiers (unit, API) run first, one process per core. The tiers with real
# processes, engines and faults then run in two workers (tests/streams.py): the real vLLM
# engine's tests one at a time, and beside them the other process tests, which mostly wait.
test: install        ## every test: unit, API, process stacks, end to end with vLLM, chaos, hosts
	$(PY) -m pytest -q -m "not e2e and not chaos and not hosts and not slow" \
		-n auto --maxprocesses 4; fast=$$?; \
	$(PY) -m pytest -m "e2e or chaos or hosts or slow" -n 2 --streams \
		--durations=15; slow=$$?; \
	exit $$(( fast || slow ))

check: install       ## the edit loop: unit and API tests, no real engine, no process stacks
	$(PY) -m pytest -q -m "not e2e and not chaos and not hosts and not slow" \
		--hypothesis-profile=check \
		-n auto --maxprocesses 4 -W error::ResourceWarning

chaos: install       ## only the chaos suite, with its one-line-per-scenario summary
	$(PY) -m pytest tests/chaos -m chaos

hosts: install       ## only the multi-host tier (root: network namespaces), with its summary
	$(PY) -m pytest tests/hosts -m hosts

bench: install       ## raw engine vs the job system at 64 and 16 tokens, the fake-engine ceiling, CPU by stage (ARGS=--only ceiling, --profile, --rounds N, --items N)
	$(PY) -m bench.throughput $(ARGS)

bench-models: install ## two models, a worker each, routed out of one job vs one model alone (ARGS=--rounds N, --items N)
	$(PY) -m bench.models $(ARGS)

bench-fleet: install  ## 8 workers on one 50,000-item job vs one worker alone: scaling, Postgres lock waits and CPU per item (ARGS=--rounds N, --items N, --workers N)
	$(PY) -m bench.fleet $(ARGS)

bench-scale: install ## a 100,000-item job: submit, status, results
	$(PY) -m bench.scale $(ARGS)

bench-prefix: install ## documents asked several questions each, claimed in prefix order vs the job's order: items/s and the prefix cache's hit rate (ARGS=--rounds N, --docs N, --blocks N)
	$(PY) -m bench.prefix $(ARGS)

gpu-check:           ## on a GPU host: Python, driver, compilers, the real stack, thinking on/off and a budget, items/s vs raw
	@$(PYTHON) scripts/gpu_check.py --preflight
	@$(MAKE) --no-print-directory install
	$(PY) scripts/gpu_check.py $(ARGS)

gpu-check-compose:   ## on a compose GPU host: the driver, then thinking on/off and a thinking budget through the running API (ARGS=--url URL --api-key KEY)
	@$(PYTHON) scripts/gpu_check.py --compose $(ARGS)

lint: install        ## ruff (rules and format) and mypy --strict on thinkbatch/, api/, worker/, devstack/, bench/ and scripts/
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) -m mypy

clean:
	rm -rf .venv .thinkbatch
