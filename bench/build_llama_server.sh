#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from source, for bench/compare_llama.py (same GGUF, same client).
#
# The llama-cpp-python sdist on PyPI vendors llama.cpp (vendor/llama.cpp); this script downloads that sdist
# with pip, unpacks it and builds only the llama-server target with cmake, then prints the binary's path on
# the last line of stdout (progress goes to stderr, the compiler's output to build-*.log).
#
#     bench/build_llama_server.sh                    # CPU build (Release, GGML_NATIVE, nice -n 19, -j2)
#     GGML_CUDA=1 bench/build_llama_server.sh        # CUDA build (-DGGML_CUDA=ON), in its own build dir
#     LLAMA=$(bench/build_llama_server.sh | tail -1)
#
# Idempotent: an existing binary, sdist or unpacked tree is reused; re-running after a finished build
# prints the path at once. About 10-15 minutes on a 2-core machine for the CPU build.
#
# Environment:
#   LLAMA_BUILD_DIR     work directory (default ~/.cache/nim-bench/llama)
#   LLAMA_CPP_PYTHON    llama-cpp-python version to take llama.cpp from (default 0.3.36)
#   LLAMA_SDIST         an already downloaded sdist (.tar.gz) or a stripped llama.cpp tree (.tar.xz, as
#                       /work/shared/gpu/build_llama_server_cuda.sh takes), for machines without the index
#   PYTHON              interpreter whose pip downloads the sdist (default python3)
#   JOBS                parallel compile jobs (default 2; JOBS=$(nproc) on a dedicated GPU machine)
#   GGML_AMX=OFF        CPU build without ggml's AMX kernels on an AMX host (-mno-amx-*, build dir suffix
#                       -noamx): on the 2026-11-29 AMX host here they fault at their first `ldtilecfg`
#                       (the 0.3.36 server exits with SIGSEGV while loading), so compare with this build
#   GGML_CUDA=1         CUDA build; CUDA_ARCHS (default 90a, Hopper) and GGML_CUDA_FA (default OFF: leaving
#                       out the FlashAttention kernels halves the build) as in /work/shared/gpu's
#                       build_llama_server_cuda.sh
# Nothing is fetched at configure or build time: LLAMA_CURL / LLAMA_OPENSSL are off (the server then loads
# local files only), and tests and examples are not configured.
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
WORK=${LLAMA_BUILD_DIR:-$HOME/.cache/nim-bench/llama}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}
log() { echo "[build_llama_server] $*" >&2; }

if [ "${GGML_CUDA:-0}" = "1" ] || [ "${GGML_CUDA:-}" = "ON" ]; then
  FLAVOUR=cuda
  BACKEND_FLAGS=(-DGGML_CUDA=ON "-DGGML_CUDA_FA=${GGML_CUDA_FA:-OFF}"
    "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90a}")
else
  FLAVOUR=cpu
  BACKEND_FLAGS=(-DGGML_CUDA=OFF)
  case "${GGML_AMX:-}" in
    "" | ON | OFF) ;;
    *) log "GGML_AMX=$GGML_AMX: only OFF (or ON, the default) is understood"; exit 2 ;;
  esac
  if [ "${GGML_AMX:-}" = "OFF" ]; then  # explicit -mno-* flags win over -march=native's in GCC
    FLAVOUR=cpu-noamx
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    BACKEND_FLAGS+=("-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
  fi
fi

SRC_PARENT="$WORK/src-$VERSION"
BUILD="$WORK/build-$VERSION-$FLAVOUR"
BIN="$BUILD/bin/llama-server"
LOG="$WORK/build-$VERSION-$FLAVOUR.log"

if [ -x "$BIN" ]; then
  log "already built"
  echo "$BIN"
  exit 0
fi
mkdir -p "$WORK"

# 1. The sdist.
SDIST=${LLAMA_SDIST:-}
if [ -z "$SDIST" ]; then
  SDIST=$(find "$WORK" -maxdepth 1 -name "llama_cpp_python-$VERSION.tar.gz" | head -1)
fi
if [ -z "$SDIST" ]; then
  log "downloading llama-cpp-python==$VERSION (sdist)"
  "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$WORK" \
    "llama-cpp-python==$VERSION" >&2
  SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
fi
[ -f "$SDIST" ] || { log "no sdist at $SDIST"; exit 1; }

# 2. Unpack once (into a temporary directory, renamed when complete, so an interrupted run starts over).
if [ ! -d "$SRC_PARENT" ]; then
  log "unpacking $SDIST"
  rm -rf "$SRC_PARENT.tmp"
  mkdir -p "$SRC_PARENT.tmp"
  tar xf "$SDIST" -C "$SRC_PARENT.tmp"   # .tar.gz from pip, or a stripped .tar.xz
  mv "$SRC_PARENT.tmp" "$SRC_PARENT"
fi

# 3. Find the vendored llama.cpp (usually <sdist>/vendor/llama.cpp): the directory with the top-level
# CMakeLists.txt next to ggml/ and the server's sources (tools/server in recent trees, examples/server before).
SRC=""
for candidate in "$SRC_PARENT"/*/vendor/llama.cpp $(find "$SRC_PARENT" -maxdepth 4 -type d -name llama.cpp); do
  if [ -f "$candidate/CMakeLists.txt" ] && [ -d "$candidate/ggml" ] &&
    { [ -d "$candidate/tools/server" ] || [ -d "$candidate/examples/server" ]; }; then
    SRC=$candidate
    break
  fi
done
[ -n "$SRC" ] || { log "no vendored llama.cpp with a server found under $SRC_PARENT"; exit 1; }
log "llama.cpp sources: $SRC"

# 4. Configure and build only llama-server.
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  log "configuring ($FLAVOUR) into $BUILD, log in $LOG"
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "${BACKEND_FLAGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >"$LOG" 2>&1 ||
    { tail -30 "$LOG" >&2; rm -f "$BUILD/CMakeCache.txt"; exit 1; }
fi
log "building llama-server and llama-quantize with -j$JOBS (nice -n 19), log in $LOG"
started=$(date +%s)
# llama-quantize (one more source file): bench/arch_checkpoints.py --quantize makes Q4_1 GGUFs with it.
nice -n 19 cmake --build "$BUILD" --target llama-server llama-quantize -j "$JOBS" >>"$LOG" 2>&1 ||
  { tail -30 "$LOG" >&2; exit 1; }
log "built in $(($(date +%s) - started)) s"
[ -x "$BIN" ] || { log "build finished but $BIN is missing"; exit 1; }
echo "$BIN"
