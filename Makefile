# The README's two commands: `make demo` and `make test`. Everything else is setup.
PYTHON ?= python3
VENV ?= .venv
# A GPU user overrides this, e.g. `make setup TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'`.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) scripts/demo.py

lint: setup
	$(PY) -m ruff check llmfoundry scripts data_prep tests bench
	$(PY) -m ruff format --check llmfoundry scripts data_prep tests bench

bench: setup
	$(PY) bench/data_loader.py

clean:
	rm -rf $(VENV) outputs data/demo .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
