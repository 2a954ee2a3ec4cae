# make setup: a venv in .venv with the package and its test extras.
# make demo:  the main job. make test: the CPU test suite (what CI runs).
# make sass-offline ONLY=fp8-fp8,bf16 [SASS_ARGS="--heads 16"]: ptxas's report and the SASS of the kernels, compiled
#             for a compile-only Hopper on this CPU (bench/sass.py --offline; a 4 GB venv of
#             the CUDA plugin in $(CUDA_VENV), made once; the ptxas on PATH comes first).
PYTHON ?= $(shell for p in $$HOME/.pyenv/versions/3.12.*/bin/python python3.12 python3.13 python3; do \
  $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python

CUDA_VENV ?= /tmp/snapmla-cuda-venv
SASS_OUT ?= /tmp/snapmla-sass
ONLY ?= fp8-fp8
# e.g. SASS_ARGS="--heads 16 --batch 128" for swap_ab's shapes
SASS_ARGS ?=

.PHONY: setup demo test sass-offline bench-gpu clean

$(PY):
	@test -n "$(PYTHON)" || { echo "no Python >= 3.12 found; set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'

setup: $(PY)

demo: $(PY)
	$(PY) -m models.cli

# Two workers (CI's two cores): 9.5 min against 12.8 on this 2-core machine.
test: $(PY)
	$(PY) -m pytest -q -n 2

$(CUDA_VENV)/bin/python:
	@test -n "$(PYTHON)" || { echo "no Python >= 3.12 found; set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install -q 'jax[cuda13]==0.11.2' nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm flax chex

sass-offline: $(CUDA_VENV)/bin/python
	PATH="$$PATH:$$(echo $(CUDA_VENV)/lib/python3*/site-packages/nvidia/cu13/bin)" \
	JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu PYTHONPATH=. \
	  $(CUDA_VENV)/bin/python bench/sass.py --offline --out $(SASS_OUT) --only $(ONLY) $(SASS_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
