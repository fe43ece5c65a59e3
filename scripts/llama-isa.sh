#!/usr/bin/env bash
# Build llama.cpp (llama-cpp-python's release the oracle uses) for one x86 ISA, into a directory of
# its own, so that `knot bench --llama-lib` can set our kernels of that ISA against llama.cpp's
# kernels of the same ISA on one machine:
#   scripts/llama-isa.sh avx2 [DIR]      AVX2 + FMA + F16C, no AVX-512 (default DIR: ~/.cache/knot/llama-avx2)
#   scripts/llama-isa.sh native [DIR]    -march=native, as the oracle extra builds it
# then
#   KNOT_KERNELS=avx2 knot bench --llama-lib ~/.cache/knot/llama-avx2/llama_cpp/lib ...
# Why: the default build is -march=native, so on an AVX-512 machine it measures llama.cpp's
# AVX-512 kernels; held to AVX2 on both sides, the two ISAs' kernels compare on one machine
# (docs/performance.md, "Current figures per machine class"). It compiles llama.cpp from source
# each time: pip does not cache a --target install.
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
# the oracle's release, so that both builds are the same llama.cpp
version="$("$py" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null)" ||
  { echo "llama-isa: llama-cpp-python is not installed: run scripts/setup.sh dev,oracle first" >&2; exit 1; }
echo "llama-isa: building llama-cpp-python $version for $isa into $dir (compiling llama.cpp)" >&2
mkdir -p "$dir"
CMAKE_ARGS="$flags -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$py" -m pip install --disable-pip-version-check -q --no-deps --no-binary llama-cpp-python --no-cache-dir \
  --upgrade --target "$dir" "llama-cpp-python==$version"
LLAMA_CPP_LIB_PATH="$dir/llama_cpp/lib" "$py" -c \
  'import llama_cpp; print("llama-isa: built;", llama_cpp.llama_print_system_info().decode().strip())'
echo "llama-isa: knot bench --llama-lib $dir/llama_cpp/lib" >&2
