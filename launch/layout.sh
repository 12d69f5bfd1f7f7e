# Sourced by the launchers. With LAYOUT=auto, auto_layout WORLD ARGS... prints the KEY=VALUE
# overrides of the layout this launch of WORLD ranks should train at (nothing: the config's own),
# from `megaformer plan CONFIG --gpus WORLD --relayout RUN_DIR`: the first launch of a run records
# its world size in RUN_DIR/layout.json; a launch with another count (nodes lost) gets the layout
# `megaformer plan` ranks best for it, global batch kept, and the reason on stderr. PLAN_ARGS: the
# hardware flags of `megaformer plan` (e.g. "--gpu H100-SXM"; default: the config's log.gpu).
auto_layout() {
  local world=$1; shift
  local run_dir plan=() skip=0 a
  run_dir=$("$PYTHON" -m megaformer train "$@" --dry-run | sed -n 's/^# run dir: //p' | head -n 1) || return 2
  for a in "$@"; do  # CONFIG and KEY=VALUE words only: train's own flags are not plan's
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    case "$a" in
      --run-dir|--init-from|--world-size) skip=1 ;;
      --run-dir=*|--init-from=*|--world-size=*|--dry-run) ;;
      *) plan+=("$a") ;;
    esac
  done
  # shellcheck disable=SC2086
  "$PYTHON" -m megaformer plan "${plan[@]}" --gpus "$world" --relayout "$run_dir" ${PLAN_ARGS:-}
}
