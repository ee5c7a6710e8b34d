"""The `serve` command line, with vLLM's flags: `serve [MODEL] [--flag value ...]`, as `vllm serve`
takes it, on the command line and in NIM_PASSTHROUGH_ARGS (NIM 2.x's way of passing engine flags).

Every flag is one of:
- accepted: it sets a setting of this server (`FLAGS`: the flag, the Settings field, how its value
  converts; vLLM's names for what this server can do, and this server's own `--device` and
  `--log-level`). Some accepted flags take only the values that ask for what this server does
  anyway (`--pipeline-parallel-size 1`, `--disable-log-requests`): `passes`;
- a vLLM flag this server cannot honour (`REFUSED`, service.serve_flags_refused): refused by name,
  in one line, with why;
- anything else: refused as unknown, with the closest known flag.

Read from vLLM's `vllm serve` parser: vllm/engine/arg_utils.py (`EngineArgs.add_cli_args`) as
stored at commit 99d7eb5d6a51 of vllm-project/vllm, a v0.11 tree (its deprecated guided-decoding
flags say "will be removed in v0.12.0"), and vllm/entrypoints/openai/cli_args.py (`FrontendArgs`,
`make_arg_parser`) as stored at commit 005223338608. Flag values convert as vLLM converts them:
booleans take `--x` / `--no-x` (argparse's BooleanOptionalAction), list flags take several values,
`--max-model-len` and `--max-num-batched-tokens` take `8k` / `1K` (vLLM's human-readable integers:
lowercase k/m/g decimal, uppercase binary).

What the flags set is compared with the environment by service.config_loading.load_settings: a flag and
its variable (or the same flag in NIM_PASSTHROUGH_ARGS and on the command line) given with
different values stop the start, since one of them would be silently ignored.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from service.serve_flags_refused import COMPILE_REFUSAL, REFUSED

SERVE_COMMANDS = ("serve", "nim-serve")
SECRET_FIELDS = frozenset({"api_key", "hf_token"})  # their values are never shown in messages
TRUE = frozenset({"true"})
FALSE = frozenset({"false"})


class FlagError(ValueError):
    """A serve flag this server cannot take; the message names it and says why, in one line."""


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the long name first, then short aliases (-tp)
    field: str | None  # the Settings field it sets; None: it sets nothing (only `passes` values pass)
    help: str
    kind: Literal["value", "bool", "list"] = "value"
    convert: Callable[[str], object] = str  # a value as given -> the field's value; FlagError for a bad one
    passes: frozenset[str] | None = None  # values (lowercase; "true"/"false" for booleans) that pass
    vllm: bool = True  # False: this server's own flag

    @property
    def name(self) -> str:
        return self.names[0]


def _human_int(value: str) -> int:
    """vLLM's human-readable integers: 8192, 8k (8000), 8K (8192), 1m, 1M, 1g, 1G."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value.strip())
    if match is None:
        raise FlagError(f"{value!r} is not an integer (or like 8k, 8K)")
    number, unit = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    result = float(number) * scale
    if result != int(result):
        raise FlagError(f"{value!r} is not a whole number")
    return int(result)


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise FlagError(f"{value!r} is not an integer") from None


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise FlagError(f"{value!r} is not a number") from None


def _dtype(value: str) -> str:
    names = {"half": "float16", "float": "float32"}
    return names.get(value, value)


# vLLM's --quantization methods that name a precision this server's profiles run
_QUANTIZATIONS = {"fp8": "fp8", "modelopt": "fp8", "modelopt_fp4": "nvfp4", "nvfp4": "nvfp4",
                  "int8_wo": "int8_wo", "int4_wo": "int4_wo"}  # fmt: skip


def _quantization(value: str) -> str:
    precision = _QUANTIZATIONS.get(value.lower())
    if precision is None:
        raise FlagError(
            f"quantization {value!r} is not supported: this server's profiles run fp8 (fp8, modelopt), "
            "nvfp4 (modelopt_fp4), int8_wo and int4_wo"
        )
    return precision


