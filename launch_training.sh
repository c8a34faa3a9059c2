#!/usr/bin/env bash
# Train with one YAML config: sets up .venv on first use, validates the config, installs what its model
# needs, then runs the trainer under `accelerate launch` (plain python on one device). --help: the options.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
invoked_as="$0"

usage() {
  cat <<'USAGE'
Usage: ./launch_training.sh [--config FILE] [--set section.key=value ...] [--resume | --resume_from PATH]
                            [--extend] [--num_processes N] [--max_restarts N] [--verbose]

Trains with one YAML config (default: training_config.yaml, the tiny embedded example). Sets up .venv on
first use, checks the config (bad input: one line, exit 2), installs what its model needs (GLA: the gla
extra; where that fails, one line with the pip command, exit 2), then runs `python -m trainer train` under
`accelerate launch` on all local GPUs. Resumes by itself when paths.output_dir holds a checkpoint; a
finished run is left as it is (exit 0) unless --extend trains it further to a larger training.max_steps.

  --config FILE        the YAML config
  --set KEY=VALUE      override one config value (repeatable), e.g. --set training.max_steps=100
  --resume             resume from the latest complete checkpoint (one must exist)
  --resume_from PATH   resume from this checkpoint folder
  --extend             train a finished run further (set a larger training.max_steps)
  --num_processes N    processes (GPUs) to use (default: $NUM_PROCESSES, else every visible GPU)
  --max_restarts N     restarts after a crash, each resuming from the latest checkpoint (default 1:
                       a transient fault - a lost node, a file system hiccup, an NCCL timeout - is
                       survived unattended, while a failure that repeats costs one model load, not a
                       loop). Exit 2 (bad input), 3 (refused) and 130/143 (stopped by a signal) are
                       never retried.
  --verbose            show third-party warnings hidden by default, and pip's output during set-up
  -h, --help           this text

On an abnormal exit it prints one line: what happened (the signal; exit 137 = SIGKILL, usually the
kernel's OOM killer), the last logged step and checkpoint, and the command that resumes.
Exit codes: 0 done (or finished already), 1 failure, 2 bad input, 3 refused, 130/143 stopped by a signal,
137 killed. Environment: NUM_PROCESSES, TORCH_SPEC (torch to install when absent), VENV_DIR (default .venv),
ACCELERATE_ARGS (extra `accelerate launch` flags, e.g. multi-node), KIT_VERBOSE=1 (same as --verbose).
USAGE
}

original_args=("$@")
trainer_args=()
config_args=()  # --config/--set only: what check-config takes
num_processes="${NUM_PROCESSES:-}"
max_restarts=1
config="training_config.yaml"
while [ $# -gt 0 ]; do
  case "$1" in
    --num_processes|--num-processes) num_processes="$2"; shift 2 ;;
    --max_restarts|--max-restarts) max_restarts="$2"; shift 2 ;;
    --config) config="$2"; trainer_args+=("$1" "$2"); config_args+=("$1" "$2"); shift 2 ;;
    --set) trainer_args+=("$1" "$2"); config_args+=("$1" "$2"); shift 2 ;;
    --resume_from|--resume-from) trainer_args+=("$1" "$2"); shift 2 ;;
    --resume|--extend) trainer_args+=("$1"); shift ;;
    --verbose) export KIT_VERBOSE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "launch_training.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$max_restarts" in
  ''|*[!0-9]*) echo "launch_training.sh: --max_restarts: expected an integer >= 0, got '$max_restarts'" >&2; exit 2 ;;
esac
if [ ! -f "$config" ] && [ "$config" = "training_config.yaml" ] && [ -f "$ROOT/training_config.yaml" ]; then
  cd "$ROOT"  # the default config's paths are relative to the repository
fi

# shellcheck source=scripts/setup_venv.sh
. "$ROOT/scripts/setup_venv.sh"
base_extras="$(train_extras)"
setup_venv "$base_extras" || { echo "launch_training.sh: environment setup failed" >&2; exit 1; }
# The trainer next to this script, whichever checkout the venv's editable install points at (as sweep.sh).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# Fail fast, once, on a bad config (exit 2) before any process loads a model; then install what the
# config's model needs beyond the base set (GLA: the gla extra), or name the command that does (exit 2).
setup_model_extras "$base_extras" "${config_args[@]}" || exit $?

if [ -z "$num_processes" ]; then
  num_processes=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
fi
run_once() {
  if [ "${num_processes:-0}" -gt 1 ]; then
    # shellcheck disable=SC2086
    accelerate launch --num_processes "$num_processes" --multi_gpu ${ACCELERATE_ARGS:-} -m trainer train "$@" 2>&3 3>&-
  elif [ -n "${ACCELERATE_ARGS:-}" ]; then
    # shellcheck disable=SC2086
    accelerate launch --num_processes 1 ${ACCELERATE_ARGS} -m trainer train "$@" 2>&3 3>&-
  else
    python -m trainer train "$@" 2>&3 3>&-
  fi
}

# The command that resumes: this one as typed, less --resume/--resume_from (resume takes the latest).
resume_command=("$invoked_as")
skip_next=0
for arg in "${original_args[@]}"; do
  if [ "$skip_next" = 1 ]; then skip_next=0; continue; fi
  case "$arg" in --resume_from|--resume-from) skip_next=1 ;; --resume) ;; *) resume_command+=("$arg") ;; esac
done

# SIGTERM/SIGINT to the process group (Ctrl-C, a sweep, SLURM's scancel, preemption or requeue) reach
# the trainer too, which saves a checkpoint and exits 143/130: this script and the subshell below wait
# for it (the traps only note the signal) rather than die first, so whoever waits for this script (a
# SLURM batch step) never returns while the checkpoint is being written.
stopped_by=""
trap 'stopped_by=TERM' TERM
trap 'stopped_by=INT' INT
attempt=0
while true; do
  started=$(date +%s)
  # In a subshell whose own stderr is /dev/null: bash prints its "Killed" line for a child killed by a
  # signal there, while the trainer keeps the real stderr (fd 3); exit_report says more than "Killed".
  (exec 3>&2 2>/dev/null; trap : TERM INT; run_once "${trainer_args[@]}")
  code=$?
  # 0 done, 2 bad input, 3 refused: the trainer has said why; nothing to add or retry.
  case "$code" in 0|2|3) exit "$code" ;; esac
  python -m trainer.reports.exit_report --code "$code" --since "$started" "${config_args[@]}" -- "${resume_command[@]}" >&2
  # 130/143: stopped on purpose by a signal (after saving); never retried, nor is any exit after one.
  case "$code" in 130|143) exit "$code" ;; esac
  if [ -n "$stopped_by" ]; then exit "$code"; fi
  if [ "$attempt" -ge "$max_restarts" ]; then exit "$code"; fi
  attempt=$((attempt + 1))
  echo "launch_training.sh: restart $attempt/$max_restarts, resuming from the latest checkpoint" >&2
  # Later attempts take the latest checkpoint, not the one named on the command line.
  retry_args=()
  skip_next=0
  for arg in "${trainer_args[@]}"; do
    if [ "$skip_next" = 1 ]; then skip_next=0; continue; fi
    case "$arg" in --resume_from|--resume-from) skip_next=1 ;; --resume) ;; *) retry_args+=("$arg") ;; esac
  done
  trainer_args=("${retry_args[@]}")
done
