# On a fresh machine:  make demo  |  make test   (README.md, "Quickstart"); make test-fast: tests/README.md
# `make setup` (used by each) is idempotent and fast once done.

PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.setup-done
export MUJOCO_GL ?= egl
# glibc malloc keeps large freed buffers instead of unmapping them (re-faulting them made the DrQ
# update slower: docs/performance.md). The console scripts set the same through mallopt
# (pixelsac/allocator.py), which steps aside when these variables are set.
export MALLOC_MMAP_MAX_ ?= 0
export MALLOC_TRIM_THRESHOLD_ ?= 68719476736
export MALLOC_TOP_PAD_ ?= 1073741824
GL_PKGS := libegl1 libegl-mesa0 libgl1-mesa-dri

.PHONY: setup demo test test-fast lint format docs clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@missing=$$(for p in $(GL_PKGS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing rendering packages: $$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@test -x $(PY) || python3 -m venv .venv
	@echo "installing pixelsac and its pinned dependencies into .venv (about a minute the first time)"
	@$(PIP) install -q -c constraints.txt -e '.[test]' 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
	@$(PY) -c "import torch, mujoco, dm_control, kornia, lightning, omegaconf; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert mujoco.__version__ == '3.17.0', mujoco.__version__"
	@touch $(STAMP)

demo: setup
	.venv/bin/pixelsac-train preset=tiny run_dir=runs/demo overwrite=true

# One pytest worker per core (pytest-xdist); `make test TEST_JOBS=1` runs the suite in one process.
# worksteal: the long end-to-end tests do not pile up on one worker.
TEST_JOBS ?= auto
PYTEST  := $(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal

# every test
test: setup lint
	$(PYTEST)

# the tests not marked slow: no end-to-end training runs
test-fast: setup lint
	$(PYTEST) -m "not slow"

# ruff (pinned in constraints.txt, configured in pyproject.toml): lint rules and formatting
lint: setup
	$(PY) -m ruff check pixelsac tests tools
	$(PY) -m ruff format --check pixelsac tests tools

format: setup
	$(PY) -m ruff check --fix pixelsac tests tools
	$(PY) -m ruff format pixelsac tests tools

# docs/configuration.md from the comments in conf/ (tests/test_docs.py fails when it is stale)
docs: setup
	$(PY) tools/config_doc.py

clean-venv:
	rm -rf .venv
