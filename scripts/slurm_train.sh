#!/usr/bin/env bash
# Multi-node training under SLURM: run it with srun, one task per node; each node runs
# launch_training.sh -> `accelerate launch` with the rendezvous taken from SLURM's environment.
#
#   #SBATCH --nodes=2 --ntasks-per-node=1 --gres=gpu:4 --requeue
#   srun scripts/slurm_train.sh --config configs/glm-4.5-air-qlora-4gpu.yaml [launch_training.sh options]
#   srun scripts/slurm_train.sh --print --config ...     # print each node's mapping and command; run nothing
#
# From SLURM: machines = SLURM_JOB_NUM_NODES, this machine's rank = SLURM_NODEID, the main process = the
# first host of SLURM_JOB_NODELIST (scontrol show hostnames), GPUs per node = SLURM_GPUS_ON_NODE (else
# what nvidia-smi lists, else 1). Port: 20000 + job id % 20000 (two jobs sharing a node do not collide).
# GPUS_PER_NODE, MAIN_PROCESS_IP (e.g. the first node's fast-network address) and MAIN_PROCESS_PORT
# override; ACCELERATE_ARGS is appended.
# The run folder must be on a filesystem every node sees; every node resumes from its latest checkpoint.
# Exit codes: launch_training.sh's; 2 when not inside a SLURM job step or not one task per node.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
print_only=0
if [ "${1:-}" = "--print" ]; then
  print_only=1
  shift
fi
fail() { echo "slurm_train.sh: $*" >&2; exit 2; }
[ -n "${SLURM_JOB_NODELIST:-}" ] || fail "not inside a SLURM job: run it with srun (one task per node)"
[ -n "${SLURM_NODEID:-}" ] || fail "SLURM_NODEID is not set: run it with srun inside the allocation"
nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
if [ -n "${SLURM_NTASKS:-}" ] && [ "$SLURM_NTASKS" != "$nodes" ]; then
  fail "expected one task per node, got $SLURM_NTASKS tasks on $nodes nodes (srun --ntasks-per-node=1)"
fi
main_host="${MAIN_PROCESS_IP:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
[ -n "$main_host" ] || fail "scontrol show hostnames '$SLURM_JOB_NODELIST' named no host"
port="${MAIN_PROCESS_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
gpus="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
if [ -z "$gpus" ]; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
fi
case "$gpus" in ''|0|*[!0-9]*) gpus=1 ;; esac

export NUM_PROCESSES=$((nodes * gpus))
export ACCELERATE_ARGS="--num_machines $nodes --machine_rank $SLURM_NODEID --main_process_ip $main_host \
--main_process_port $port${ACCELERATE_ARGS:+ $ACCELERATE_ARGS}"
if [ "$print_only" = 1 ]; then
  echo "node ${SLURMD_NODENAME:-$(hostname)}: NUM_PROCESSES=$NUM_PROCESSES ACCELERATE_ARGS=$ACCELERATE_ARGS"
  printf '%q ' "$ROOT/launch_training.sh" "$@"
  echo
  exit 0
fi
exec "$ROOT/launch_training.sh" "$@"
