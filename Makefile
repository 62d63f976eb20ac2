# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create the virtual environment at .venv when it is missing and reuse it when present.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install install-test demo test lint

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned and installed first: with 2.13.0 present, the package's `torch>=2.4` installs nothing more.
install: $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e .

install-test: $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	bash scripts/fetch_system_libs.sh $(VENV)

demo: install
	$(VENV)/bin/kvserve generate "What is the capital of France?"

# The whole suite on the CPU's own ISA level, then the kernel, attention, sampling, HF-parity and batch-invariance
# tests once more on the lower levels kvserve can be forced to (kvserve/platform.py), so that CI on any machine
# checks several paths.
# A level the CPU lacks falls back to the native one with a warning.
# Triton's interpreter runs the same whatever the CPU's vector ISA: once, in the full run.
# The generic level (plain loops, torch capped to SSE4.1) leaves out the tests marked slow (the embedded 135M model):
# there they took 5-26x their native time, ~40% of that pass, and run no kernel the tiny models' tests do not.
NOT_ISA = --ignore=tests/attention/test_triton_attention.py --ignore=tests/models/test_triton_engine.py
ISA_TESTS = tests/kernels tests/attention tests/layers tests/sample tests/models tests/engine/test_deterministic.py

# On a CPU whose own level is avx2 the full run above already was the AVX2 pass (~13 min of CI on a Zen 3): skipped.
NATIVE_ISA = $(PY) -c "from kvserve.platform import cpu_info; print(cpu_info().native_isa)"

test: install-test
	$(PY) -m pytest -q tests
	if [ "$$($(NATIVE_ISA))" = avx2 ]; then echo "native level avx2: the AVX2 pass was the full run"; \
	else KVSERVE_CPU_ISA=avx2 $(PY) -m pytest -q $(ISA_TESTS) $(NOT_ISA); fi
	KVSERVE_CPU_ISA=generic $(PY) -m pytest -q -m "not slow" $(ISA_TESTS) $(NOT_ISA)

lint: install-test
	$(VENV)/bin/ruff check kvserve tests benchmarks
