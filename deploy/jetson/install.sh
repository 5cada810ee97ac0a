#!/usr/bin/env bash
# Install specdec-rt into a venv on JetPack 6 (Python 3.10, TensorRT 10.3). No compiling.
# Usage: ./install.sh SPECDEC_WHEEL ONNXRUNTIME_GPU_WHEEL [VENV_DIR]
#   ONNXRUNTIME_GPU_WHEEL: the onnxruntime-gpu 1.21/1.22 wheel built for JetPack 6 (aarch64, cp310).
# Status: not run on a Jetson yet (docs/backends.md).
set -euo pipefail

SPECDEC_WHL=${1:?usage: install.sh SPECDEC_WHEEL ONNXRUNTIME_GPU_WHEEL [VENV_DIR]}
ORT_WHL=${2:?usage: install.sh SPECDEC_WHEEL ONNXRUNTIME_GPU_WHEEL [VENV_DIR]}
VENV=${3:-$HOME/specdec-venv}

for f in "$SPECDEC_WHL" "$ORT_WHL"; do
    [ -f "$f" ] || { echo "install.sh: no such file: $f" >&2; exit 1; }
done
python3 -c 'import sys; assert sys.version_info[:2] >= (3, 10), sys.version' \
    || { echo "install.sh: Python >= 3.10 required (JetPack 6 ships 3.10)" >&2; exit 1; }
python3 -c 'import tensorrt' 2>/dev/null \
    || echo "install.sh: warning: system python has no tensorrt module (is JetPack's TensorRT installed?); provider 'trt' will be unavailable" >&2

# --system-site-packages: the JetPack tensorrt module lives in the system site-packages.
python3 -m venv --system-site-packages "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --upgrade pip
# The Jetson onnxruntime-gpu first; --no-deps everywhere after so nothing replaces it.
$PIP install "$ORT_WHL"
$PIP install "numpy>=1.24,<2" "tokenizers>=0.19" "jinja2>=3.1.6" "cuda-python>=12,<13"
# the server (specdec-serve, the [server] extra): pure-Python wheels, nothing to compile
$PIP install "starlette>=0.37" "uvicorn>=0.30" "prometheus-client>=0.20"
$PIP install --no-deps "$SPECDEC_WHL"

"$VENV/bin/python" - <<'PY'
import onnxruntime as ort
print("onnxruntime", ort.__version__, "providers:", ", ".join(ort.get_available_providers()))
try:
    import tensorrt
    print("tensorrt", tensorrt.__version__)
except ImportError as exc:
    print("tensorrt: not importable:", exc)
import specdec_rt
print("specdec-rt", specdec_rt.__version__, "installed")
PY
echo "done: $VENV (run: $VENV/bin/specdec-run --bundle BUNDLE --provider cuda --prompt ...;"
echo "      serve: $VENV/bin/specdec-serve --bundle BUNDLE --provider cuda)"
