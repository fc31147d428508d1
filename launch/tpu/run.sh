#!/usr/bin/env bash
# Run a nemo-jax command on every worker of a TPU VM slice; JAX detects the slice layout itself.
#
#   launch/tpu/run.sh TPU_NAME ZONE [PROJECT] -- nemo-jax sft --config configs/sft/super-120b.yaml
#
# Each worker needs the repo at the same path (REPO_DIR, default ~/nemo_jax) and nemo_jax installed with
# jax[tpu]. run_dir must be on shared storage (a gs:// path or a mounted bucket) so every host sees the
# checkpoints. NEMO_JAX_CLUSTER=tpu makes nemo_jax.parallel.distributed hand over to JAX's TPU detection.
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 2 ]] || usage
TPU=$1 ZONE=$2
shift 2
PROJECT_ARGS=()
if [[ $# -gt 0 && "$1" != "--" ]]; then PROJECT_ARGS=(--project "$1"); shift; fi
[[ "${1:-}" == "--" ]] || usage
shift
[[ $# -gt 0 ]] || usage
REPO_DIR=${REPO_DIR:-'~/nemo_jax'}

cmd=$(printf '%q ' "$@")
# --worker=all: the same command on every host of the slice, at once; ssh exits non-zero if any worker fails
exec gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" "${PROJECT_ARGS[@]}" --worker=all \
  --command "cd $REPO_DIR && NEMO_JAX_CLUSTER=tpu PYTHONUNBUFFERED=1 $cmd"