def _kv_cache_dtype(value: str) -> str:
    names = {"fp8": "fp8", "fp8_e4m3": "fp8"}
    if value in names:
        return names[value]
    if value in ("auto", "bfloat16", "float16", "float32", "int8"):
        return value
    raise FlagError(
        f"KV cache dtype {value!r} is not supported: auto, fp8 (fp8_e4m3), int8, bfloat16, float16, float32"
    )


def _json_object(value: str) -> str:
    """A JSON object flag (vLLM's --speculative-config): kept as its text, checked to be an object."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise FlagError(f"{value!r} is not JSON ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise FlagError(f"{value!r} is not a JSON object")
    return value


def _json_list(value: str) -> str:
    """vLLM's --allowed-origins '["a", "b"]' as this server's comma-separated list."""
    try:
        items = json.loads(value)
    except ValueError:
        raise FlagError(f"{value!r} is not a JSON list of strings") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise FlagError(f"{value!r} is not a JSON list of strings")
    return ",".join(items)


def _lora_module(value: str) -> str:
    """One --lora-modules value, `name=path` or JSON {"name", "path"[, "base_model_name"]}, as
    NIM_LORA_MODULES' name=path."""
    if "=" in value and "," not in value and not value.lstrip().startswith("{"):
        return value
    try:
        module = json.loads(value)
    except ValueError:
        raise FlagError(f"{value!r} is neither name=path nor a JSON object") from None
    if not isinstance(module, dict) or not {"name", "path"} <= module.keys():
        raise FlagError(f"{value!r} needs name and path")
    if set(module) - {"name", "path", "base_model_name"}:
        unknown = ", ".join(sorted(set(module) - {"name", "path", "base_model_name"}))
        raise FlagError(f"{value!r}: {unknown} not supported")
    return f"{module['name']}={module['path']}"


def _one(value: str) -> str:
    return value


