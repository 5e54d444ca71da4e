# Two entry points for a fresh machine: `make demo` and `make test` (the whole suite, as CI runs it;
# `make test-fast` is the fast lane: the tests not marked slow).
# Each creates .venv in the project root when missing and installs the pinned set (requirements.txt).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast docs lint bench gpu-suite-quick integrations clean-venv

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/emdlm demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -n 2 -q tests

# the fast lane: the tests not marked slow (none starts a process or compiles: tests/test_test_lanes.py)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q -m "not slow" tests

# the documentation site (mkdocs.yml) on http://127.0.0.1:8000; CI builds it with --strict
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_ntil.py
	$(BIN)/python benchmarks/bench_emo.py

# CPU dry run of the GPU suite (tiny shapes; docs/gpu.md has the real run on a GPU machine)
gpu-suite-quick: $(STAMP)
	$(BIN)/python benchmarks/gpu_suite.py --quick --out runs/gpu_suite_quick.md

# Axolotl, ms-swift and LLaMA-Factory for real: one venv per framework under $(INTEGRATIONS)
# (git-ignored; the first build takes a long time), a tiny CPU training through each one's own
# entry point with CE and NTIL, the route's unit tests in its venv, then
# docs/results/integrations.md. Not part of `make test` (slow).
INTEGRATIONS ?= .integrations
INTEGRATION_RUNS := axolotl swift llamafactory
integrations:
	bash benchmarks/integrations/build_venvs.sh $(INTEGRATIONS) $(INTEGRATION_RUNS)
	rm -rf $(INTEGRATIONS)/work $(INTEGRATIONS)/results
	for fw in $(INTEGRATION_RUNS); do \
	  (cd benchmarks/integrations && ../../$(INTEGRATIONS)/$$fw/bin/python run_$$fw.py \
	    ../../$(INTEGRATIONS)/work/$$fw ../../$(INTEGRATIONS)/results/$$fw.json) \
	    || echo "$$fw: the run failed (see $(INTEGRATIONS)/work/$$fw)"; \
	done
	$(PYTHON) benchmarks/integrations/report.py $(INTEGRATIONS)/results docs/results/integrations.md

clean-venv:
	rm -rf $(VENV)
