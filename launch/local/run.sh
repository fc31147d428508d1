#!/usr/bin/env bash
# Run a nemo-jax command as N cooperating processes on this machine, each with D fake CPU devices
# (XLA's host-platform device count), talking over gloo. The multi-host code paths, on one box.
#
#   launch/local/run.sh --processes 2 --devices-per-process 4 -- nemo-jax sft steps=6
#
# Options:
#   --processes N            number of processes (default 2)
#   --devices-per-process D  fake CPU devices per process (default 1)
#   --port P                 coordinator port on 127.0.0.1 (default: a free one)
#   --grace S                after one process fails, seconds the others get to stop by themselves
#                            (JAX's heartbeat catches a lost peer) before they are killed (default 90)
# Every process gets NEMO_JAX_COORDINATOR / NEMO_JAX_NUM_PROCESSES / NEMO_JAX_PROCESS_ID, which
# nemo_jax.parallel.distributed.initialize reads. Output lines are prefixed with the process id.
# Exit status: 0 when every process exits 0, else the first failing process's status.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
N=2 D=1 PORT=0 GRACE=90
while [[ $# -gt 0 ]]; do
  case "$1" in
    --processes) N="$2"; shift 2 ;;
    --devices-per-process) D="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --grace) GRACE="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "run.sh: unknown option $1 (the command goes after --)" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] || { echo "run.sh: no command given after --" >&2; usage; }
[[ "$N" =~ ^[1-9][0-9]*$ && "$D" =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: --processes/--devices-per-process must be positive integers" >&2; exit 2; }

if [[ "$PORT" == 0 ]]; then
  PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
# drop any earlier device-count flag, then force D CPU devices per process
flags=$(echo " ${XLA_FLAGS:-} " | sed -E 's/ --xla_force_host_platform_device_count=[0-9]+ / /g')
export XLA_FLAGS="--xla_force_host_platform_device_count=$D${flags% }"
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
export NEMO_JAX_COORDINATOR="127.0.0.1:$PORT" NEMO_JAX_NUM_PROCESSES="$N"

pids=()
for ((i = 0; i < N; i++)); do
  NEMO_JAX_PROCESS_ID=$i "$@" > >(sed -u "s/^/[$i] /") 2> >(sed -u "s/^/[$i] /" >&2) &
  pids+=($!)
done

kill_all() { for p in "${pids[@]}"; do kill "-$1" "$p" 2>/dev/null || true; done; }
trap 'kill_all TERM' INT TERM

rc=0 left=$N deadline=0
while ((left > 0)); do
  for idx in "${!pids[@]}"; do
    p=${pids[$idx]}
    kill -0 "$p" 2>/dev/null && continue  # still running (bash reaps finished children itself)
    set +e; wait "$p"; status=$?; set -e
    unset 'pids[idx]'
    left=$((left - 1))
    if ((status != 0)); then
      echo "run.sh: process $idx exited with status $status" >&2
      if ((rc == 0)); then rc=$status; deadline=$((SECONDS + GRACE)); fi
    fi
  done
  if ((rc != 0 && left > 0 && SECONDS >= deadline)); then
    echo "run.sh: $left process(es) still running ${GRACE}s after a failure; killing them" >&2
    kill_all KILL
  fi
  ((left > 0)) && sleep 0.3
done
wait  # the output prefixers
exit $rc
