# Two commands on a fresh machine: `make demo` and `make test`. Both build the virtualenv first, with everything:
# the CPU torch, lorad's training stack (`train`), the test tools (`dev`) and the mirror's backends (`mirror`),
# each at the exact version and sha256 that requirements.lock names, so every later day installs the stack that
# was tested. pyproject.toml keeps its ranges for people who `pip install lorad` into their own environment.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCK := requirements.lock
STAMP := $(VENV)/.installed
# What `make lock` resolves against: the CPU build of torch (a plain `torch` requirement could pull a multi-GB
# CUDA build), and the triton that torch release is built with (torch's CUDA wheels pin it; the CPU wheel does not).
LOCK_CONSTRAINTS := requirements.constraints
# Where pip finds that CPU torch: this machine's wheel folder; elsewhere set PIP_FIND_LINKS or
# PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index (README, Set-up).
# uv in a venv of its own: `make lock` must run when pyproject.toml has a dependency the current lock lacks
# (the main venv's `pip check` would refuse it), at the uv version the lock itself names.
UV_VENV := .venv-lock
UV := $(UV_VENV)/bin/uv

.PHONY: venv demo test test-latest lock lint bench clean system-deps

venv: $(STAMP)

# --no-deps: the lock is the whole environment, resolved once by `make lock`; pip check proves it is consistent.
$(STAMP): pyproject.toml $(LOCK)
	rm -rf $(VENV)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $(STAMP)

# Refresh the lock after adding or bumping a dependency in pyproject.toml (or to move to newer releases on
# purpose): it resolves the newest versions the ranges and constraints allow, then `make test` installs them.
lock:
	[ -x $(UV) ] || { $(PY) -m venv $(UV_VENV) && $(UV_VENV)/bin/pip install -q "$$(grep -m1 '^uv==' $(LOCK) | cut -d' ' -f1)"; }
	$(UV) pip compile pyproject.toml --extra train --extra dev --extra mirror --generate-hashes \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 -c $(LOCK_CONSTRAINTS) \
	  --find-links "$${PIP_FIND_LINKS:-/opt/wheels}" --custom-compile-command 'make lock LOCK_ARGS="$(LOCK_ARGS)"' $(LOCK_ARGS) -o $(LOCK)

demo: $(STAMP)
	bash configs/demo.sh

# Two workers, one test file each at a time (a file's module fixtures are built once): most tests wait on the
# trainers and daemons they start, so one pytest process left a 2-core machine half idle. WORKERS=0 runs in one.
WORKERS ?= 2
test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q -x --timeout=600 --durations=20 -n $(WORKERS) --dist loadfile tests

# Not in CI: the newest releases pyproject.toml's ranges allow, unpinned, in a venv of their own, to find the
# next drift on purpose before a `make lock` takes it in. The lock check (tests/test_locked_install.py) is skipped.
LATEST := .venv-latest
test-latest: system-deps
	rm -rf $(LATEST)
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q "$$(grep -m1 '^torch==' $(LOCK) | cut -d' ' -f1)"
	$(LATEST)/bin/pip install -q -e '.[train,dev,mirror]'
	LORAD_UNLOCKED=1 $(LATEST)/bin/python -m pytest -q --timeout=600 -n $(WORKERS) --dist loadfile tests

# Debian packages some tests drive: chromium and its driver (the dashboard's browser test,
# tests/e2e/test_dashboard_browser.py), openssh-server (the mirror's SFTP server on loopback, tests/helpers/storage.py)
# and fuse3 (the soak's power-cut file system, tests/helpers/faultfs.py). Those missing are installed with one
# apt-get update when we may (root, apt-get); otherwise the tests that need them are skipped and say why.
system-deps:
	@missing=""; \
	{ [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } || missing="$$missing chromium chromium-driver"; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v fusermount3 >/dev/null || missing="$$missing fuse3"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing (apt-get) for the browser, SFTP and power-cut tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing \
	      || echo "could not install$$missing: the tests that need them will be skipped, saying why"; \
	  else echo "missing$$missing and not root with apt-get: the tests that need them will be skipped"; fi; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check engine daemon tests bench

clean:
	rm -rf $(VENV) $(LATEST) $(UV_VENV) demo-home