FLAGS: tuple[Flag, ...] = (
    Flag(
        ("--model",),
        "model_name",
        "the model: hf://org/name[@revision], a hub id, a directory or a .gguf file (or positional)",
    ),
    Flag(("--served-model-name",), "served_model_name", "the name the API serves (one name)", kind="list"),
    Flag(
        ("--revision",),
        None,
        "the hub revision of MODEL (a branch, tag or commit): MODEL becomes hf://MODEL@REVISION",
    ),
    Flag(("--max-model-len",), "max_model_len", "context length", convert=_human_int),
    Flag(("--tensor-parallel-size", "-tp"), "tensor_parallel_size", "tensor-parallel ranks", convert=_int),
    Flag(
        ("--pipeline-parallel-size", "-pp"),
        None,
        "pipeline parallelism is not implemented (1 passes)",
        passes=frozenset({"1"}),
    ),
    Flag(("--max-num-seqs",), "max_num_seqs", "most requests generating at once", convert=_int),
    Flag(
        ("--max-num-batched-tokens",),
        "max_num_batched_tokens",
        "token budget of one step",
        convert=_human_int,
    ),
    Flag(
        ("--gpu-memory-utilization",),
        "kv_cache_percent",
        "share of the memory free after the weights for the KV cache (vLLM's share counts the weights too)",
        convert=_float,
    ),
    Flag(("--kv-cache-dtype",), "kv_cache_dtype", "KV cache element type", convert=_kv_cache_dtype),
    Flag(("--block-size",), "kv_block_size", "tokens per KV block (a multiple of 16)", convert=_int),
    Flag(("--dtype",), "dtype", "auto, bfloat16, float16 (half), float32 (float)", convert=_dtype),
    Flag(
        ("--quantization", "-q"),
        "quantization",
        "only profiles of this precision: fp8, modelopt (fp8), modelopt_fp4 (nvfp4)",
        convert=_quantization,
    ),
    Flag(
        ("--enable-prefix-caching",), "enable_kv_cache_reuse", "prefix caching (on by default)", kind="bool"
    ),
    Flag(("--enforce-eager",), "enforce_eager", "no CUDA graphs, no scripted decode step", kind="bool"),
    Flag(
        ("--speculative-config",),
        "speculative_config",
        "speculative decoding: vLLM's JSON (ngram, or a draft model)",
        convert=_json_object,
    ),
    Flag(("--seed",), "seed", "seed of the draws of requests that send none", convert=_int),
    Flag(("--chat-template",), "chat_template", "a chat template file, or the template itself"),
    Flag(
        ("--trust-request-chat-template",),
        "trust_request_chat_template",
        "requests may bring a chat template",
        kind="bool",
    ),
    Flag(
        ("--enable-auto-tool-choice",),
        "enable_auto_tool_choice",
        "tool_choice auto (on by default)",
        kind="bool",
    ),
    Flag(("--tool-call-parser",), "tool_call_parser", "hermes, llama3_json, mistral or pythonic"),
    Flag(("--reasoning-parser",), "reasoning_parser", "deepseek_r1 or qwen3"),
    Flag(("--guided-decoding-backend",), "guided_decoding_backend", "structured-output backend (xgrammar)"),
    Flag(("--enable-force-include-usage",), "always_include_usage", "usage in every stream", kind="bool"),
    Flag(("--api-key",), "api_key", "accepted API keys", kind="list", convert=_one),
    Flag(
        ("--lora-modules",),
        "lora_modules",
        "adapters as name=path or JSON {name, path}",
        kind="list",
        convert=_lora_module,
    ),
    Flag(
        ("--enable-lora",),
        None,
        "LoRA is served when adapters are named (NIM_PEFT_SOURCE or --lora-modules)",
        kind="bool",
        passes=TRUE,
    ),
    Flag(("--max-loras",), "max_gpu_loras", "adapters resident on the device at once", convert=_int),
    Flag(("--max-lora-rank",), "max_lora_rank", "largest adapter rank", convert=_int),
    Flag(("--max-cpu-loras",), "max_cpu_loras", "adapters kept in host memory", convert=_int),
    Flag(("--host",), "host", "address to bind"),
    Flag(("--port",), "port", "HTTP port", convert=_int),
    Flag(("--ssl-keyfile",), "ssl_key_path", "server private key (with --ssl-certfile: NIM_SSL_MODE=TLS)"),
    Flag(("--ssl-certfile",), "ssl_certs_path", "server certificate chain"),
    Flag(
        ("--ssl-ca-certs",),
        "ssl_ca_certs_path",
        "CA bundle for client certificates (with --ssl-cert-reqs 2: MTLS)",
    ),
    Flag(
        ("--ssl-cert-reqs",),
        None,
        "2 requires client certificates (NIM_SSL_MODE=MTLS); 0 none",
        passes=frozenset({"0", "2"}),
    ),
    Flag(("--allowed-origins",), "cors_allow_origins", "CORS origins, a JSON list", convert=_json_list),
    Flag(("--allowed-methods",), "cors_allow_methods", "CORS methods, a JSON list", convert=_json_list),
    Flag(
        ("--allowed-headers",), "cors_allow_headers", "CORS request headers, a JSON list", convert=_json_list
    ),
    Flag(("--download-dir",), "cache_path", "where hub downloads go (NIM_CACHE_PATH)"),
    Flag(("--hf-token",), "hf_token", "token for gated or private hub models"),
    Flag(("--disable-log-requests",), None, "prompts and outputs are never logged", kind="bool", passes=TRUE),
    Flag(("--enable-log-requests",), None, "prompts and outputs are never logged", kind="bool", passes=FALSE),
    Flag(
        ("--disable-log-stats",),
        None,
        "no periodic stats lines are logged (see /v1/metrics)",
        kind="bool",
        passes=TRUE,
    ),
    Flag(("--enable-request-id-headers",), None, "x-request-id is always sent", kind="bool", passes=TRUE),
    Flag(
        ("--enable-prompt-tokens-details",),
        None,
        "usage.prompt_tokens_details is always sent",
        kind="bool",
        passes=TRUE,
    ),
    Flag(("--max-log-len",), None, "prompts are never logged", passes=None, convert=_one),
    Flag(("--response-role",), None, "the answering role is assistant", passes=frozenset({"assistant"})),
    Flag(
        ("--load-format",),
        None,
        "weights load as their format says (safetensors or GGUF)",
        passes=frozenset({"auto", "safetensors", "gguf"}),
    ),
    Flag(("--max-logprobs",), None, "top_logprobs goes up to 20", passes=frozenset({"20"})),
    Flag(("--device",), "device", "auto, cpu or cuda", vllm=False),
    Flag(("--log-level",), "log_level", "DEFAULT, TRACE, DEBUG, INFO, WARNING, ERROR, CRITICAL", vllm=False),
)
# Flags that set no field and take any value: --revision (combined with MODEL by _finish) and
# --max-log-len (nothing is logged for it to shorten).
_ANY_VALUE = frozenset({"--revision", "--max-log-len"})

