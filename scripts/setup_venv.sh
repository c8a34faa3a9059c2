# Sourced by launch_training.sh and run_tests.sh: create .venv and install the given extras once.
#
# torch comes first and pinned (TORCH_SPEC, default torch==2.13.0) only when the venv has none:
# users with a CUDA build keep theirs, and machines with a local wheel take the fast path.
# Usage: setup_venv "train" | "train,dashboard,test"
#
# Quiet unless KIT_VERBOSE=1 (launch_training.sh --verbose): pip's progress, and setuptools' boxed
# "Editable installation" warning (about folders named like the package shadowing it; this repository
# has none), are hidden by a filter on that one warning, passed to the build through PYTHONWARNINGS.
EDITABLE_WARNING_FILTER="ignore:Editable installation:Warning:setuptools.command.editable_wheel"
# The extras a training run wants here: the fast path's kernels where an NVIDIA GPU answers.
train_extras() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "train,fast"
  else
    echo "train"
  fi
}

kit_root() { cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd; }

# The file that says "these extras were installed for this pyproject.toml": set-up skips pip when it exists.
venv_stamp() {
  local root; root="$(kit_root)"
  echo "${VENV_DIR:-$root/.venv}/.installed-$(echo "$1" | tr ',' '-')-$(cksum < "$root/pyproject.toml" | cut -d' ' -f1)"
}

setup_venv() {
  local extras="$1"
  local root; root="$(kit_root)"
  local venv="${VENV_DIR:-$root/.venv}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating virtual environment in $venv" >&2
    python3 -m venv "$venv" || { echo "[setup] error: python3 -m venv failed (install python3-venv)" >&2; return 1; }
  fi
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
  local stamp; stamp="$(venv_stamp "$extras")"
  if [ -f "$stamp" ]; then
    return 0
  fi
  # Launchers started together on one shared .venv (a SLURM job array, the nodes of a multi-node run)
  # install one at a time: the first installs, the others wait for its lock and find the stamp.
  {
    if command -v flock >/dev/null 2>&1; then flock 9; fi
    [ -f "$stamp" ] || install_extras "$extras" "$root" "$stamp"
  } 9>>"$venv/.setup.lock"
}

install_extras() {
  local extras="$1" root="$2" stamp="$3"
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! python -c "import torch" >/dev/null 2>&1 && [[ "$extras" == *train* ]]; then
    echo "[setup] installing ${TORCH_SPEC:-torch==2.13.0}" >&2
    python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" || return 1
  fi
  echo "[setup] installing the kit with extras [$extras]" >&2
  if [ "${KIT_VERBOSE:-0}" != "0" ]; then
    python -m pip install -e "$root[$extras]" || return 1
  else
    PYTHONWARNINGS="$EDITABLE_WARNING_FILTER" python -m pip install -q -e "$root[$extras]" || return 1
  fi
  touch "$stamp"
}

# After setup_venv BASE: the extras the config's model needs (GLA: gla), found by `python -m trainer needs`
# from its config.json, installed like BASE. Checks the config on the way (bad input: its line, exit 2).
# Where pip cannot install them (offline, no wheel), one line naming the command to run, and exit 2,
# before any model loads. Mamba's compiled kernels are never installed here: `needs` prints how (stderr).
# Usage: setup_model_extras "$(train_extras)" --config FILE [--set KEY=VALUE ...]
setup_model_extras() {
  local base="$1"; shift
  local missing code
  missing="$(python -m trainer needs --missing "$@")"
  code=$?
  [ "$code" = 0 ] || return "$code"
  [ -n "$missing" ] || return 0
  local extras="$base,$missing"
  rm -f "$(venv_stamp "$extras")"  # they are missing, whatever an old stamp says
  if setup_venv "$extras" && [ -z "$(python -m trainer needs --missing "$@" 2>/dev/null)" ]; then
    return 0
  fi
  echo "[setup] error: could not install the [$missing] extra this model needs; run:" \
    "$(command -v python) -m pip install -e '$(kit_root)[$extras]'  (then launch again)" >&2
  return 2
}
