#!/usr/bin/env bash
# Build (or reuse) a small environment holding OpenEnv's current release, `openenv` 0.10, on top
# of the trainer's own packages, for the connector's tests against it.
#
#   bash launch/setup_openenv_venv.sh       # default: ~/.cache/megatron-grpo/openenv-0.10
#
# openenv 0.10 pins mcp < 2 (through fastmcp 3), verifiers 0.4 pins mcp == 2.0, so the two
# cannot share one environment: the `agents` extra installs verifiers and openenv-core, the
# `openenv` extra installs openenv 0.10 instead. This environment sees the trainer's packages
# (a .pth naming the site-packages of the interpreter that runs this script, a venv or not,
# searched after its own) and installs only openenv and what it pins over them (mcp, fastmcp):
# ~15 s. tests/test_env_connectors.py runs the OpenEnv tests in it.
set -euo pipefail
venv="${MEGATRON_GRPO_OPENENV_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-grpo/openenv-0.10}"
python="${PYTHON:-python3}"
spec="openenv>=0.10,<0.11"
if [[ -f "$venv/.complete" && "$(cat "$venv/.complete")" == "$spec" ]]; then
  echo "setup_openenv_venv: $venv is ready"
  exit 0
fi
rm -rf "$venv.tmp"
"$python" -m venv "$venv.tmp"
site="$("$venv.tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$python" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/trainer_packages.pth"
# the trainer's verifiers pins the other mcp: pip says so, and it does not matter here
"$venv.tmp/bin/pip" install -q --disable-pip-version-check "$spec" 2>&1 | grep -v "dependency conflicts\|requires mcp\|resolver does not" || true
"$venv.tmp/bin/python" -c "import importlib.metadata as m, sys; v = m.version('openenv'); sys.exit(not v.startswith('0.10'))"
echo "$spec" > "$venv.tmp/.complete"
rm -rf "$venv"
mv "$venv.tmp" "$venv"
echo "setup_openenv_venv: $venv built"
