# Two commands do all the set-up on a fresh machine with Python 3.11+ and pip:
#   make verify   create .venv, install the project with its dev and cuda13 extras at the versions CI last passed with
#                 (constraints/cuda13.txt), run `python -m refimpl verify`
#   make test     the same set-up, then the whole test suite (unit tests, notebooks, docs check, the built
#                 site in a headless Chromium when one is installed)
# and the documentation site:
#   make docs     execute every tutorial (full size; TUTORIAL_SMALL=1 for small) and build docs/_build/html
# and the experiments' full sweeps (docs/experiment_*.md): make experiments
# and, to teach from the lessons: make lab (JupyterLab on tutorials/ with the project's kernel), make student-course
# (a copy to hand out, without the solutions), make grade LESSON=N SUBMISSIONS='...' (the autograder's gradebook);
# the variables that redirect these two are in docs/course.md
# and, on a machine with an NVIDIA GPU: make gpu-check (both GPU backends validated and measured, gpu/check.py); its
# rehearsal here, in an environment built like the GPU machines: make gpu-rehearsal (run it when gpu/ or bench_gpu.py change)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the GPU extra installed beside dev: cuda13 (its NVVM and NVRTC also compile every kernel for make test on a machine
# without a GPU), or cuda12 for a driver whose nvidia-smi header says CUDA 12.x: make clean install CUDA_EXTRA=cuda12
# (one major per venv: the two CuPy wheels cannot live side by side)
CUDA_EXTRA ?= cuda13
# the versions CI last passed with (pip's -c; `make lock` writes them): a fresh machine installs what was tested.
# LOCK= (empty) takes the newest releases instead, upgrading what is installed: make install-latest, make test-latest
LOCK ?= constraints/$(CUDA_EXTRA).txt
PIP_VERSIONS := $(if $(LOCK),-c $(LOCK),--upgrade --upgrade-strategy eager)
STAMP := $(VENV)/.installed-$(CUDA_EXTRA)$(if $(LOCK),-locked,-latest)
# where install-latest and test-latest put the newest releases, beside the locked .venv
LATEST_VENV ?= .venv-latest
GPU_CHECK_OUT ?= results/gpu-check
# seconds for the whole GPU check (its default, 480, when empty); each stage gets its share, 85% of it in all
GPU_CHECK_BUDGET ?=
PYTEST_WORKERS ?= auto
SPHINXOPTS ?= -j auto
TUTORIAL_SMALL ?=
# -E: read every page afresh (autodoc pages depend on code Sphinx does not track); -W: warnings are errors
SPHINX := $(PY) -m sphinx -E -W --keep-going -b html $(SPHINXOPTS)

COURSE_STAMP := $(VENV)/.installed-course

.PHONY: install install-latest verify test test-latest lock bench experiments docs docs-check lab clean gpu-check gpu-rehearsal \
	student-course grade

$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else "Python 3.11+ is needed, found %d.%d" % v[:2])'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-*
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,$(CUDA_EXTRA)]' $(PIP_VERSIONS)
	touch $(STAMP)

install: $(STAMP)

# the newest releases in $(LATEST_VENV), and the unit tests on them (CI runs both: drift fails CI, not a newcomer)
install-latest:
	rm -f $(LATEST_VENV)/.installed-*
	$(MAKE) --no-print-directory install VENV=$(LATEST_VENV) LOCK=

test-latest: install-latest
	@$(LATEST_VENV)/bin/python -c '$(SHOW_VERSIONS)'
	$(LATEST_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) -m "not site and not notebook"

# rewrite constraints/cuda13.txt and cuda12.txt from pip's newest resolution (commit them once .ci/run passes)
lock:
	$(PYTHON) constraints/lock.py

verify: $(STAMP)
	$(PY) -m refimpl verify

# the versions a test run used, in one line of its log
SHOW_VERSIONS := import importlib.metadata as m, sys; print("versions:", sys.version.split()[0], ", ".join(f"{p} {m.version(p)}" \
	for p in ("numpy", "scipy", "numba", "llvmlite", "numba-cuda", "scikit-learn", "hypothesis", "pytest")))

# the site tests (marked `site`) read the build that docs-check writes, so they run after it
test: $(STAMP)
	@$(PY) -c '$(SHOW_VERSIONS)'
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "not site"
	$(MAKE) --no-print-directory docs-check
	$(PY) -m pytest -m site tests/test_site.py