_BY_NAME: dict[str, Flag] = {name: flag for flag in FLAGS for name in flag.names}


@dataclass
class ServeFlags:
    """What a serve command line sets: Settings fields and how each was given (for messages)."""

    values: dict[str, object] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # field -> "--max-model-len 8k"
    help: bool = False
    needs_lora: str | None = None  # --enable-lora as given: adapters must be named somewhere


def parse_serve_flags(tokens: list[str], where: str = "") -> ServeFlags:
    """`serve`'s arguments (vLLM's included) as Settings fields; FlagError (one line) for a flag that
    is refused, unknown, given a bad value, or given twice with different values. `where` names
    where the tokens came from in messages ("NIM_PASSTHROUGH_ARGS")."""
    parsed = ServeFlags()
    given: dict[str, str] = {}  # flag name -> its value as given (for --revision, --ssl-cert-reqs)
    context = f"{where}: " if where else ""
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token in ("-h", "--help"):
            parsed.help = True
            continue
        if not token.startswith("-") or token == "-":
            if "model" in given:
                raise FlagError(f"{context}a second model {token!r}: serve takes one MODEL")
            given["model"] = token
            _set(parsed, "model_name", token, token, context)
            continue
        name, has_value, inline = token.partition("=")
        flag, negated = _lookup(name, context)
        if flag.kind == "bool":
            if has_value:
                raise FlagError(f"{context}{name} takes no value (use {name} or --no-{name[2:]})")
            raw = "false" if negated else "true"
            values = [raw]
        elif has_value:
            values = [inline]
        else:
            values = []
            while i < len(tokens) and not _is_flag(tokens[i]):
                values.append(tokens[i])
                i += 1
                if flag.kind != "list":
                    break
            if not values:
                raise FlagError(f"{context}{name} needs a value")
        shown = f"{flag.name} {' '.join(values)}" if flag.kind != "bool" else token
        if flag.field in SECRET_FIELDS:
            shown = f"{flag.name} <hidden>"
        if flag.name == "--enable-lora" and not negated:
            parsed.needs_lora = shown
        given[flag.name] = values[-1]
        if flag.field is None:
            for value in values:
                if flag.name not in _ANY_VALUE and (flag.passes is None or value.lower() not in flag.passes):
                    raise FlagError(f"{context}{shown}: not supported here: {flag.help}")
            continue
        try:
            if flag.kind == "bool":
                converted: object = not negated
            elif flag.kind == "list":
                items = [str(flag.convert(value)) for value in values]
                if flag.field == "served_model_name" and len(items) > 1:
                    raise FlagError("one served name only (the API serves the model under one name)")
                converted = ",".join(items)
            else:
                converted = flag.convert(values[0])
        except FlagError as exc:
            raise FlagError(f"{context}{shown}: {exc}") from None
        _set(parsed, flag.field, converted, shown, context)
    _finish(parsed, given, context)
    return parsed


def passthrough_flags(value: str | None) -> ServeFlags:
    """NIM_PASSTHROUGH_ARGS as serve flags (shell-quoted, as NIM 2.x splits it)."""
    if not value or not value.strip():
        return ServeFlags()
    try:
        tokens = shlex.split(value)
    except ValueError as exc:
        raise FlagError(f"NIM_PASSTHROUGH_ARGS: cannot split it as a shell would ({exc})") from None
    parsed = parse_serve_flags(tokens, "NIM_PASSTHROUGH_ARGS")
    if parsed.help:
        raise FlagError("NIM_PASSTHROUGH_ARGS: --help is for the command line")
    return parsed


