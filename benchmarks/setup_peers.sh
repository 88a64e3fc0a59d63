#!/usr/bin/env bash
# Build the benchmarks' peers, once, under the compilecore cache directory (never in CI):
#   - llama.cpp from the tree vendored in llama-cpp-python's source distribution:
#     libllama (shared), llama-batched-bench, llama-bench, llama-server, llama-perplexity
#     and llama-quantize (cmake, ~6 min)
#   - llama-cpp-python's Python binding from the same source distribution, pointed at
#     that libllama (LLAMA_CPP_LIB_PATH) instead of compiling llama.cpp a second time
#   - the default model's safetensors converted to BF16 and Q8_0 GGUF with that tree's
#     own convert_hf_to_gguf.py (same weights for every peer)
# Safe to run again: each step is skipped when its output exists.
# `compilecore bench latency|throughput|serve` find the peers through benchmarks/peers.py.
#   - ik_llama.cpp's llama-bench (the fork that leads llama.cpp on CPU), when its source
#     tree is given: `setup_peers.sh --ik PATH` or IK_LLAMA_CPP_SRC=PATH (a checkout, or
#     `git archive` of one); skipped with one line otherwise. Its AVX-512 paths are
#     CMake options of their own (off by default, not implied by GGML_NATIVE): each is
#     turned on where /proc/cpuinfo lists the feature.
set -euo pipefail
ik_src="${IK_LLAMA_CPP_SRC:-}"
if [ "${1:-}" = "--ik" ]; then ik_src="${2:?--ik needs the ik_llama.cpp source folder}"; fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache="$(python -c 'from compilecore.config import cache_root; print(cache_root())')"
peers="$cache/peers"
src="$peers/llama_cpp_python-$version"
build="$peers/llama.cpp-build"
mkdir -p "$peers"

if [ ! -d "$src" ]; then
    echo "[peers] downloading llama-cpp-python $version (source distribution)" >&2
    python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$peers"
    tar xzf "$peers/llama_cpp_python-$version.tar.gz" -C "$peers"
fi

tools="llama-batched-bench llama-bench llama-server llama-perplexity llama-quantize llama-lookup"
build_llama_cpp() {  # extra compiler flags as the one argument
    cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DCMAKE_C_FLAGS="$1" -DCMAKE_CXX_FLAGS="$1" >/dev/null
    cmake --build "$build" -j"$(nproc)" --target llama $tools >/dev/null
}
missing_tool=0
for tool in $tools; do [ -x "$build/bin/$tool" ] || missing_tool=1; done
if [ "$missing_tool" = 1 ] || [ ! -f "$build/bin/libllama.so" ]; then
    echo "[peers] building llama.cpp (cmake, Release, native ISA; ~6 min on 2 cores)" >&2
    build_llama_cpp ""
fi
# On a 2026-12 AMX Xeon VM llama.cpp's AMX kernels died in their first `tileloadd` (SIGILL)
# on every prompt: where a short prompt fails on an AMX CPU, build it again without them.
shipped="$(python -c 'from models.default_model import find_gguf; print(find_gguf() or "")')"
if grep -qw amx_tile /proc/cpuinfo && [ -n "$shipped" ] && \
        ! "$build/bin/llama-bench" -m "$shipped" -p 32 -n 0 -t 1 -r 1 >/dev/null 2>&1; then
    echo "[peers] llama.cpp's prompt path fails on this CPU (its AMX kernels): rebuilding" \
        "llama.cpp without AMX (~6 min)" >&2
    rm -rf "$build"
    build_llama_cpp "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi

if ! python -m pip show -q llama-cpp-python >/dev/null 2>&1; then
    echo "[peers] installing the llama-cpp-python binding (library from the cmake build)" >&2
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" python -m pip install -q --no-deps "$src"
    python -m pip install -q "typing-extensions>=4.5" "numpy>=1.20" "diskcache>=5.6" "jinja2>=2.11"
fi
# The binding loads libllama from its own lib/ folder: link the cmake build's libraries there.
lib="$(python -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("llama_cpp").origin))')/lib"
mkdir -p "$lib"
ln -sf "$build"/bin/lib*.so* "$lib"/
python -c "import llama_cpp" || { echo "[peers] llama_cpp does not import" >&2; exit 1; }

python -m pip install -q sentencepiece "protobuf>=4"
model="$(python -c 'from models.default_model import ensure_default_model; print(ensure_default_model())')"
for outtype in bf16 q8_0; do
    gguf="$peers/smollm2-135m-instruct-$outtype.gguf"
    if [ ! -f "$gguf" ]; then
        echo "[peers] converting the default model to $outtype GGUF" >&2
        PYTHONPATH="$src/vendor/llama.cpp/gguf-py" python "$src/vendor/llama.cpp/convert_hf_to_gguf.py" \
            "$model" --outtype "$outtype" --outfile "$gguf.tmp" >/dev/null 2>&1
        mv "$gguf.tmp" "$gguf"
    fi
done

ik_build="$peers/ik_llama.cpp-build"
if [ -z "$ik_src" ]; then
    echo "[peers] ik_llama.cpp: no source tree given (--ik PATH or IK_LLAMA_CPP_SRC), skipped" >&2
elif [ ! -x "$ik_build/bin/llama-bench" ]; then
    [ -f "$ik_src/CMakeLists.txt" ] || { echo "[peers] $ik_src is not an ik_llama.cpp tree" >&2; exit 1; }
    flags=()
    for pair in avx512f:GGML_AVX512 avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16 \
                avx512vbmi:GGML_AVX512_VBMI; do
        if grep -qw "${pair%%:*}" /proc/cpuinfo; then flags+=("-D${pair#*:}=ON"); fi
    done
    echo "[peers] building ik_llama.cpp's llama-bench (native${flags[*]:+, ${flags[*]}}; ~10 min)" >&2
    cmake -S "$ik_src" -B "$ik_build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "${flags[@]}" \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_CUDA=OFF >/dev/null
    cmake --build "$ik_build" -j"$(nproc)" --target llama-bench >/dev/null
fi
echo "[peers] ready in $peers" >&2
