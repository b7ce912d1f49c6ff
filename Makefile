# Two commands matter: `make book` and `make test`. The rest are the parts they use.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PYTHONHASHSEED := 0
# Keep notebooks, tests and benchmarks to the two cores of the course machines.
export OMP_NUM_THREADS ?= 2
# Idle OpenMP threads sleep instead of spinning: spinning threads starve each other on a
# busy 2-core machine (FAVOR+ ran 10-30x slower with the default policy).
export OMP_WAIT_POLICY ?= PASSIVE

CHAPTERS := $(wildcard book/*.ipynb)
SOURCES  := $(wildcard assignments/source/*/*.ipynb)

# The test parts run their tests on WORKERS processes (pytest-xdist; WORKERS=0: one process),
# each with one thread. Two more workers than cores: a graded notebook spends seconds waiting
# (time limits of the battery's hanging cells, kernel shutdowns, the browser) and the extra
# workers fill them (`make test` on 2 cores: 818 s with 2 workers and 612 s with 3, in an
# earlier state; 552 s with 3 and 507 s with 4 for its pytest part on one clone, stop 24). A
# notebook's cells stay on one worker (--dist loadfile), and so do the tests of one graded
# assignment (--dist loadgroup, grouped by tests/conftest.py), which is graded once.
# PYTHONDONTWRITEBYTECODE emptied (unset, for Python) for the test runs: where the shell sets it,
# each worker would otherwise rewrite the asserts of 177 test and plugin files again (7 CPU-s
# of its 14 to collect the tests) and each subprocess recompile the project's modules. The
# caches go to __pycache__ folders, ignored by git; sandboxed kernels never see this variable.
WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 2) + 2 )))
PYTEST  := OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q -p no:cacheprovider \
           -n $(WORKERS)

# Debian packages the tests use, installed by .ci/ensure-packages when missing (as root; anyone
# else is told the command). The browser test drives CHROMIUM_PATH (Debian's chromium, or
# another build of Chromium given in the environment).
export CHROMIUM_PATH ?= /usr/bin/chromium

.PHONY: help setup book pdf test lint unit notebooks grading trust grade browser bench serve clean \
        packages chromium bubblewrap

help:
	@echo "make book      build the Jupyter Book into _build/html (creates .venv on first use)"
	@echo "make pdf       the whole book as one PDF, _build/pdf/efficient-attention.pdf (offline,"
	@echo "               printed by chromium: no LaTeX; chapters from the cache of make book)"
	@echo "make test      lint, unit tests, grading pipeline, book build (every chapter run), browser test"
	@echo "make lint | unit | notebooks | grading | browser   one part of 'make test'"
	@echo "               (parts run on all cores; WORKERS=1 for one worker, 0 for no worker)"
	@echo "make grade ASSIGNMENT=name   autograde every collected submission, table + CSV"
	@echo "make trust     every assignment's solution graded on a busy machine (slow)"
	@echo "make bench     rerun the benchmarks behind the comparison chapter (slow)"
	@echo "make serve     serve the built book (built first only if missing) on http://127.0.0.1:8000"
	@echo "               (PORT=8001 for another port; works from any folder: make -C <repo> serve)"
	@echo "make clean     remove the build, caches and nbgrader's generated folders"

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

