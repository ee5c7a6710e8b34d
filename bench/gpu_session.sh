#!/usr/bin/env bash
# The GPU measurements of bench/README.md ("CUDA"), phase by phase, on a lent GPU machine that has CUDA
# torch and triton but no network (see ../shared/gpu/README.md for what the carry folder holds).
#
#     bench/gpu_session.sh CARRY OUT PHASE...
#
# CARRY: wheels (whl/), the embedded GGUF's skeleton (skel/), a tokenizer folder (tokenizer/), llama.cpp's
# stripped sources (llama-src.tar.xz) and ../shared/gpu's tools (tools/); OUT: where results go.
# Phases, in the order a session runs them:
#   setup        install the wheels into /tmp/site; rebuild the embedded model's layout (random weights)
#   build-llama  start building llama-server with CUDA in the background (about 4.5 minutes)
#   kernels      the decode-kernel tests, natively on the GPU
#   ckpt8b       write a random Llama-3.1-8B-shape checkpoint; floor8b: its batch-1 weight-read floor
#   wait-llama   wait for the build
#   compare      ours vs llama-server (-ngl 999) on the same GGUF, streaming chat 128 in / 128 out
#   profile      engine overhead, launches and host time per decode step (the GGUF layout, and 8B)
#   ours8b       our server on the 8B checkpoint at concurrency 1 and 64
#   model PART.. reassemble the real embedded GGUF from carried parts; test-gpu: make test-gpu
# Issue 28's measurement (after setup, ckpt8b and floor8b; NIM_BENCH_COMMIT names the host's commit):
#   ours8b-28    the 8B bf16, streaming chat, input ~256 tokens, output 256, ignore_eos, c = 1, 64, 256
#   sampled-28   the same at c = 256 with temperature 0.8, top_p 0.95
#   fp8-28       the fp8 profile (quantized at load) at c = 1
#   summary28    OUT/summary.json with the issue's keys (bench/issue28_summary.py)
# Each runs under a timeout that sends SIGABRT first (PYTHONFAULTHANDLER prints every thread's stack),
# then ends the server it started.
# Every phase's output also goes to OUT/session.log, so a call stopped at its time limit still
# brings back what happened (pipe the script into nothing that a timeout kills first).
set -u
CARRY=$1 OUT=$2
shift 2
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONFAULTHANDLER=1
SMOL=/tmp/embedded.gguf CKPT=/tmp/ckpt8b LLAMA=/tmp/llama/llama.cpp/build/bin/llama-server
EMBEDDED=model_store/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
stamp() { echo "== $(date +%T) $*"; }
# ours on the 8B checkpoint, issue 28's load: SECONDS OUTFILE compare_llama-arguments...
ours28() {
  local seconds=$1 file=$2
  shift 2
  timeout -s ABRT -k 15 "$seconds" python3 bench/compare_llama.py --ours-only --ours-model "$CKPT" --ctx 1024 \
    --input-words 200 --output-len 256 --rounds 3 --log-dir "/tmp/$file" --out "$OUT/$file.json" "$@" >/dev/null
  pkill -f "entrypoint.py serve" || true
}
phase_model() { # the remaining arguments are the parts, in order
  mkdir -p "$(dirname $EMBEDDED)"
  cat "$@" >"$EMBEDDED"
  md5sum "$EMBEDDED"
}
while [ $# -gt 0 ]; do
  phase=$1
  shift
  stamp "$phase"
  case $phase in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$CARRY"/whl/*.whl
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" |
      tee -a "$OUT/device.txt"
    python3 "$CARRY/tools/gguf_skeleton.py" build "$CARRY/skel" "$SMOL"
    ;;
  build-llama)
    (setsid bash "$CARRY/tools/build_llama_server_cuda.sh" "$CARRY/llama-src.tar.xz" /tmp/llama \
      >/tmp/llama_build.out 2>&1 &)
    ;;
  wait-llama)
    for _ in $(seq 1 120); do [ -x "$LLAMA" ] && break; sleep 5; done
    tail -3 /tmp/llama_build.out
    ;;
  kernels) # the kernel alone (the engine tests in that file need the real model: test-gpu runs them)
    python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "dense or buckets" 2>&1 | tail -3 ;;
  ckpt8b) python3 "$CARRY/tools/random_checkpoint.py" 8b "$CKPT" "$CARRY/tokenizer" ;;
  floor8b) python3 "$CARRY/tools/weight_read_floor.py" "$CKPT" | tee "$OUT/floor8b.txt" ;;
  compare)
    python3 bench/compare_llama.py --gguf "$SMOL" --llama-server "$LLAMA" --llama-args "-ngl 999" \
      --concurrency 1 8 32 64 --rounds 2 --log-dir /tmp/compare --out "$OUT/compare_smol.json" >/dev/null
    ;;
  profile)
    timeout 240 python3 bench/step_profile.py --model "$SMOL" --device cuda --batch 1 --batch 8 --batch 64 \
      >"$OUT/profile_smol.json" && tail -25 "$OUT/profile_smol.json"
    [ -d "$CKPT" ] && timeout 240 python3 bench/step_profile.py --model "$CKPT" --device cuda --batch 1 --batch 64 \
      >"$OUT/profile_8b.json" && tail -25 "$OUT/profile_8b.json"
    ;;
  ours8b)
    timeout 300 python3 bench/compare_llama.py --ours-only --ours-model "$CKPT" --concurrency 1 64 --rounds 2 \
      --log-dir /tmp/ours8b --out "$OUT/ours8b.json" >/dev/null
    ;;
  ours8b-28) ours28 420 ours8b_bf16 --concurrency 1 64 256 ;;
  sampled-28) ours28 240 ours8b_sampled --concurrency 256 --temperature 0.8 --top-p 0.95 ;;
  fp8-28) NIM_MODEL_PROFILE=torch-generic-fp8-tp1-pp1-throughput ours28 240 ours8b_fp8 --concurrency 1 ;;
  summary28) python3 bench/issue28_summary.py "$OUT" "${NIM_BENCH_COMMIT:-unknown}" ;;
  model)
    parts=()
    while [ $# -gt 0 ] && [ -f "$1" ]; do parts+=("$1"); shift; done
    phase_model "${parts[@]}"
    ;;
  test-gpu) make test-gpu PYTHON=python3 2>&1 | tee "$OUT/test_gpu.log" | tail -15 ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
stamp done
