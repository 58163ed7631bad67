# Two commands do all the set-up: `make run` (the main job) and `make test` (the whole suite).
# torch is pinned to 2.13.0 here so that this machine takes the CPU build on its disk; the
# package itself declares torch>=2.4.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test lint docs setup clean gpu-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,docs]" "$(TORCH)"
	touch $(STAMP)

setup: $(STAMP)

# accept's own exit code tells scripts its verdict (0 adopt or keep the baseline, 3 inconclusive);
# here any verdict is a finished run: only a run that could not decide anything fails `make run`
run: $(STAMP)
	@$(BIN)/gradaccum accept; code=$$?; \
	case $$code in \
	  0) echo "make run: done; accept's verdict is above (gradaccum accept itself exited 0: ADOPT or KEEP BASELINE)";; \
	  3) echo "make run: done; accept's verdict is INCONCLUSIVE: the runs could not tell the two plans apart on this machine, a result, not a failure (gradaccum accept itself exits 3 for scripts; run it again on a quieter machine, or with more --runs)";; \
	  *) echo "make run: gradaccum accept could not reach a verdict (exit $$code; 1 a check failed, 2 bad input: see above)" >&2; exit $$code;; \
	esac

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

# style and types: part of `make test` (what CI runs); any finding fails it
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks docs/generate.py docs/examples
	$(BIN)/ruff format --check src tests benchmarks docs/generate.py docs/examples
	$(BIN)/mypy

# the documentation site in site/: command pages regenerated from real runs, warnings as errors
docs: $(STAMP)
	$(BIN)/python docs/generate.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# every CUDA path the CPU suite never runs (the cuda-marked tests, CUDA memory against the tensor-bytes
# model, fp16 + GradScaler and bf16 autocast through the step, DDP over NCCL on every device), one
# table; on a machine without a CUDA device it says so and exits 0
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) runs site docs/commands docs/quickstart.md docs/reference.md
