#!/usr/bin/env bash
# Prepare, on this (CPU) machine, the wheels the lent GPU machine lacks for tests/gpu/check.sh:
# it has torch 2.11 (cu130), Python 3.12 and most of our dependencies, but no deepspeed, and
# older transformers / tokenizers than requirements.txt pins (its huggingface_hub 1.33 suits
# transformers 5.19; our pinned 2.4 would need httpx2, which it lacks). No vLLM (too big
# to carry) and no flash-attn there: the check uses the HF sampler and sdpa_varlen attention.
#   bash tests/gpu/wheels.sh        -> .whl/ (git-ignored, ~21 MB), then run check.sh with carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir .whl
pin() { grep -i "^$1==" requirements.txt; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$(pin transformers)" "$(pin tokenizers)" \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
# deepspeed ships as an sdist; without its C++ ops (JIT-built on first use, never here) the wheel is pure Python.
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$(pin deepspeed)"
ls -la .whl && du -sh .whl
