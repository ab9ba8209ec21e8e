# Two commands (see README.md):
#   make lab    install what is missing, then open the course in JupyterLab
#   make test   install what is missing, then run every test (unit tests and the notebooks)
#
# The virtual environment sees the system's packages, so a torch that is already installed (CPU
# or CUDA) is used as it is. Where none is, zerolab/install_torch.py picks one and says what it
# downloads: on a machine with an NVIDIA driver, `torch` from pip's default index (the CUDA
# build); without one, on Linux, torch==2.13.0's CPU build from PyTorch's CPU index (PyPI's
# index instead when that cannot be reached). TORCH="..." installs that instead (pip arguments).
#
# `make lab LAB_ARGS="--no-browser --port 8890"` hands options on to JupyterLab.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?=
PYTEST_ARGS ?=
# The tests run on JOBS processes at once (pytest-xdist; one per core, at most 4): each takes whole
# test files, or the files that read one shared launch (tests/conftest.py's scheduler).
# JOBS=1: one process.
JOBS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1))")
PARALLEL := $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadscope --no-loadscope-reorder)
LAB_ARGS ?=
# JupyterLab refuses to start as root ("Running as root is not recommended. Use --allow-root to
# bypass."), and root is who runs a Docker container or a cloud notebook box: allow it there.
ALLOW_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

.PHONY: lab test lint exercises clean

# The course's packages are ~100 packages and ~0.1 GB to download (measured; torch aside). The
# install's time counts from before the venv's creation (.started), for the line at the end.
$(VENV)/.installed: pyproject.toml
	@mkdir -p $(VENV) && date +%s > $(VENV)/.started
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) zerolab/install_torch.py --python $(PY) --torch "$(TORCH)"
	@echo "Installing zerolab and the course's packages (JupyterLab, matplotlib, pytest, ...): about 0.1 GB to download"
	$(PY) -m pip install -q -e ".[course,dev]"
	@echo "Installed in $$(( $$(date +%s) - $$(cat $(VENV)/.started) )) s; $(VENV) takes $$(du -sh $(VENV) | cut -f1)"
	touch $@

# `-m jupyterlab`, not `-m jupyter lab`: the latter looks for a `jupyter-lab` program, missing
# where JupyterLab comes from outside the environment (--system-site-packages). The file browser
# starts at the repository, not notebooks/: the notebooks send you to exercises/.
lab: $(VENV)/.installed
	$(PY) -m jupyterlab $(ALLOW_ROOT) --ServerApp.root_dir=. $(LAB_ARGS) notebooks/00_launch.ipynb

test: $(VENV)/.installed
	$(PY) -m pytest tests notebooks --nbval $(PARALLEL) $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check zerolab tests solutions exercises notebooks

exercises: $(VENV)/.installed  # regenerate the stubs in exercises/ from solutions/
	$(PY) -m zerolab.grade --make-exercises

clean:
	rm -rf $(VENV) build *.egg-info
