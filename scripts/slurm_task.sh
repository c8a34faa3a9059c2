#!/usr/bin/env bash
# One sweep job inside a SLURM array task; the batch script `sweep --backend slurm` writes ends in it.
#
#   scripts/slurm_task.sh JOB_DIR -- COMMAND [ARGS...]      (COMMAND: launch_training.sh and its arguments)
#
# Appends to JOB_DIR/job.log a header per attempt (SLURM job, restart count, node), then the command's
# output. The command runs in a process group of its own, and this script waits for the whole group:
#   - SIGTERM (scancel, preemption, `scontrol requeue`, a node drain): forwarded; the trainer saves a
#     checkpoint and exits 143. SLURM requeues the job or not (--requeue; scancel does not).
#   - SIGUSR1 (`#SBATCH --signal=B:USR1@SECONDS`, before the time limit): the trainer is sent SIGTERM,
#     saves and exits; then this script requeues its own job (`scontrol requeue`), which resumes from
#     that checkpoint, unless the run finished meanwhile.
# Exit status: the command's.
set -uo pipefail
if [ $# -lt 3 ] || [ "$2" != "--" ]; then
  echo "usage: slurm_task.sh JOB_DIR -- COMMAND [ARGS...]" >&2
  exit 2
fi
job_dir="$1"
shift 2
mkdir -p "$job_dir" || exit 1
exec >>"$job_dir/job.log" 2>&1

task="${SLURM_ARRAY_JOB_ID:-${SLURM_JOB_ID:-?}}${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}"
attempt=$((${SLURM_RESTART_COUNT:-0} + 1))
say() { echo "[slurm_task $(date '+%H:%M:%S')] $*"; }
echo "==== sweep ${SWEEP_NAME:-?}: slurm job $task (job id ${SLURM_JOB_ID:-?}), attempt $attempt" \
  "on $(hostname), $(date '+%Y-%m-%d %H:%M:%S')"
printf '$'
printf ' %q' "$@"
echo

child=""
near_limit=0
forward() {  # to the command's whole process group (launcher, accelerate, trainer ranks)
  [ -n "$child" ] || return 0
  kill -s "$1" -- "-$child" 2>/dev/null || kill -s "$1" "$child" 2>/dev/null || true
}
trap 'near_limit=1; say "SIGUSR1: time limit near; the trainer saves and stops, then the job is requeued"; forward TERM' USR1
trap 'say "SIGTERM: the trainer saves a checkpoint and stops"; forward TERM' TERM
trap 'forward INT' INT

setsid "$@" &
child=$!
# `wait` returns early whenever a trapped signal arrives; wait again until the command has ended.
while kill -0 "$child" 2>/dev/null; do
  wait "$child"
done
wait "$child"
code=$?
# The launcher is gone; a trainer rank of its group may still be writing: the step ends when they do.
while kill -0 -- "-$child" 2>/dev/null; do
  sleep 1
done

run_status() {
  python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("status", ""))' "$job_dir/run.json" \
    2>/dev/null
}
if [ "$near_limit" = 1 ] && [ "$(run_status)" != "finished" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  say "exit $code; requeueing job ${SLURM_JOB_ID} to resume from its checkpoint"
  scontrol requeue "$SLURM_JOB_ID" || say "scontrol requeue failed: submit the sweep again to resume"
else
  say "exit $code"
fi
exit "$code"
