# Two commands on a fresh machine: `make demo` and `make test`. Both build the virtualenv first, with everything:
# the CPU torch, then lorad with its training stack (`train`) and the test tools (`dev`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; a plain `torch` requirement on a fresh venv could pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean browser sshd fuse

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
test: $(STAMP) browser sshd fuse
	$(BIN)/python -m pytest -q -x --timeout=600 --durations=20 -n $(WORKERS) --dist loadfile tests

# The dashboard's browser test drives Debian's chromium through chromedriver (tests/e2e/test_dashboard_browser.py).
# Installed here when missing and we may (root, apt-get); otherwise that one test is skipped and says why.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium and chromium-driver (apt-get) for the dashboard's browser test"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
	      || echo "could not install chromium: the browser test will be skipped"; \
	  else echo "no /usr/bin/chromium and not root with apt-get: the browser test will be skipped"; fi; \
	fi

# The mirror's SFTP tests run Debian's sshd on a loopback port (tests/helpers/storage.py). Installed here when
# missing and we may (root, apt-get); otherwise those tests are skipped and say why.
sshd:
	@if [ ! -x /usr/sbin/sshd ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing openssh-server (apt-get) for the mirror's SFTP tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server \
	      || echo "could not install openssh-server: the SFTP tests will be skipped"; \
	  else echo "no /usr/sbin/sshd and not root with apt-get: the SFTP tests will be skipped"; fi; \
	fi

# The soak's power-cut file system (tests/helpers/faultfs.py) mounts through Debian's fuse3 (fusermount3, /dev/fuse).
# Installed here when missing and we may; otherwise the tests that need it are skipped and say why.
fuse:
	@if ! command -v fusermount3 >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing fuse3 (apt-get) for the soak's power-cut file system"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 \
	      || echo "could not install fuse3: the power-cut tests will be skipped"; \
	  else echo "no fusermount3 and not root with apt-get: the power-cut tests will be skipped"; fi; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check engine daemon tests bench

clean:
	rm -rf $(VENV) demo-home
