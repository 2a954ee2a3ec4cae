# make setup: a venv in .venv with the package and its test extras.
# make demo:  the main job. make test: the CPU test suite (what CI runs).
PYTHON ?= $(shell for p in $$HOME/.pyenv/versions/3.12.*/bin/python python3.12 python3.13 python3; do \
  $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench-gpu clean

$(PY):
	@test -n "$(PYTHON)" || { echo "no Python >= 3.12 found; set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'

setup: $(PY)

demo: $(PY)
	$(PY) -m models.cli

test: $(PY)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
