#!/usr/bin/env bash
# `make demo`: the service. Starts `lorad serve` in a temporary home, drops the quickstart job into its
# inbox, prints the dashboard's address (open it while the job runs), shows `lorad status` until the job is
# done, prints where the adapter is, and stops the daemon cleanly (SIGTERM). About a minute on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
LORAD=.venv/bin/lorad
DEMO=$(mktemp -d "${TMPDIR:-/tmp}/lorad-demo-XXXXXX")
HOME_DIR=$DEMO/home

# The daemon only reads job data under its allowed roots: the lorad home and, for this demo, the repo.
cat > "$DEMO/daemon.yaml" <<YAML
allowed_roots: ["{home}", "$REPO"]
tick_s: 0.25
web: {listen: "127.0.0.1:${LORAD_DEMO_PORT:-0}"}   # port 0: any free port; lorad web-url says which
YAML
# lorad serve runs as its own user, never root; in a container where root is the only user it starts as root
# only when told so explicitly (outside a container a root daemon refuses, saying what to do instead).
if [ "$(id -u)" = 0 ]; then echo "run_as_root: true   # the demo runs as root (in a container)" >> "$DEMO/daemon.yaml"; fi

echo "== lorad serve --home $HOME_DIR   (daemon log: $DEMO/daemon.log)"
$LORAD serve --home "$HOME_DIR" --config "$DEMO/daemon.yaml" > "$DEMO/daemon.log" 2>&1 &
DAEMON=$!
trap 'kill -TERM $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 100); do $LORAD ping --home "$HOME_DIR" >/dev/null 2>&1 && break; sleep 0.2; done
$LORAD ping --home "$HOME_DIR"
echo "== dashboard (open it now; it stays up while the demo job runs): $($LORAD web-url --home "$HOME_DIR")"

# A job file in the inbox names its paths relative to the inbox, so give the data path absolutely;
# write it next to the inbox and rename it in, so the daemon never sees half a file.
sed "s#path: data/#path: $REPO/configs/examples/data/#" configs/examples/quickstart.yaml > "$HOME_DIR/quickstart.yaml"
mv "$HOME_DIR/quickstart.yaml" "$HOME_DIR/inbox/quickstart.yaml"
echo "== dropped configs/examples/quickstart.yaml into $HOME_DIR/inbox/"

while true; do
  echo "== lorad status   ($(date +%T))"
  $LORAD status --home "$HOME_DIR"
  s=$($LORAD status --home "$HOME_DIR" --json | .venv/bin/python -c 'import json,sys; j=json.load(sys.stdin)["jobs"]; print(j[0]["state"] if j else "queued")')
  case $s in succeeded|failed|cancelled) break ;; esac
  sleep 3
done

JOB=$($LORAD status --home "$HOME_DIR" --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["id"])')
echo "== lorad status $JOB"
$LORAD status --home "$HOME_DIR" "$JOB"
if [ "$s" = succeeded ]; then
  echo "== adapter: $HOME_DIR/jobs/$JOB/output/"
  ls -l "$HOME_DIR/jobs/$JOB/output/"
fi

echo "== stopping the daemon (SIGTERM)"
kill -TERM $DAEMON
wait $DAEMON && echo "lorad serve exited cleanly (0)"
trap - EXIT
echo "(the demo home stays in $DEMO; remove it when done)"
[ "$s" = succeeded ]