# the site with every notebook executed during the build
docs: $(STAMP)
	TUTORIAL_SMALL=$(TUTORIAL_SMALL) $(SPHINX) docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html"

# the same build without executing the notebooks (pytest has just executed them): pages, math, API, links
docs-check: $(STAMP)
	$(SPHINX) -q -D nb_execution_mode=off docs docs/_build/check

# the full sweeps of the experiments (docs/experiment_*.md), results in results/NAME/ (scaling one point at a time: it times them)
experiments: $(STAMP)
	@for e in recall regression scaling continual positional; do \
	  jobs=2; [ $$e = scaling ] && jobs=1; \
	  $(PY) -m app experiment $$e --jobs $$jobs || exit 1; \
	done

# both GPU backends on this machine's GPU: environment, backend status, the GPU tests (a skip is a failure),
# compute-sanitizer where it is on PATH, bench_gpu.py with its targets; results in $(GPU_CHECK_OUT)/gpu-check.{md,json}.
# The Python given, no venv and no pip (it needs numpy, scipy, threadpoolctl, pytest, hypothesis, numba, numba-cuda
# and cupy), so it runs where no package registry can be reached: PYTHON=python3 make gpu-check
gpu-check:
	PYTHONPATH=. $(PYTHON) -m gpu check --out $(GPU_CHECK_OUT) $(if $(GPU_CHECK_BUDGET),--budget $(GPU_CHECK_BUDGET))

# the check's dry run, and the static gates, in .venv-rehearsal: Python 3.12 with the GPU machines' packages at their
# versions where the package index has them, the project on PYTHONPATH only, ptxas and cuobjdump of CUDA 13.0 and then
# of 13.5 first on PATH (constraints/gpu-machine.txt, constraints/rehearse.py; the first run downloads about 1.5 GB)
gpu-rehearsal:
	$(PYTHON) constraints/rehearse.py

bench: $(STAMP)
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

$(COURSE_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,$(CUDA_EXTRA),course]' $(PIP_VERSIONS)
	touch $(COURSE_STAMP)

# JupyterLab on the lessons; its python3 kernel is this virtual environment's Python (JUPYTER_PREFER_ENV_PATH:
# not a kernelspec from ~/.local), and jupytext saves each notebook's paired script
lab: $(COURSE_STAMP)
	JUPYTER_PREFER_ENV_PATH=1 $(VENV)/bin/jupyter lab --notebook-dir=tutorials

# a copy of the course to hand out (tutorials/course.py build-student): the lessons, the pages they cite, refimpl, cpu,
# gpu, app and what installs them, without tutorials/solutions/ (worked solutions, near misses, the grader's hidden
# cases, answer keys), into $(STUDENT_COURSE); FORCE=1 replaces a build made there before.  docs/course.md lists the
# variables of this target and of `grade`
STUDENT_COURSE ?= dist/student-course
FORCE ?=
student-course: $(STAMP)
	$(PY) tutorials/course.py build-student $(STUDENT_COURSE) $(if $(FORCE),--force)

# the autograder (tutorials/course_grader.py) on one lesson's submitted notebooks, into $(GRADEBOOK)/lesson_NN.csv
# (with the Canvas and Moodle files and a report per student):
#   make grade LESSON=4 SUBMISSIONS='hand-in/*/04_gma_gradients.ipynb' [ROSTER=roster.csv] [WRITTEN=written.csv] [JOBS=2]
GRADEBOOK ?= gradebook
ROSTER ?=
WRITTEN ?=
JOBS ?=
grade: $(STAMP)
	@test -n "$(LESSON)" -a -n "$(SUBMISSIONS)" || { echo "make grade LESSON=N SUBMISSIONS='notebooks...'"; exit 2; }
	$(PY) tutorials/course.py grade $(LESSON) $(SUBMISSIONS) --out $(GRADEBOOK) $(if $(ROSTER),--roster $(ROSTER)) \
		$(if $(WRITTEN),--written $(WRITTEN)) $(if $(JOBS),--jobs $(JOBS))

clean:
	rm -rf $(VENV) $(LATEST_VENV) .venv-rehearsal .pytest_cache .hypothesis docs/_build docs/tutorials docs/api/generated
