#!/usr/bin/env bash
# One venv per framework under ROOT (git-ignored), each with the framework's own resolved
# dependencies (torch pinned to the on-disk CPU wheel), pytest, and this checkout's wheel.
#   bash benchmarks/integrations/build_venvs.sh ROOT FRAMEWORK...   (axolotl | swift | llamafactory)
set -euo pipefail
root=$1; shift
declare -A REQUIREMENT=(
  [axolotl]="axolotl==0.19.0"        # 0.20+ needs Python 3.12
  [swift]="ms-swift==4.6.0"
  [llamafactory]="llamafactory==0.9.5"
)
PY=${INTEGRATIONS_PYTHON:-python3.11}
mkdir -p "$root/wheels"
rm -f "$root"/wheels/emdlm-*.whl
"$PY" -m pip wheel -q --no-deps . -w "$root/wheels"
for fw in "$@"; do
  venv="$root/$fw"
  stamp="$venv/.installed-${REQUIREMENT[$fw]}"
  if [ ! -f "$stamp" ]; then
    echo "building $venv (${REQUIREMENT[$fw]}; takes minutes)"
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q torch==2.13.0 "${REQUIREMENT[$fw]}" pytest==9.2.0
    if [ "$fw" = llamafactory ]; then
      # the torchvision / torchaudio it pulls in fail to load beside torch 2.13 CPU (no build
      # for it); run_llamafactory.py puts a stand-in torchaudio on the path instead
      "$venv/bin/pip" uninstall -q -y torchvision torchaudio
    fi
    touch "$stamp"
  fi
  "$venv/bin/pip" install -q --no-deps --force-reinstall "$root"/wheels/emdlm-*.whl
done
