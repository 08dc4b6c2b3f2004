# Sourced by the scripts that run a long job on the lent GPU machine across device calls (gpu-learning.sh,
# gpu-accept-detached.sh): each call re-sends the working tree, so the job runs from a copy of it, in a session of
# its own that outlives the call.

copy_tree() {  # DEST: the working tree without the carried wheels (.whl, .whl-RELEASE, .whl-verl), venvs and tools
  rm -rf "$1" && mkdir -p "$1"
  tar --exclude='./.whl*' --exclude=./.venv --exclude=./.venv-torch-compat --exclude=./.tools -cf - . | tar -xf - -C "$1"
}

run_detached() {  # LOG RC PIDFILE COMMAND...: COMMAND (a program, or a function exported with `export -f`) in a
  # session of its own, its output in LOG and its exit code in RC when it ends; returns at once
  local log=$1 rc=$2 pidfile=$3
  shift 3
  setsid bash -c 'log=$1 rc=$2; shift 2; "$@" > "$log" 2>&1; echo $? > "$rc"' _ "$log" "$rc" "$@" \
    < /dev/null > /dev/null 2>&1 &
  echo $! > "$pidfile"
}
