# Two commands on a fresh machine: `make demo` and `make test`. Both build the virtualenv first, with everything:
# the CPU torch, then lorad with its training stack (`train`) and the test tools (`dev`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; a plain `torch` requirement on a fresh venv could pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean system-deps

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[train,dev,mirror]'
	touch $(STAMP)

demo: $(STAMP)
	bash configs/demo.sh

# Two workers, one test file each at a time (a file's module fixtures are built once): most tests wait on the
# trainers and daemons they start, so one pytest process left a 2-core machine half idle. WORKERS=0 runs in one.
WORKERS ?= 2
test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q -x --timeout=600 --durations=20 -n $(WORKERS) --dist loadfile tests

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
	rm -rf $(VENV) demo-home
