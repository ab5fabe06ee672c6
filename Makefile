# Two commands set everything up on a fresh machine:
#   make demo   - venv + lowband + dataset, then the main job (a short multi-worker comparison)
#   make test   - venv + lowband + dataset, then the test suite
# and one keeps the results page current:
#   make results - regenerate the generated sections of docs/results.md and docs/cells.md from their stored results files
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA_DIR ?= /usr/share/datasets/fashion-mnist
DATA_FILE := $(DATA_DIR)/train-images-idx3-ubyte.gz
PYTEST_ARGS ?=

.PHONY: demo test results venv data bench-overlap clean

venv: $(BIN)/.installed

# the native kernels are built by this install too (setup.py), so their source is a prerequisite
$(BIN)/.installed: pyproject.toml setup.py $(wildcard src/lowband/_native/*.c src/lowband/_native/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,peers]'
	touch $@

# Fashion-MNIST from Debian's package, when it is missing and apt is usable.
data:
	@if [ -f "$(DATA_FILE)" ]; then echo "dataset: $(DATA_DIR)"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing dataset-fashion-mnist with apt-get"; \
	  apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null && apt-get install -y -qq dataset-fashion-mnist >/dev/null; }; \
	else echo "dataset missing at $(DATA_DIR) and apt-get is not usable (need root): install 'dataset-fashion-mnist' or pass --data-dir" >&2; \
	fi

# The main job: which method reaches the target first over a slow link. 2 workers, LeNet on
# Fashion-MNIST, each worker behind an emulated 20 Mbit/s paced link (every message pays its
# bytes / rate; loopback when the machine forbids namespaces, and it says so). lowband's methods
# race PyTorch's and torchft's. The run is short (120 steps), so the compressing methods get 30
# fp32 warm-up steps instead of their defaults, or the demo would mostly show their warm-up.
# Then the language model whose input embedding tables hold 47% of its weights (gpt-ngram) at
# 200 Mbit/s: ssgd, the lazy update and cp-diloco.
DEMO_ALGORITHMS ?= noop,ssgd,ddp-powersgd,localsgd,diloco,streaming-diloco,compressed:warmup_steps=30,cpsgd:warmup_steps=30,cp-diloco
DEMO_LM_ALGORITHMS ?= ssgd,lazy,cp-diloco
demo: venv data
	$(BIN)/lowband bench --algorithms $(DEMO_ALGORITHMS) --bandwidth 20mbit --fallback-loopback \
	  --workers 2 --model cnn --max-steps 120 --eval-every 20 --no-progress --out runs/demo
	$(BIN)/lowband bench --algorithms $(DEMO_LM_ALGORITHMS) --bandwidth 200mbit --fallback-loopback \
	  --workers 2 --model gpt-ngram --max-steps 40 --eval-every 20 --no-progress --out runs/demo-lm

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
test: venv data
	@$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc = 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Every generated section of the RESULTS_DOC files (between <!-- lowband:begin NAME ...--> and
# <!-- lowband:end NAME -->) re-rendered from the results files its marker names (runs/*/results.json),
# in place; nothing is rerun. A section whose results file is missing stays as it is, and a
# line names the command that writes the file.
RESULTS_DOC ?= docs/results.md docs/cells.md
results: venv
	$(BIN)/python -m lowband.app.report $(RESULTS_DOC)

bench-overlap: venv data
	$(BIN)/python benchmarks/overlap.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis .ruff_cache
