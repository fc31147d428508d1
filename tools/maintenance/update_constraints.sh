#!/usr/bin/env bash
# Re-pin constraints.txt: install the newest releases pyproject.toml allows (no constraints) into a fresh
# virtual environment, run the whole test suite there, and only when it passes write what is installed, exact
# versions, to constraints.txt. Review `git diff constraints.txt` and commit it with the code it passed with.
#
#   tools/maintenance/update_constraints.sh                       # from anywhere in the repo; takes as long as the suite
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu tools/maintenance/update_constraints.sh   # CPU build of torch
#
# pip options come from the environment (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, ...). The venv is
# made under $TMPDIR and removed at the end (KEEP_VENV=1 keeps it and prints where).
set -euo pipefail
cd "$(dirname "$0")/../.."
# every extra the suite or a documented command uses (plan-gpu / plan-tpu: deviceless compiles in the tests)
EXTRAS=${EXTRAS:-test,serve,worker,mcp,plot,wandb,parquet,plan-gpu,plan-tpu}
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d)
[[ "${KEEP_VENV:-0}" == 1 ]] && echo "venv: $tmp/venv" >&2 || trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install ".[$EXTRAS]"   # no -c: the newest releases pyproject.toml allows
"$py" -m pytest -q   # the README's test command, in the new environment
{
  sed -n '/^#/!q;p' constraints.txt   # the comment block at the top of the current file
  # exact versions of everything installed but pip and nemo_jax itself; names in their normal form; a local
  # version label (torch 2.13.0+cpu) dropped, so that the pin matches the CPU build and PyPI's alike
  "$py" -m pip freeze --all | "$py" -c '
import re, sys
pins = {}
for line in sys.stdin:
    name, sep, version = line.strip().partition("==")
    name = re.sub(r"[-_.]+", "-", name).lower()
    if sep and name not in ("pip", "nemo-jax"):
        pins[name] = version.split("+")[0]
print("\n".join(f"{n}=={v}" for n, v in sorted(pins.items())))'
} > "$tmp/constraints.txt"
mv "$tmp/constraints.txt" constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins (git diff constraints.txt)" >&2
