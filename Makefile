# The README's two commands: `make demo` and `make test`. Everything else is setup.
PYTHON ?= python3
VENV ?= .venv
# A GPU user overrides this, e.g. `make setup TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'`.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast test-torch-min demo demo-quick finetune-demo lint bench plot gpu-wheels image clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The floor pyproject states (torch>=2.11: what GPU images ship, with torchao 0.17 as there),
# tested. `make test` runs the tests of what moved in torch between the floor and the torch
# `setup` installs (FLOOR_TESTS: FSDP, its checkpoints, tensor and pipeline parallelism, planned
# and compiled attention; FLOOR_TESTS= skips them) on torch 2.11.0, and `make test-torch-min`
# the whole fast suite (TESTS_MIN=tests/distributed: all the strategies). Their
# venv holds torch and torchao alone and reads every other package from .venv (a .pth file adds
# .venv's site-packages after its own): from the registry torch 2.11.0 is the CUDA build (4.6 GB
# with its CUDA libraries; it runs on CPU), about 50 s to install, where a whole second venv
# took 3 minutes.
VENV_MIN ?= .venv-torch-min
TORCH_MIN ?= torch==2.11.0 torchao==0.17.0
FLOOR_TESTS ?= $(addprefix tests/distributed/test_,fsdp.py fsdp_checkpoints.py \
	fsdp_mixed_precision.py tensor_parallel.py pipeline_parallel.py) \
	tests/models/test_sdpa_plan.py tests/models/test_mpt_compile.py
TESTS_MIN ?= tests
PY_MIN := $(VENV_MIN)/bin/python
SITE := import sysconfig; print(sysconfig.get_path('purelib'))

$(VENV_MIN)/.installed: $(STAMP)
	test -x $(PY_MIN) || $(PYTHON) -m venv $(VENV_MIN)
	$(PY_MIN) -m pip install -q $(TORCH_MIN)
	echo "import site; site.addsitedir('$$($(PY) -c "$(SITE)")')" \
		>"$$($(PY_MIN) -c "$(SITE)")/llmfoundry-dev.pth"
	$(PY_MIN) -c "import torch, hydra; print('floor venv: torch', torch.__version__)"
	touch $@

# The suite in two processes (pytest-xdist; a file's tests stay in one, so its module fixtures
# run once), and beside it the floor's tests (above) in a third.
test: setup $(if $(FLOOR_TESTS),$(VENV_MIN)/.installed)
	@$(if $(FLOOR_TESTS),$(PY_MIN) -m pytest -q -p no:cacheprovider -m "not slow" $(FLOOR_TESTS) \
		>$(VENV_MIN)/floor.log 2>&1 & floor=$$!;) \
	$(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS) tests; status=$$?; \
	$(if $(FLOOR_TESTS),wait $$floor || status=1; \
		echo "--- the floor (torch 2.11.0): $(FLOOR_TESTS)"; tail -n 25 $(VENV_MIN)/floor.log;) \
	exit $$status

# Everything but the end-to-end script runs (tests marked `slow`): a quick check while editing.
test-fast: setup
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

test-torch-min: $(VENV_MIN)/.installed
	$(PY_MIN) -m pytest -q -n 2 --dist loadfile -m "not slow" $(PYTEST_ARGS) $(TESTS_MIN)

# The demo corpus: this Python's own standard library sources (every Python ships them).
DEMO := data/demo
STDLIB = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")

# The README's time for the demo's training (600 batches) on 2 cores: far beyond it, the run says
# so once and points to demo-quick (a quarter of the batches, still ending with a sample).
# Its runs are named demo-<time>, so finetune-demo finds the model of this tokenizer.
demo: setup $(DEMO)/mds/meta.json
	$(PY) scripts/train.py run_name=demo-$$(date +%Y%m%d-%H%M%S) \
		callbacks.runtime_estimator.expected_minutes=12 \
		'callbacks.runtime_estimator.hint=make demo-quick trains 150 batches and still ends with a sample'