def _set(parsed: ServeFlags, field_name: str, value: object, shown: str, context: str) -> None:
    if field_name in parsed.values and parsed.values[field_name] != value:
        raise FlagError(f"{context}{parsed.sources[field_name]} and {shown} disagree: give it once")
    parsed.values[field_name] = value
    parsed.sources[field_name] = shown


def _finish(parsed: ServeFlags, given: dict[str, str], context: str) -> None:
    """The flags that combine with others: --revision with MODEL, TLS mode from the SSL flags."""
    revision = given.get("--revision")
    if revision is not None:
        model = parsed.values.get("model_name")
        if not isinstance(model, str) or "://" in model:
            raise FlagError(
                f"{context}--revision {revision}: give MODEL as a hub id beside it (or hf://org/name@revision)"
            )
        parsed.values["model_name"] = f"hf://{model}@{revision}"
    if "ssl_key_path" in parsed.values or "ssl_certs_path" in parsed.values:
        mtls = given.get("--ssl-cert-reqs") == "2"
        if mtls and "ssl_ca_certs_path" not in parsed.values:
            raise FlagError(f"{context}--ssl-cert-reqs 2 needs --ssl-ca-certs")
        parsed.values["ssl_mode"] = "MTLS" if mtls else "TLS"
        parsed.sources["ssl_mode"] = "--ssl-keyfile/--ssl-certfile"
    elif given.get("--ssl-cert-reqs") == "2":
        raise FlagError(f"{context}--ssl-cert-reqs 2 needs --ssl-keyfile and --ssl-certfile")


def _is_flag(token: str) -> bool:
    return token.startswith("-") and token != "-" and not re.fullmatch(r"-\d+(\.\d+)?", token)


def _lookup(name: str, context: str) -> tuple[Flag, bool]:
    """The flag `name` names, and whether it is a bool flag's --no- form; FlagError otherwise."""
    flag = _BY_NAME.get(name)
    if flag is not None:
        return flag, False
    if name.startswith("--no-"):
        positive = _BY_NAME.get("--" + name[5:])
        if positive is not None and positive.kind == "bool":
            return positive, True
    refused = REFUSED.get(name) or (REFUSED.get("--" + name[5:]) if name.startswith("--no-") else None)
    if re.fullmatch(r"-O\d*", name):
        refused = COMPILE_REFUSAL
    if refused is not None:
        raise FlagError(f"{context}vLLM's {name} is not supported by this server: {refused}")
    known = [*_BY_NAME, *REFUSED]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    hint = f"did you mean {close[0]}?" if close else "see `serve --help`"
    raise FlagError(f"{context}unknown flag {name}: {hint}")


def serve_help() -> str:
    """`serve --help`: the flags this server takes."""
    lines = [
        "usage: serve [MODEL] [flags]  (vLLM's `vllm serve` flags, those this server can honour)",
        "",
        "MODEL: hf://org/name[@revision], a hub id, a model directory or a .gguf file",
        "",
    ]
    for flag in FLAGS:
        names = ", ".join(flag.names)
        shape = (
            " / --no-" + flag.name[2:]
            if flag.kind == "bool"
            else " VALUE" + (" ..." if flag.kind == "list" else "")
        )
        lines.append(f"  {names}{shape}")
        lines.append(f"      {flag.help}" + ("" if flag.field is None else f" (Settings.{flag.field})"))
    lines.append("")
    lines.append(
        "Every other vLLM flag is refused by name with why; each has a NIM_* variable (docs/configuration.md)"
    )
    return "\n".join(lines)


def markdown_table() -> str:
    """The accepted flags as docs/configuration.md renders them."""
    lines = ["| flag | sets | note |", "|---|---|---|"]
    for flag in FLAGS:
        names = ", ".join(f"`{name}`" for name in flag.names)
        if flag.kind == "bool":
            names += f" / `--no-{flag.name[2:]}`"
        if flag.field is None:
            passes = (
                "any value"
                if flag.name in _ANY_VALUE
                else ", ".join(f"`{v}`" for v in sorted(flag.passes or ()))
            )
            sets = f"nothing ({passes} passes)"
        else:
            sets = f"`{flag.field}`"
        lines.append(f"| {names} | {sets} | {flag.help} |")
    return "\n".join(lines)
