#!/usr/bin/env bash
# Install everything the tests need into .venv (and Chromium for the browser test), then run the
# linter, the formatter check and the whole test suite. CI runs exactly this (.ci/run).
#   ./run_tests.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
# shellcheck source=scripts/setup_venv.sh
. scripts/setup_venv.sh

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[tests] installing chromium and chromium-driver for the browser test" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "[tests] chromium/chromedriver missing and cannot apt-get: install them for the browser test" >&2
  fi
fi

# The SLURM test (tests/slurm/) starts a one-node cluster of its own: it needs Debian's slurm-wlm and munge.
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[tests] installing slurm-wlm and munge for the SLURM test" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurm-wlm munge >/dev/null
  else
    echo "[tests] slurm-wlm/munge missing and cannot apt-get: install them (as root) for the SLURM test" >&2
  fi
fi

setup_venv "train,dashboard,test"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
ruff check .
ruff format --check .
python -m pytest "$@"
