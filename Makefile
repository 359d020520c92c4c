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
	# Debian's chromium: the /dashboard test loads the page in it headless; without it that test skips (with the reason).
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null)) \
	  || echo "note: install chromium (Debian/Ubuntu) to run the dashboard's browser test"; }
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

# Reliability (issue 10): the chaos matrix and the soak, against a cluster of their own (examples/chaos.yaml).
.PHONY: chaos soak test-loaded
CHAOS_CONFIG ?= examples/chaos.yaml
MINUTES ?= 10
RUNS ?= 10

chaos: $(STAMP)
	$(BIN)/crossfill models pull smollm2-135m
	$(BIN)/crossfill chaos --config $(CHAOS_CONFIG) --out out/chaos --json out/chaos/chaos.json --markdown out/chaos/chaos.md

soak: $(STAMP)
	$(BIN)/crossfill models pull smollm2-135m
	$(BIN)/crossfill soak --config $(CHAOS_CONFIG) --minutes $(MINUTES) --out out/soak

# The flake check: `make test` RUNS times in a row while a busy loop keeps every core loaded.
test-loaded: $(STAMP)
	@mkdir -p out
	@burners=""; for _ in $$(seq $$(nproc)); do sh -c 'while :; do :; done' & burners="$$burners $$!"; done; \
	trap 'kill $$burners 2>/dev/null' EXIT INT TERM; \
	for i in $$(seq $(RUNS)); do \
	  start=$$(date +%s); \
	  $(MAKE) --no-print-directory test > out/test-loaded-$$i.log 2>&1 \
	    || { echo "run $$i/$(RUNS): FAILED after $$(( $$(date +%s) - start )) s (out/test-loaded-$$i.log)"; exit 1; }; \
	  echo "run $$i/$(RUNS): passed in $$(( $$(date +%s) - start )) s, beside $$(nproc) busy loops"; \
	done
