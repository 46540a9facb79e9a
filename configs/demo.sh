#!/usr/bin/env bash
# `make demo`: the quickstart job, in the foreground, through `lorad run`, in ./demo-home.
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${LORAD_DEMO_HOME:-demo-home}
.venv/bin/lorad run configs/examples/quickstart.yaml --home "$HOME_DIR"
echo "adapter: $HOME_DIR/jobs/quickstart/output/ (run 'make demo' again: it resumes or reports the job finished)"
