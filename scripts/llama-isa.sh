#!/usr/bin/env bash
# Build llama.cpp (llama-cpp-python's release the oracle uses) for one x86 ISA, into a directory of
# its own, so that `knot bench --llama-lib` can set our kernels of that ISA against llama.cpp's
# kernels of the same ISA on one machine:
#   scripts/llama-isa.sh avx2 [DIR]      AVX2 + FMA + F16C, no AVX-512 (default DIR: ~/.cache/knot/llama-avx2)
#   scripts/llama-isa.sh native [DIR]    -march=native, as the oracle extra builds it
# then
#   KNOT_KERNELS=avx2 knot bench --llama-lib ~/.cache/knot/llama-avx2/llama_cpp/lib ...
# Why: the default build is -march=native, so on an AVX-512 machine it measures llama.cpp's
# AVX-512 kernels; an AVX2-only CPU class is then measured on an AVX-512 one with both sides held
# to AVX2 (docs/performance.md, "Machine classes"). About 10 minutes on 2 cores; pip does not cache it.
set -euo pipefail
cd "$(dirname "$0")/.."
isa="${1:-}"
dir="${2:-$HOME/.cache/knot/llama-$isa}"
case "$isa" in
  avx2) flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF" ;;
  native) flags="-DGGML_NATIVE=ON" ;;
  *) echo "usage: scripts/llama-isa.sh avx2|native [DIR]" >&2; exit 2 ;;
esac
py=.venv/bin/python
[ -x "$py" ] || { echo "llama-isa: run scripts/setup.sh dev,oracle first" >&2; exit 1; }
version="$("$py" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || echo 0.3.36)"
echo "llama-isa: building llama-cpp-python $version for $isa into $dir (about 10 minutes)" >&2
mkdir -p "$dir"
CMAKE_ARGS="$flags -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$py" -m pip install --disable-pip-version-check -q --no-deps --no-binary llama-cpp-python --no-cache-dir \
  --upgrade --target "$dir" "llama-cpp-python==$version"
LLAMA_CPP_LIB_PATH="$dir/llama_cpp/lib" "$py" -c \
  'import llama_cpp; print("llama-isa: built;", llama_cpp.llama_print_system_info().decode().strip())'
echo "llama-isa: knot bench --llama-lib $dir/llama_cpp/lib" >&2
