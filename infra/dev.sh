#!/usr/bin/env bash
# The README's two commands live here:
#   bash infra/dev.sh main   set everything up, start the local broker, run the main job
#   bash infra/dev.sh test   set everything up, run the checks and the whole test suite
#   bash infra/dev.sh bench wordcount   set up, start the broker, run one benchmark
#   bash infra/dev.sh cluster start|stop|status   a local RocketMQ cluster: name server,
#                                        broker-a master + slave, broker-b master
#   bash infra/dev.sh prod-like [up|down|status]   the production-shaped deployment:
#                                        Postgres, RocketMQ cluster with ACL, 2-worker Spark,
#                                        Dagster webserver + daemon, WordCount fed live
# Setup is idempotent: system packages (Java 17, Maven; for `test` also Debian's
# Chromium, for the UI test) only if missing, a project-local virtualenv in .venv,
# the project installed editable into it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}

log() { printf '\033[1m[stream-assets]\033[0m %s\n' "$*" >&2; }

# apt_install "what to install by hand" PACKAGE...: Debian packages through
# apt-get, as root or through passwordless sudo; otherwise say what is missing.
apt_install() {
  local hint=$1; shift
  local as_root=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      as_root=(sudo -n)
    else
      log "missing $*: $hint, then re-run"; exit 1
    fi
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "missing $* (no apt-get here): $hint, then re-run"; exit 1
  fi
  log "installing $* (apt-get)"
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

need_system_packages() {
  local missing=()
  command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jdk-headless)
  command -v mvn >/dev/null 2>&1 || missing+=(maven)
  if ((${#missing[@]})); then
    apt_install "install Java 17 and Maven" "${missing[@]}"
  fi
}

# PostgreSQL for the production-shaped deployment (and its test): Debian's server
# binaries live under /usr/lib/postgresql/<version>/bin, off PATH.
need_postgres() {
  command -v pg_ctl >/dev/null 2>&1 && return
  ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 && return
  apt_install "install PostgreSQL's server (Debian: apt-get install postgresql)" postgresql
}

# The UI test (tests/browser) drives a headless system Chromium with Playwright
# for Python (a dev dependency, launched with executable_path: it never
# downloads a browser of its own).
need_browser() {
  [ -n "${STREAM_ASSETS_TEST_CHROMIUM:-}" ] && return
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 && return
  apt_install "install Chromium (Debian: apt-get install chromium), or set STREAM_ASSETS_TEST_CHROMIUM to a Chromium binary" chromium
  chromium --version >/dev/null 2>&1 || { log "chromium was installed but does not run"; exit 1; }
}

setup_python() {
  "$PY" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 13), sys.version' 2>/dev/null || {
    log "Python 3.11 or 3.12 is required as '$PY' (set PYTHON=/path/to/python3.11)"; exit 1; }
  [ -x "$VENV/bin/python" ] || { log "creating virtualenv .venv"; "$PY" -m venv "$VENV"; }
  local stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    log "installing stream-assets and its dependencies into .venv (first run: a few minutes)"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -e ".[dev]"
    rm -f "$VENV"/.installed-* && touch "$stamp"
  fi
}

setup_env() {
  if [ -z "${JAVA_HOME:-}" ]; then
    JAVA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")
    export JAVA_HOME
  fi
  # Spark's Python workers must run the venv's interpreter (else they time out
  # connecting back), and Dagster keeps its storage project-local.
  export PYSPARK_PYTHON="$VENV/bin/python" PYSPARK_DRIVER_PYTHON="$VENV/bin/python"
  export DAGSTER_HOME=${DAGSTER_HOME:-$ROOT/.local/dagster}
  mkdir -p "$DAGSTER_HOME"
  [ -f "$DAGSTER_HOME/dagster.yaml" ] || cp infra/dagster/dagster.yaml "$DAGSTER_HOME/dagster.yaml"
  export PATH="$VENV/bin:$PATH"
  # Create the SQLite storage once, here: `dg dev` starts its webserver and
  # daemon together, and two processes initialising a fresh home at once can
  # both stamp the schema version, after which every open fails
  # (dagster-io/dagster#27390).
  [ -d "$DAGSTER_HOME/history" ] || dagster instance migrate >/dev/null
}

# The Spark driver JVM's class-data archive, once per JDK and Spark (~30 s idle, minutes
# on a loaded machine: 205 s at load ~40): every
# JVM an instance or test starts then starts ~3 s sooner (runtime/spark/class_archive.py).
setup_jvm_archive() { stream-assets jvm-archive; }

setup() { need_system_packages; setup_python; setup_env; setup_jvm_archive; }

case "${1:-}" in
  main)
    setup
    stream-assets broker start
    # `dg launch`, not the superseded `dagster job execute` (which warns so on every run)
    dg launch --job roundtrip_job -m stream_assets.definitions
    dg launch --job wordcount_demo_job -m stream_assets.definitions
    ;;
  test)
    setup
    need_browser
    need_postgres
    log "ruff"; ruff check .
    log "mypy"; mypy
    # The slowest tests, so CI shows where its time limit goes.
    log "pytest"; pytest -q -p no:cacheprovider --durations=25 "${@:2}"
    ;;
  bench)
    # One command per benchmark from a fresh clone: set up, start the local
    # broker, run benchmarks/<name>.py with the remaining arguments.
    name=${2:-}
    [ -f "benchmarks/$name.py" ] || {
      log "usage: bash infra/dev.sh bench <name> [args]; names: $(cd benchmarks && ls [a-z]*.py | sed 's/\.py$//' | tr '\n' ' ')"
      exit 2; }
    setup
    stream-assets broker start
    python "benchmarks/$name.py" "${@:3}"
    ;;
  prod-like)
    setup
    [ "${2:-up}" = up ] && need_postgres
    stream-assets deploy "${2:-up}"
    ;;
  cluster)
    setup
    stream-assets cluster "${@:2}"
    ;;
  setup)
    setup
    ;;
  *)
    echo "usage: bash infra/dev.sh main|test|bench <name>|cluster start|stop|status|prod-like [up|down|status]|setup" >&2; exit 2
    ;;
esac
