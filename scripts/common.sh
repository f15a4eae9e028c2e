# Sourced by the CPU scripts (from the repository root): the virtualenv, made or checked first, one thread per rank,
# and `launch N ARGS...`: N local processes under the virtualenv's deepspeed launcher, on MASTER_PORT when it is set
# and otherwise on a port free now, so two scripts started side by side each rendezvous on their own; the launcher
# logs warnings and errors only (not its own start-up and exit lines: the runs print theirs).
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
port=${MASTER_PORT:-$(.venv/bin/python -c 'from llama_megatron.parallel.placement import free_port; print(free_port())')}

launch() {
  local processes=$1
  shift
  .venv/bin/deepspeed --num_gpus "$processes" --master_port "$port" --log_level warning "$@"
}

# `stale OUTPUT INPUT`: whether a step that makes OUTPUT from INPUT has to run: OUTPUT is missing or older than INPUT
# (a script run again redoes only what a new input changed, as make would); says so when it does not.
stale() {
  if [ "$1" -nt "$2" ]; then
    echo "up to date: $1 (newer than $2)"
    return 1
  fi
}
