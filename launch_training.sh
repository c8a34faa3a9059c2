#!/usr/bin/env bash
# Train with one YAML config. Sets up .venv on first use, validates the config, then runs the
# trainer under `accelerate launch` on all local GPUs (plain python on a CPU-only machine).
# Resumes by itself when the output folder already holds a checkpoint.
#
#   ./launch_training.sh [--config FILE] [--set section.key=value ...] [--resume | --resume_from PATH]
#                        [--num_processes N] [--max_restarts N]
#
# Environment: NUM_PROCESSES (default: number of GPUs), TORCH_SPEC (torch to install when absent),
# VENV_DIR (default .venv), ACCELERATE_ARGS (extra `accelerate launch` flags, e.g. multi-node).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/setup_venv.sh
. "$ROOT/scripts/setup_venv.sh"

trainer_args=()
config_args=()  # --config/--set only: what check-config takes
num_processes="${NUM_PROCESSES:-}"
max_restarts=0
config="training_config.yaml"
while [ $# -gt 0 ]; do
  case "$1" in
    --num_processes|--num-processes) num_processes="$2"; shift 2 ;;
    --max_restarts|--max-restarts) max_restarts="$2"; shift 2 ;;
    --config) config="$2"; trainer_args+=("$1" "$2"); config_args+=("$1" "$2"); shift 2 ;;
    --set) trainer_args+=("$1" "$2"); config_args+=("$1" "$2"); shift 2 ;;
    --resume_from|--resume-from) trainer_args+=("$1" "$2"); shift 2 ;;
    --resume) trainer_args+=("$1"); shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "launch_training.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ ! -f "$config" ] && [ "$config" = "training_config.yaml" ] && [ -f "$ROOT/training_config.yaml" ]; then
  cd "$ROOT"  # the default config's paths are relative to the repository
fi

setup_venv "train" || { echo "launch_training.sh: environment setup failed" >&2; exit 1; }
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# Fail fast, once, on a bad config (exit 2) before any process loads a model.
python -m trainer check-config "${config_args[@]}" >/dev/null || exit $?

if [ -z "$num_processes" ]; then
  num_processes=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
fi
run_once() {
  if [ "${num_processes:-0}" -gt 1 ]; then
    # shellcheck disable=SC2086
    accelerate launch --num_processes "$num_processes" --multi_gpu ${ACCELERATE_ARGS:-} -m trainer train "$@"
  elif [ -n "${ACCELERATE_ARGS:-}" ]; then
    # shellcheck disable=SC2086
    accelerate launch --num_processes 1 ${ACCELERATE_ARGS} -m trainer train "$@"
  else
    python -m trainer train "$@"
  fi
}

attempt=0
while true; do
  run_once "${trainer_args[@]}"
  code=$?
  # 0 done, 2 bad input, 130/143 stopped by a signal after saving: none of these is retried.
  case "$code" in 0|2|130|143) exit "$code" ;; esac
  if [ "$attempt" -ge "$max_restarts" ]; then exit "$code"; fi
  attempt=$((attempt + 1))
  echo "launch_training.sh: trainer exited with $code; restart $attempt/$max_restarts (resumes from the latest checkpoint)" >&2
  # Later attempts take the latest checkpoint, not the one named on the command line.
  retry_args=()
  skip_next=0
  for arg in "${trainer_args[@]}"; do
    if [ "$skip_next" = 1 ]; then skip_next=0; continue; fi
    case "$arg" in --resume_from|--resume-from) skip_next=1 ;; --resume) ;; *) retry_args+=("$arg") ;; esac
  done
  trainer_args=("${retry_args[@]}")
done
