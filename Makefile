# Two commands set everything up on a fresh machine:
#   make demo   - venv + lowband + dataset, then the main job (a short multi-worker comparison)
#   make test   - venv + lowband + dataset, then the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA_DIR ?= /usr/share/datasets/fashion-mnist
DATA_FILE := $(DATA_DIR)/train-images-idx3-ubyte.gz
PYTEST_ARGS ?=

.PHONY: demo test venv data bench-overlap clean

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

# The main job: lowband's methods side by side with PyTorch's, 2 workers, LeNet on Fashion-MNIST,
# each worker behind an emulated 200 Mbit/s link (loopback when the machine forbids namespaces).
# The run is short (150 steps), so the compressing methods get 30 fp32 warm-up steps instead of
# their defaults (100 and 50), or the demo would mostly show their warm-up.
# Then the lazy update where it pays: a language model whose input embedding tables hold 47% of
# its weights (gpt-ngram), ssgd against lazy over the same links (about a minute).
DEMO_ALGORITHMS ?= noop,ssgd,ddp,ddp-fp16,ddp-powersgd,localsgd,compressed:warmup_steps=30,cpsgd:warmup_steps=30,lazy
demo: venv data
	$(BIN)/lowband bench --algorithms $(DEMO_ALGORITHMS) --bandwidth 200mbit --fallback-loopback \
	  --workers 2 --model cnn --max-steps 150 --eval-every 50 --no-progress --out runs/demo
	$(BIN)/lowband bench --algorithms ssgd,lazy --bandwidth 200mbit --fallback-loopback --bucket-mb 0.25 \
	  --workers 2 --model gpt-ngram --max-steps 30 --eval-every 30 --no-progress --out runs/demo-lm

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
test: venv data
	@$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc = 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

bench-overlap: venv data
	$(BIN)/python benchmarks/overlap.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis .ruff_cache
