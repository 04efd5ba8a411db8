#!/usr/bin/env bash
# Build (or reuse) the virtual environment that runs the real SGLang server on a CPU-only machine.
#
#   bash launch/setup_sglang_cpu.sh            # default: ~/.cache/megatron-grpo/sglang-cpu
#   MEGATRON_GRPO_SGLANG_VENV=/path bash launch/setup_sglang_cpu.sh
#
# SGLang publishes no CPU build of its kernels, so a plain `pip install sglang` cannot serve on a
# machine without a GPU. This script installs sglang 0.5.23 without its dependencies, then the
# dependencies that work on CPU (launch/sglang_cpu/requirements.txt, torch 2.14.1
# as sglang pins it), and copies the small `sgl_kernel` CPU stand-in from the same folder into
# the environment. About 7 GB and a few minutes the first time; a second run with the same inputs
# only checks the environment (a stamp file records what it was built from). The trainer's own
# environment is untouched: the server runs from this environment's interpreter, which the
# trainer finds by default (engine.sglang.python overrides it).
#
# GPU machines do not need this: install sglang the ordinary way (`pip install "sglang>=0.5.23"`).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
src="$here/launch/sglang_cpu"
venv="${MEGATRON_GRPO_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-grpo/sglang-cpu}"
python="${PYTHON:-python3}"
sglang_version="0.5.23"

stamp_of_inputs() {
  { echo "sglang==$sglang_version"; "$python" -c 'import sys; print(sys.version.split()[0])';
    cat "$src/requirements.txt" "$src/sgl_kernel/__init__.py"; } | sha256sum | cut -d' ' -f1
}
want="$(stamp_of_inputs)"

check_env() {
  # Imports what the server needs at start-up (not just `import sglang`), in a clean environment.
  env -u PYTHONPATH SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" - <<'PY'
import importlib.metadata as md
import sgl_kernel, sglang.srt.entrypoints.http_server  # noqa: F401
assert sgl_kernel.__version__.endswith("megatron_grpo_cpu_stand_in"), sgl_kernel.__file__
print(f"sglang {md.version('sglang')}, torch {md.version('torch')}, sgl_kernel CPU stand-in: ok")
PY
}

if [[ -f "$venv/.megatron_grpo_stamp" && "$(cat "$venv/.megatron_grpo_stamp")" == "$want" ]]; then
  echo "setup_sglang_cpu: reusing $venv"
  check_env
  exit 0
fi

# No stamp, or a stamp from other inputs: the environment is incomplete or stale. Start afresh;
# the stamp is written last, so an interrupted build is never taken for a complete one.
echo "setup_sglang_cpu: building $venv (about 7 GB, a few minutes)"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input)
"${pip[@]}" -r "$src/requirements.txt"
"${pip[@]}" --no-deps "sglang==$sglang_version"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$site/sgl_kernel"
cp -r "$src/sgl_kernel" "$site/sgl_kernel"
check_env
echo "$want" > "$venv/.megatron_grpo_stamp"
echo "setup_sglang_cpu: ready: $venv/bin/python"
