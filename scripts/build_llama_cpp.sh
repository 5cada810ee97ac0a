#!/usr/bin/env bash
# Build llama.cpp's CPU tools for `specdec-bench --peers llama.cpp` (docs/benchmarks.md).
#
# Usage: bash scripts/build_llama_cpp.sh [DEST]   (default ~/.cache/specdec-rt/llama.cpp)
#
# Only a package index is assumed reachable (no git clone), so the source is the llama.cpp tree
# vendored in the llama-cpp-python sdist, pinned so results are reproducible. Release build,
# native CPU flags, no CURL, no GPU backends. The binaries land in DEST/bin; point the bench at
# them with `export LLAMA_CPP_BIN=DEST/bin` (or put that folder on PATH).
# Environment: JOBS (default 2) parallel compile jobs; PYTHON (default python3) runs pip.
set -euo pipefail

VERSION="0.3.36"
DEST="${1:-$HOME/.cache/specdec-rt/llama.cpp}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python3}"
TARGETS=(llama-cli llama-simple llama-completion llama-speculative llama-speculative-simple
         llama-lookup llama-bench)

mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
SRC="$DEST/src"
BUILD="$DEST/build"

sdist="$(ls "$DEST"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$sdist" ]; then
  echo "== downloading llama-cpp-python==$VERSION (sdist) into $DEST"
  "$PY" -m pip download --no-binary :all: --no-deps \
      "llama-cpp-python==$VERSION" -d "$DEST"
  sdist="$(ls "$DEST"/llama_cpp_python-"$VERSION".tar.gz)"
fi

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "== extracting vendor/llama.cpp into $SRC"
  tmp="$(mktemp -d "$DEST/extract.XXXXXX")"
  tar -xzf "$sdist" -C "$tmp"
  rm -rf "$SRC"
  mv "$tmp"/llama_cpp_python-"$VERSION"/vendor/llama.cpp "$SRC"
  rm -rf "$tmp"
fi

# Native CPU flags, except on CPUs with AMX: this tree's AMX path crashes there (llama-completion
# exits with SIGSEGV at its first call on Q4_K_M files on an AMX Xeon; --no-repack avoids it), so
# the build names the AVX-512 / VNNI extensions itself and leaves AMX out: the fastest working build.
cpu_flags=(-DGGML_NATIVE=ON)
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
             -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
             -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  echo "== AMX CPU: building with explicit AVX-512 / VNNI flags and without AMX (its path crashes here)"
fi

echo "== configuring ($BUILD)"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    "${cpu_flags[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF \
    -DGGML_OPENCL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF

# Only build the targets this llama.cpp version defines (names moved between releases).
available="$(cmake --build "$BUILD" --target help 2>/dev/null || true)"
build_targets=()
for t in "${TARGETS[@]}"; do
  if grep -qE "(^|[ .:])$t(:|$| )" <<<"$available"; then build_targets+=("$t"); fi
done
if [ "${#build_targets[@]}" -eq 0 ]; then
  echo "none of ${TARGETS[*]} is a target of this llama.cpp tree" >&2
  exit 1
fi
echo "== building ${build_targets[*]} with -j$JOBS"
cmake --build "$BUILD" --config Release -j"$JOBS" --target "${build_targets[@]}"

mkdir -p "$DEST/bin"
for t in "${build_targets[@]}"; do
  cp -f "$BUILD/bin/$t" "$DEST/bin/"
done
echo "$VERSION" > "$DEST/bin/LLAMA_CPP_PYTHON_VERSION"
echo "== installed into $DEST/bin:"
ls "$DEST/bin"
echo "export LLAMA_CPP_BIN=$DEST/bin"