# The student versions of the assignments, shipped with the book (regenerated only when a
# source notebook changes, so that a second `make book` stays fast).
RELEASES := book/_downloads/assignments/list.md
$(RELEASES): $(STAMP) $(SOURCES) assignments/release_for_book.py assignments/nbgrader_config.py \
             assignments/course_tools/integrity.py $(wildcard assignments/rules/*.json)
	$(BIN)/python assignments/release_for_book.py

# The library as a wheel, offered for download by the book (book/intro.md) so that a chapter's
# notebook runs outside the repository after one `pip install` (the note at the top of every
# chapter). Built from a scratch copy of the sources: building in the clone would leave a build/
# folder in it.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
WHEEL   := book/_downloads/efficient_attention-$(VERSION)-py3-none-any.whl
$(WHEEL): $(STAMP) pyproject.toml README.md LICENSE $(shell find src -name '*.py')
	@rm -f book/_downloads/efficient_attention-*.whl
	@scratch=$$(mktemp -d) && cp -r pyproject.toml README.md LICENSE src "$$scratch" && \
	  $(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w book/_downloads \
	    "$$scratch"; status=$$?; rm -rf "$$scratch"; exit $$status
	@test -f $(WHEEL) || { echo "no $(WHEEL) was built"; exit 1; }

# Chapters missing from the execution cache are executed BOOK_JOBS at a time before the build
# (book/_execution_cache.py; BOOK_JOBS=1: one at a time, for the timings chapters print).
BOOK_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
book: $(STAMP) $(RELEASES) $(WHEEL)
	$(BIN)/python book/_execution_cache.py --jobs $(BOOK_JOBS)
	$(BIN)/jupyter-book build . -W --keep-going
	@echo "Book built: $(CURDIR)/_build/html/index.html"

# The whole book as one PDF, made offline with no LaTeX: the book built as one HTML page
# (_build/singlehtml; the chapters come from the same execution cache as `make book`, so nothing
# is executed when that cache is valid), then printed by Debian's chromium, driven by Playwright
# (book/_pdf.py: A4, page numbers, the maths typeset by the offline MathJax first).
PDF := _build/pdf/efficient-attention.pdf
pdf: $(STAMP) $(RELEASES) $(WHEEL) chromium
	$(BIN)/python book/_execution_cache.py --jobs $(BOOK_JOBS)
	$(BIN)/jupyter-book build . --builder singlehtml -W --keep-going
	$(BIN)/python book/_pdf.py --site _build/singlehtml --output $(PDF)

# The packages, for the steps that need them (`packages`: both, with one apt-get update).
chromium:
	@.ci/ensure-packages chromium "$(CHROMIUM_PATH)"

# autograding runs student code in a bubblewrap sandbox (assignments/course_tools/sandbox.py)
bubblewrap:
	@.ci/ensure-packages bubblewrap bwrap

packages:
	@.ci/ensure-packages chromium "$(CHROMIUM_PATH)" bubblewrap bwrap

# The chapters' code is formatted to fit the book's text column: 76 characters, the width of a
# code block at the browser test's viewport of 1280 px (tests/test_chapter_prose.py checks the
# visible lines, tests/test_browser.py the built pages).
BOOK_LINE_LENGTH := 76
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks assignments book
	$(BIN)/ruff format --check --line-length $(BOOK_LINE_LENGTH) $(CHAPTERS)

unit: $(STAMP) bubblewrap
	$(PYTEST) --dist loadgroup tests --ignore=tests/test_grading.py --ignore=tests/test_browser.py \
	    --ignore=tests/test_grading_load.py

notebooks: $(STAMP)
	$(PYTEST) --dist loadfile --nbval-lax $(CHAPTERS) $(SOURCES)

# Every assignment's cheat cases (tests/cheats/<name>.py); `make test` grades those of four
# assignments (tests/test_grading.py: CASES_IN_MAKE_TEST).
grading: $(STAMP) bubblewrap
	GRADING_CASES=all $(PYTEST) --dist loadgroup tests/test_grading.py tests/test_grading_load.py

# Every assignment's solution graded on a busy machine: four CPU-bound processes per core, each
# in its own session, and a cold page cache (tests/test_grading_load.py; `make test` grades
# one assignment, on one core). About 3 minutes an assignment on two cores.
trust: $(STAMP) bubblewrap
	BUSY_ASSIGNMENTS=all BUSY_CORES=all $(BIN)/pytest -q -p no:cacheprovider \
	    tests/test_grading_load.py

# The instructor's one command: autograde every submission under assignments/submitted/*/NAME,
# print a table per student and write assignments/grades/NAME.csv (see assignments/README.md).
grade: $(STAMP) bubblewrap
	@test -n "$(ASSIGNMENT)" || { echo "usage: make grade ASSIGNMENT=<name>"; exit 2; }
	cd assignments && PATH="$(CURDIR)/$(BIN):$$PATH" ../$(BIN)/python -m course_tools.grade $(ASSIGNMENT)

browser: chromium $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider tests/test_browser.py

# Bubblewrap first (a missing one stops the run at once, with the command to install it), lint,
# then ONE pytest run over all cores: the unit, grading and browser tests. The browser tests
# start by building the book (`make book`, as their first test: tests/test_browser.py), so the
# build, which executes every chapter on one core, overlaps the grading of the assignments on
# the others; the build is the chapters' notebook validation (it fails on any error, and
# book/_execution_cache.py re-executes every chapter when the library or the committed results
# change). The longest groups go first, the unit tests last (tests/conftest.py). Chromium, when
# missing, is installed by the browser tests' fixture while the other workers go on. The
# assignment sources are run by the grading tests (validated, graded as the "solution" student,
# which must run cleanly). `make notebooks` still runs nbval over chapters and sources.
test: bubblewrap lint
	$(PYTEST) --dist loadgroup --no-loadscope-reorder tests

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# The book as last built, served on http://127.0.0.1:$(PORT) by Python's http.server (standard
# library: no venv needed). It is built first only when BUILD_HTML has no index.html; `make book`
# rebuilds it. Paths are absolute (the folder of this Makefile), so `make -C <repo> serve` and
# `make -f <repo>/Makefile serve` work from any folder. BUILD_HTML: the folder served (the tests
# point it at a scratch site).
REPO       := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
PORT       ?= 8000
BUILD_HTML ?= $(REPO)/_build/html
serve:
	@test -f '$(BUILD_HTML)/index.html' || $(MAKE) -C '$(REPO)' book
	@echo "Serving $(BUILD_HTML) on http://127.0.0.1:$(PORT)/ (Ctrl-C stops it)"
	$(PYTHON) -m http.server $(PORT) --bind 127.0.0.1 --directory '$(BUILD_HTML)'

clean:
	rm -rf _build .jupyter_cache .pytest_cache .ruff_cache book/_downloads
	rm -rf assignments/release assignments/submitted assignments/autograded assignments/feedback assignments/gradebook.db
	rm -rf assignments/grading_reports assignments/grades assignments/exchange assignments/downloaded
	rm -f assignments/gradebook.db-* assignments/*.csv assignments/.nbgrader.log
