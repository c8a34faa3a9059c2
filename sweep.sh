#!/usr/bin/env bash
# Run a sweep (docs/sweeps.md): a grid of training jobs spread over this machine's GPUs, several
# jobs per GPU, or submitted to SLURM as one job array (--backend slurm). Sets up .venv on first use
# (like launch_training.sh), then `python -m trainer sweep`. Run it again after a crash or Ctrl-C:
# finished jobs are skipped, the others resume.
#
#   ./sweep.sh SWEEP.yaml [--gpus 0,1,2,3] [--gpu-plan 3,3,1,3] [--dry-run] [--retries N] [--root DIR]
#              [--set section.key=value ...] [--tune NAME=VALUE ...] [--only GLOB ...] [--plain]
#   ./sweep.sh SWEEP.yaml --backend slurm [--partition P] [--time T] [--slurm KEY=VALUE ...] [--dry-run]
#   ./sweep.sh status SWEEP.yaml
#   ./sweep.sh aggregate --root RUNS --output OUT [--small] [--only-finished]
#
# Exit codes: 0 all jobs finished (slurm: submitted), 1 a job failed after its retries, 2 bad input,
# 130/143 stopped.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
case "${1:-}" in
  -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
  "") echo "sweep.sh: expected a sweep file (see --help)" >&2; exit 2 ;;
esac
# shellcheck source=scripts/setup_venv.sh
. "$ROOT/scripts/setup_venv.sh"
# Relative paths in a sweep file are read from where you are: stay here, find the kit by PYTHONPATH.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "$1" = "aggregate" ]; then
  shift
  setup_venv "dashboard" || { echo "sweep.sh: environment setup failed" >&2; exit 1; }
  exec python -m trainer aggregate "$@"
fi
setup_venv "train" || { echo "sweep.sh: environment setup failed" >&2; exit 1; }
exec python -m trainer sweep "$@"
