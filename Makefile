# Two commands do all the set-up on a fresh machine with Python 3.11+ and pip:
#   make verify   create .venv, install the project with its dev extras, run `python -m refimpl verify`
#   make test     the same set-up, then the whole test suite (unit tests, notebooks, docs check)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= auto

.PHONY: install verify test bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else "Python 3.11+ is needed, found %d.%d" % v[:2])'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

verify: $(STAMP)
	$(PY) -m refimpl verify

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS)

bench: $(STAMP)
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis docs/_build
