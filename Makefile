# The two commands a newcomer runs: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test,mooncake]"
	# Mooncake's wheel links libibverbs even for TCP; without it the Mooncake tests skip (with the reason).
	@ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get install -y -q libibverbs1 >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null)) \
	  || echo "note: install libibverbs1 (Debian/Ubuntu) to run the Mooncake backends"; }
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/crossfill models pull smollm2-135m
	$(BIN)/crossfill up --config examples/two-dc.yaml

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -x --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
