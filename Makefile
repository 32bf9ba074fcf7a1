# nbpar — set up, test, demo. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
DEEPSPEED_VERSION ?= 0.19.8
# Everything a run writes stays inside the checkout: no IPython profile or
# temp files in the home directory.
export IPYTHONDIR := $(CURDIR)/.tmp/ipython
export JUPYTER_CONFIG_DIR := $(CURDIR)/.tmp/jupyter
export JUPYTER_RUNTIME_DIR := $(CURDIR)/.tmp/jupyter/runtime
export MPLCONFIGDIR := $(CURDIR)/.tmp/mpl
export TMPDIR := $(CURDIR)/.tmp
export MPLBACKEND := Agg
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup test lint test-fast test-unit test-notebooks test-browser notebooks demo lab bench clean

setup: $(VENV)/.done

$(VENV)/.done: pyproject.toml scripts/install_torch.sh scripts/install_mpi.sh scripts/install_browser.sh \
		scripts/install_cluster.sh
	@mkdir -p .tmp
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	TORCH_VERSION=$(TORCH_VERSION) sh scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e ".[test,lab,monitor,hf]"
	$(PY) -m pip install -q --no-build-isolation "deepspeed==$(DEEPSPEED_VERSION)"
	sh scripts/install_mpi.sh $(PY)
	sh scripts/install_cluster.sh
	sh scripts/install_browser.sh $(PY)
	$(PY) -c "import torch, deepspeed, ipyparallel, nbpar; print('nbpar ready: torch', torch.__version__)"
	@touch $@

test: setup lint test-unit test-notebooks test-browser

# ruff is the one linter and formatter (its rules are in pyproject.toml)
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The quick lane (no engine pool, no subprocess): lint, then the tests marked neither pool
# nor spawn (tests/lanes.py marks them) nor slow nor browser; a test in it that starts a
# process fails. Under a minute on 2 cores. `make test` runs every test as before.
test-fast: lint
	@mkdir -p .tmp
	$(PY) -m pytest -q -p no:randomly --timeout 120 \
	    -m "not pool and not spawn and not slow and not browser" tests

test-unit: setup
	@mkdir -p .tmp
	$(PY) -m pytest -q -p no:randomly --timeout 600 -m "not browser" tests

test-browser: setup
	@mkdir -p .tmp artifacts/browser
	$(PY) -m pytest -q -p no:randomly --timeout 900 -m browser tests/browser

# Notebook runs keep Jupyter's data dir (notebook trust database) in the checkout too.
notebooks test-notebooks: export JUPYTER_DATA_DIR := $(CURDIR)/.tmp/jupyter/data

test-notebooks: setup
	@mkdir -p .tmp
	$(PY) -m pytest -q --nbval notebooks --timeout 300 -p no:randomly

# Each notebooks/NAME.ipynb is paired with notebooks/src/NAME.py (jupytext percent format):
# sync them (the side edited last wins), then execute the notebooks in place so their
# stored outputs, which `make test-notebooks` checks, are current. One notebook:
# make notebooks NOTEBOOKS=notebooks/02_zero.ipynb
NOTEBOOKS ?= $(sort $(wildcard notebooks/*.ipynb))
notebooks: setup
	@mkdir -p .tmp
	$(PY) -m jupytext --sync $(NOTEBOOKS)
	$(PY) -m jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=300 --ExecutePreprocessor.record_timing=False $(NOTEBOOKS)

# The notebooks without their solutions (cells tagged `solution`), outputs cleared, in
# student/: what a workshop hands out.
.PHONY: student
student: setup
	$(PY) scripts/student.py --out student

demo: setup
	@mkdir -p .tmp artifacts
	$(PY) -m jupyter nbconvert --to notebook --execute notebooks/00_quickstart.ipynb \
	    --output-dir artifacts --ExecutePreprocessor.timeout=300
	@echo "Executed notebook with outputs: artifacts/00_quickstart.ipynb"
	@echo "Open the notebooks in JupyterLab with: make lab"

# as root (a container), Jupyter refuses to start without --allow-root
lab: setup
	$(PY) -m jupyter lab --ip 127.0.0.1 --no-browser $(if $(filter 0,$(shell id -u)),--allow-root) notebooks

bench: setup
	$(PY) -m nbpar bench launch --engines 2 --json

# Each benchmark writes benchmarks/results/<name>.json (date, CPU, cores, torch, load,
# median and spread over repeats); bench-report rewrites the tables of docs/performance.md
# from them (tests/test_bench_results.py fails when they disagree). One benchmark:
# make bench-results BENCHMARKS=ddp_vs_torchrun
BENCHMARKS ?= pool_startup ddp_vs_torchrun dashboard_overhead meter_cost pipeline_bubble \
	pipeline_memory memory_vs_estimate simulate_scale reliability scaling chaos notebook_times \
	jupyter_latency
.PHONY: bench-results bench-report
bench-results: setup
	@mkdir -p .tmp
	@for b in $(BENCHMARKS); do echo "benchmarks/$$b.py"; \
	    $(PY) benchmarks/$$b.py || exit 1; done
	$(PY) benchmarks/report.py

bench-report: setup
	$(PY) benchmarks/report.py

# The first command on a GPU machine (a few minutes on one GPU): device detection, the
# engine join path on NCCL twice, every strategy on one device, the meter's clock against
# known work, MFU; writes benchmarks/results/gpu/. GPU_CHECK=--dry-run runs it on a CPU.
.PHONY: gpu-check
gpu-check: setup
	$(PY) benchmarks/gpu_check.py $(GPU_CHECK)

clean:
	rm -rf .tmp artifacts $(VENV)