demo-quick: setup $(DEMO)/mds/meta.json
	$(PY) scripts/train.py run_name=demo-quick-$$(date +%Y%m%d-%H%M%S) max_duration=150ba scheduler.t_warmup=15ba eval_interval=50ba

$(DEMO)/mds/meta.json: | setup
	$(PY) data_prep/text_to_tokens.py $(STDLIB) --glob '*.py' --exclude site-packages \
		--exclude test --exclude '*/test' --exclude '*/tests' --exclude idlelib --exclude lib2to3 \
		--train-tokenizer --vocab-size 8192 --workers 2 --out $(DEMO)/tokens.bin
	$(PY) data_prep/tokens_to_mds.py $(DEMO)/tokens.bin --seq-len 256 --val-fraction 0.02 \
		--out $(DEMO)/mds

# Instruction finetuning of the `make demo` model (README "After pretraining"): pairs of a stdlib
# function's signature (prompt) and its docstring (response); only response tokens count. Then
# both models take a multiple-choice test made from the stdlib's test folders (held out).
# PRETRAINED: the checkpoints to start from (default: the newest `make demo` or `make demo-quick`
# run: a run of another recipe may have another tokenizer of the same vocabulary size, which
# nothing would notice).
SFT := $(DEMO)/sft
TASK := $(DEMO)/tasks/docstrings.jsonl
PRETRAINED ?= $$(ls -td outputs/demo-*/checkpoints 2>/dev/null | head -1)
FINETUNE_RUN := finetune-$(shell date +%Y%m%d-%H%M%S)

finetune-demo: setup $(SFT)/meta.json $(TASK)
	@test -n "$(PRETRAINED)" || { echo "error: no demo model under outputs/demo-*: run make demo (or make demo-quick) first, or pass PRETRAINED=<checkpoints folder>" >&2; exit 2; }
	$(PY) scripts/eval.py $(PRETRAINED) $(TASK) --out outputs/$(FINETUNE_RUN)/eval-pretrained.json
	$(PY) scripts/train.py +experiment=finetune load_path=$(PRETRAINED) data.remote=$(SFT) \
		run_name=$(FINETUNE_RUN) max_duration=120ba eval_interval=20ba eval_subset_num_batches=4
	$(PY) scripts/eval.py outputs/$(FINETUNE_RUN)/checkpoints $(TASK) \
		--out outputs/$(FINETUNE_RUN)/eval-finetuned.json

$(SFT)/meta.json: | setup $(DEMO)/mds/meta.json
	$(PY) data_prep/instructions_to_mds.py --from-python-sources $(STDLIB) \
		--tokenizer $(DEMO)/mds/tokenizer.json --seq-len 256 --val-fraction 0.05 --out $(SFT)

$(TASK): | setup $(DEMO)/mds/meta.json
	$(PY) data_prep/docstring_task.py $(STDLIB)/test --tokenizer $(DEMO)/mds/tokenizer.json \
		--out $(TASK) --limit 200

lint: setup
	$(PY) -m ruff check llmfoundry scripts data_prep tests bench
	$(PY) -m ruff format --check llmfoundry scripts data_prep tests bench

# Loss, lr and throughput curves of the latest run that logged metrics, as PNGs in its plots/.
plot: setup
	$(PY) scripts/plot.py $$(dirname "$$(ls -t outputs/*/metrics.jsonl | head -1)")

bench: setup
	$(PY) bench/data_loader.py

# The packages a GPU machine without network lacks (bench/gpu_wheels.txt), as wheels for its
# Python (GPU_PYTHON, x86-64 Linux) in .whl/, which bench/gpu_acceptance.sh installs from.
GPU_PYTHON ?= 3.12
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
gpu-wheels: setup
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --implementation cp \
		--python-version $(GPU_PYTHON) $(addprefix --platform ,$(GPU_PLATFORMS)) \
		-d .whl -r bench/gpu_wheels.txt
	$(PY) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3

# The training image Kubernetes jobs run (Dockerfile: the CUDA torch of pyproject's floor, the
# project and a cluster's extras, a non-root user): IMAGE=registry/name:tag, then docker push it.
IMAGE ?= llmfoundry:latest
image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) $(VENV_MIN) outputs data/demo .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
