# The README's two commands: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

setup: $(STAMP)

demo: setup
	$(VENV)/bin/specpilot compile examples/pipeline.yaml --gpu h200 -o engines/demo

test: setup
	$(PY) -m pytest

clean:
	rm -rf engines .pytest_cache
