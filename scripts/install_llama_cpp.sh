#!/usr/bin/env bash
# llama.cpp for bench's peer rows (`python -m eagle_trt.bench --peers llama.cpp`): llama-cpp-python
# built from its source distribution with this CPU's native flags (AVX2 / AVX-512 as the CPU has
# them), into the project's .venv (or the Python given as $PYTHON). Not part of `make setup`: it
# compiles llama.cpp (~10 minutes on 2 cores); CI does not need it.
#
#   bash scripts/install_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
test -x "$PYTHON" || { echo "error: $PYTHON not found (run make setup first, or set PYTHON)" >&2; exit 2; }
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PYTHON" -m pip install --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" \
    diskcache jinja2 typing-extensions
# llama.cpp's own HF -> GGUF converter (and the gguf-py it was written with), from the same source
# distribution: the f32 peer row converts the target's folder with it (eagle_trt/peers.py)
CACHE="${EAGLE_TRT_CACHE:-$HOME/.cache/eagle_trt}/llama.cpp-$VERSION"
if [ ! -f "$CACHE/convert_hf_to_gguf.py" ]; then
    tmp="$(mktemp -d)"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
    tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' \
        '*/vendor/llama.cpp/gguf-py/*'
    mkdir -p "$CACHE.tmp" && cp -r "$tmp"/llama_cpp_python-*/vendor/llama.cpp/{convert_hf_to_gguf.py,conversion,gguf-py} "$CACHE.tmp"/
    # what the converter imports beyond this environment, kept beside it (not installed into the
    # environment: mistral-common's dependencies would move the project's pinned numpy)
    "$PYTHON" -m pip install -q --no-deps --target "$CACHE.tmp/deps" mistral-common pydantic-extra-types pycountry \
        jsonschema jsonschema-specifications referencing rpds-py attrs tiktoken sentencepiece
    rm -rf "$CACHE" && mv "$CACHE.tmp" "$CACHE" && rm -rf "$tmp"
fi
echo "llama.cpp's converter: $CACHE/convert_hf_to_gguf.py"
"$PYTHON" - <<'PY'
import llama_cpp
print(f"llama-cpp-python {llama_cpp.__version__}; system info: {llama_cpp.llama_print_system_info().decode()}")
PY
