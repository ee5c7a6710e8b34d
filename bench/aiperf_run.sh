#!/usr/bin/env bash
# Runs NVIDIA's aiperf (PyPI `aiperf`, the OpenAI-endpoint benchmark client) against a running server of ours:
# the same load as bench/compare_llama.py (streaming chat, 128 input / 128 output tokens, ignore_eos), with
# NVIDIA's own client recording TTFT, ITL and output tokens/s.
#
#     .venv/bin/python entrypoint.py serve --host 127.0.0.1 --port 8101 &      # a server of ours, ready
#     bench/aiperf_run.sh --url http://127.0.0.1:8101 --concurrency "1 8"
#
# Options (all optional):
#   --url URL            server (default http://127.0.0.1:8000)
#   --model NAME         served model name (default: the first one GET /v1/models lists)
#   --gguf FILE          GGUF the server serves, for the tokenizer (default: the embedded model)
#   --concurrency "N.."  concurrencies, one aiperf run each (default "1 8")
#   --requests N         requests per run (default: max(8, 2 x concurrency), as compare_llama.py)
#   --isl N / --osl N    input / output tokens (default 128 / 128)
#   --out DIR            output folder (default ~/.cache/nim-bench/aiperf-results/<date-time>)
#
# aiperf is installed (pinned, AIPERF_VERSION, default 0.13.0) into its own virtualenv under
# ${AIPERF_CACHE:-~/.cache/nim-bench}/aiperf-venv, never into the project's .venv. aiperf needs a local
# tokenizer directory: one is written next to it from the GGUF with the project's own tokenizer code
# (tokenizer.json from service.text.tokenizer's backend, tokenizer_config.json with the chat template and special
# tokens). Token counts come from the server's usage (--use-server-token-count): with ignore_eos the model
# may emit special tokens, which the streamed text leaves out. aiperf is a multi-process client; on a 2-core
# machine it takes CPU from the server, so it is run with one worker and one record processor, at the lowest
# CPU priority (nice $AIPERF_NICE, default 19): at normal priority it starved a server sharing its two cores
# (15 tok/s and a 66 ms inter-token latency at concurrency 1, where httpx-based bench/http_load.py measured
# 52 tok/s and 17 ms; at nice 19 aiperf measured 50 tok/s and 18 ms).
#
# Output folder: c<N>/ holds aiperf's artifacts and console log for each concurrency; summary-c<N>.json and
# .csv are copies of aiperf's summary (profile_export_aiperf.*), and summary.txt one line per concurrency.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${AIPERF_CACHE:-$HOME/.cache/nim-bench}
AIPERF_VERSION=${AIPERF_VERSION:-0.13.0}
VENV="$CACHE/aiperf-venv"
PROJECT_PY="$REPO/.venv/bin/python"
URL=http://127.0.0.1:8000
MODEL=""
GGUF=""
CONCURRENCY="1 8"
REQUESTS=""
ISL=128
OSL=128
OUT="$CACHE/aiperf-results/$(date +%Y%m%d-%H%M%S)"

while [ $# -gt 0 ]; do
  case $1 in
    --url) URL=${2%/}; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --gguf) GGUF=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --isl) ISL=$2; shift 2 ;;
    --osl) OSL=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
log() { echo "[aiperf_run] $*" >&2; }

# 1. aiperf in its own virtualenv (idempotent).
if [ ! -x "$VENV/bin/aiperf" ]; then
  log "installing aiperf==$AIPERF_VERSION into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION"
fi

# 2. The tokenizer directory, written once per GGUF file.
[ -n "$GGUF" ] || GGUF=$(cd "$REPO" && "$PROJECT_PY" -m service.store.model_store embedded-path | tail -1)
TOKENIZER="$CACHE/tokenizers/$(basename "$GGUF" .gguf)"
if [ ! -f "$TOKENIZER/tokenizer_config.json" ]; then
  log "writing tokenizer for $GGUF into $TOKENIZER"
  mkdir -p "$TOKENIZER"
  (cd "$REPO" && "$PROJECT_PY" - "$GGUF" "$TOKENIZER" <<'EOF'
import json
import sys
from pathlib import Path

from service.text.tokenizer import Tokenizer

gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = Tokenizer.from_gguf(gguf)
tok.backend.save(str(out / "tokenizer.json"))
config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "clean_up_tokenization_spaces": False,
    **tok.template_tokens,
}
if tok.chat_template:
    config["chat_template"] = tok.chat_template
(out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
EOF
  )
fi

# 3. One aiperf run per concurrency.
[ -n "$MODEL" ] || MODEL=$("$VENV/bin/python" -c \
  "import json, sys, urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1]))['data'][0]['id'])" \
  "$URL/v1/models")
mkdir -p "$OUT"
log "server $URL, model $MODEL, output in $OUT"
for C in $CONCURRENCY; do
  N=${REQUESTS:-$((C * 2 > 8 ? C * 2 : 8))}
  DIR="$OUT/c$C"
  mkdir -p "$DIR"
  CMD=(nice -n "${AIPERF_NICE:-19}" "$VENV/bin/aiperf" profile -m "$MODEL" --url "$URL" --endpoint-type chat --streaming
    --tokenizer "$TOKENIZER" --concurrency "$C" --request-count "$N" --warmup-request-count 2
    --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0
    --output-tokens-mean "$OSL" --output-tokens-stddev 0
    --extra-inputs ignore_eos:true --extra-inputs temperature:0 --use-server-token-count
    --workers-max 1 --record-processors 1 --random-seed 0 --ui-type none --artifact-dir "$DIR")
  log "concurrency $C, $N requests: ${CMD[*]}"
  printf '%q ' "${CMD[@]}" >"$DIR/command.txt"
  "${CMD[@]}" 2>&1 | tee "$DIR/console.log"
  for EXT in json csv; do
    # The top-level export is the profiling phase's (phases/warmup/ holds the warmup's own).
    for SUMMARY in "$DIR/profile_export_aiperf.$EXT" "$DIR/phases/profiling/profile_export_aiperf.$EXT"; do
      [ -f "$SUMMARY" ] && { cp "$SUMMARY" "$OUT/summary-c$C.$EXT"; break; }
    done
  done
  [ -f "$OUT/summary-c$C.json" ] || { log "no summary written for concurrency $C (see $DIR/console.log)"; exit 1; }
done

# 4. One line per concurrency from aiperf's JSON summaries.
"$VENV/bin/python" - "$OUT" $CONCURRENCY <<'EOF' | tee "$OUT/summary.txt"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
for c in sys.argv[2:]:
    data = json.loads((out / f"summary-c{c}.json").read_text())
    metrics = data.get("records", data)

    def stat(name: str, key: str) -> float:
        value = metrics.get(name) or {}
        return float(value.get(key, float("nan"))) if isinstance(value, dict) else float("nan")

    print(
        f"concurrency {c}: output tok/s {stat('output_token_throughput', 'avg'):.1f}, "
        f"requests/s {stat('request_throughput', 'avg'):.2f}, "
        f"TTFT p50/p99 {stat('time_to_first_token', 'p50'):.0f}/{stat('time_to_first_token', 'p99'):.0f} ms, "
        f"ITL p50/p99 {stat('inter_token_latency', 'p50'):.1f}/{stat('inter_token_latency', 'p99'):.1f} ms, "
        f"output tokens/request avg {stat('output_sequence_length', 'avg'):.1f}, "
        f"input tokens/request avg {stat('input_sequence_length', 'avg'):.1f}"
    )
EOF
