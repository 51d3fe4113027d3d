# The README's two commands: `make demo` and `make test`. Everything else is setup.
PYTHON ?= python3
VENV ?= .venv
# A GPU user overrides this, e.g. `make setup TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'`.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo lint bench plot clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

# Everything but the end-to-end script runs (tests marked `slow`): a quick check while editing.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

# The demo corpus: this Python's own standard library sources (every Python ships them).
DEMO := data/demo
STDLIB = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")

demo: setup $(DEMO)/mds/meta.json
	$(PY) scripts/train.py

$(DEMO)/mds/meta.json: | setup
	$(PY) data_prep/text_to_tokens.py $(STDLIB) --glob '*.py' --exclude site-packages \
		--exclude test --exclude '*/test' --exclude '*/tests' --exclude idlelib --exclude lib2to3 \
		--train-tokenizer --vocab-size 8192 --workers 2 --out $(DEMO)/tokens.bin
	$(PY) data_prep/tokens_to_mds.py $(DEMO)/tokens.bin --seq-len 256 --val-fraction 0.02 \
		--out $(DEMO)/mds

lint: setup
	$(PY) -m ruff check llmfoundry scripts data_prep tests bench
	$(PY) -m ruff format --check llmfoundry scripts data_prep tests bench

# Loss, lr and throughput curves of the latest run that logged metrics, as PNGs in its plots/.
plot: setup
	$(PY) scripts/plot.py $$(dirname "$$(ls -t outputs/*/metrics.jsonl | head -1)")

bench: setup
	$(PY) bench/data_loader.py

clean:
	rm -rf $(VENV) outputs data/demo .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
