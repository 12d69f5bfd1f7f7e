# Sourced by the launchers: sets PYTHON to the interpreter that runs megaformer and checks that it
# can (one line and exit 2 otherwise). PYTHON from the environment wins; else the project's .venv
# (next to launch/), else the python3 on PATH.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$_root/.venv/bin/python" ]; then PYTHON="$_root/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("megaformer")))' 2>/dev/null; then
  echo "megaformer: error: $PYTHON cannot import torch and megaformer; activate the venv megaformer is installed in (source .venv/bin/activate) or set PYTHON=/path/to/venv/bin/python" >&2
  exit 2
fi
