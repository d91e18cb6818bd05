# Two entry points, each of which sets everything up first (a virtual environment in .venv):
#   make demo   the pyro-subspace command's default run
#   make test   the test suite (what CI runs, through .ci/run)
PYTHON ?= python3
VENV ?= .venv
# CPU build of torch; override (e.g. TORCH_SPEC="torch") to get your platform's default build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/pyro-subspace

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) out
