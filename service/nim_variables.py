"""Every environment variable NVIDIA's NIM for LLMs documents (1.x and 2.x), and what this server
does with it: no NIM_* setting is silently ignored.

A documented variable is one of:
- honoured: this server's setting of that name, with NIM's meaning (service.config.Settings reads it);
- an alias of ours: Settings reads it as one of its own variables (NIM_DISABLE_CUDA_GRAPH is read as
  NIM_ENFORCE_EAGER). Which variable is Settings' alias list (a field's `validation_alias` choices
  after the first), not a second table here: the rendering asks Settings;
- refused: set, it stops the start with one line naming it and what to do instead. A few take a
  value that asks for what this server does anyway (NIM_PIPELINE_PARALLEL_SIZE=1), which passes.

Any other NIM_* variable stops the start too, with the closest known name ("did you mean
NIM_MAX_MODEL_LEN?"), since a misspelt setting would otherwise be dropped without a word. The one
exception are Kubernetes service links: for every Service in a pod's namespace Kubernetes injects
`<SERVICE>_SERVICE_HOST`, `<SERVICE>_SERVICE_PORT[_<PORT NAME>]`, `<SERVICE>_PORT` (`tcp://ip:port`)
and `<SERVICE>_PORT_<N>_<PROTO>[_PROTO|_PORT|_ADDR]`, so a Service named `nim` (or `nim-llm`) gives
every pod beside it NIM_SERVICE_HOST, NIM_PORT, NIM_PORT_8000_TCP, ... A group of them is
recognised by its shape and values (the `_SERVICE_HOST` and a `_PORT` of `tcp://`, `udp://` or
`sctp://` are both there) and ignored with one log line; a lone NIM_PORT or a misspelt NIM_*_PORT
is not such a group and is refused. The chart sets `enableServiceLinks: false`, so its pods get none.

Sources (the documentation pages as stored on 2026-11, by their URL; where a page could only be read
in part, the names come from its index and the other pages listed):
- NIM for LLMs 2.x environment variables:
  https://docs.nvidia.com/nim/large-language-models/2.1.7/reference/environment-variables.md (and
  2.0.4, 2.0.9, 2.0.12, 2.1.5-pb7, 3.0.0 of the same page), with the variable indexes of 2.0.1,
  2.0.4-pb6 and 2.0.10: https://docs.nvidia.com/nim/large-language-models/2.0.10/genindex.html;
  NIM_PASSTHROUGH_ARGS and the precedence of flags:
  https://docs.nvidia.com/nim/large-language-models/2.0.0/reference/advanced-configuration.html;
  NIM_SPECDEC_ARGS: https://docs.nvidia.com/nim/large-language-models/reference/environment-variables
- NIM for LLMs 1.x configuration: https://docs.nvidia.com/nim/large-language-models/1.12.0/configuration.html
  (and 1.10.0); function calling (NIM_ENABLE_AUTO_TOOL_CHOICE, NIM_TOOL_CALL_PARSER,
  NIM_TOOL_PARSER_PLUGIN, NIM_CHAT_TEMPLATE):
  https://docs.nvidia.com/nim/large-language-models/1.11.0/function-calling.html; the variables of the
  1.15 container variants (NIM_CUSTOM_GUIDED_DECODING_BACKENDS ... NIM_SCHEDULER_POLICY):
  https://docs.nvidia.com/nim/large-language-models/1.15.0/nim-container-variants.html; KV cache
  host offload and parallel downloads:
  https://docs.nvidia.com/nim/large-language-models/1.10.0/release-notes.html
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})
PREFIX = "NIM_"


@dataclass(frozen=True)
class Refusal:
    """Why a documented variable is refused, and what to use instead, in one phrase."""

    instead: str
    accepted: frozenset[str] = frozenset()  # values (lowercase) that ask for what happens anyway


@dataclass(frozen=True)
class NimVariable:
    name: str
    documented: str  # the NIM versions whose documentation lists it: "1.x", "2.x" or "1.x, 2.x"
    refusal: Refusal | None = None  # None: Settings reads it (its own variable, or as an alias)


def _refused(instead: str, *accepted: str | frozenset[str]) -> Refusal:
    values: set[str] = set()
    for value in accepted:
        values.update([value] if isinstance(value, str) else value)
    return Refusal(instead, frozenset(values))


_ONE_NODE = "multi-node serving is not supported: one pod runs the model (tensor parallelism inside it)"
_SPECULATIVE = "set NIM_SPECULATIVE_CONFIG to vLLM's --speculative-config JSON instead"
_REWARD = "reward models are not served: this server generates text"

NIM_VARIABLES: tuple[NimVariable, ...] = (
    # --- model --------------------------------------------------------------------------------
    NimVariable("NIM_MODEL_NAME", "1.x"),
    NimVariable("NIM_MODEL_PATH", "2.x"),
    NimVariable("NIM_MODEL_PROFILE", "1.x, 2.x"),
    NimVariable("NIM_SERVED_MODEL_NAME", "1.x, 2.x"),
    NimVariable("NIM_MAX_MODEL_LEN", "1.x, 2.x"),
    NimVariable("NIM_TENSOR_PARALLEL_SIZE", "1.x, 2.x"),
    NimVariable(
        "NIM_PIPELINE_PARALLEL_SIZE",
        "1.x, 2.x",
        _refused("pipeline parallelism is not implemented: use NIM_TENSOR_PARALLEL_SIZE", "1"),
    ),
    NimVariable("NIM_NUM_COMPUTE_NODES", "2.x", _refused(_ONE_NODE, "1")),
    NimVariable("NIM_PASSTHROUGH_ARGS", "2.x"),
    NimVariable("NIM_DRAFT_MODEL_PATH", "2.x"),
    NimVariable("NIM_SPECDEC_ARGS", "2.x", _refused(_SPECULATIVE)),
    NimVariable(
        "NIM_FT_MODEL",
        "1.x",
        _refused("name the fine-tuned model's directory in NIM_MODEL_PATH (or NIM_MODEL_NAME)"),
    ),
    NimVariable(
        "NIM_CUSTOM_MODEL_NAME",
        "1.x",
        _refused(
            "no engine is built and cached under a name here: set NIM_SERVED_MODEL_NAME for the API's name"
        ),
    ),
    NimVariable(
        "NIM_TRUST_CUSTOM_CODE",
        "1.x",
        _refused("model code from a repository is never run here (only the built-in architectures)", FALSE),
    ),
    NimVariable(
        "NIM_MANIFEST_ALLOW_UNSAFE",
        "1.x",
        _refused("every profile of a model may be selected here already: unset it", TRUE),
    ),
    NimVariable(
        "NIM_REPOSITORY_OVERRIDE",
        "1.x, 2.x",
        _refused("set HF_ENDPOINT to a Hugging Face mirror, or name a local directory in NIM_MODEL_PATH"),
    ),
    NimVariable("NIM_DISABLE_MODEL_DOWNLOAD", "2.x"),
    NimVariable(
        "NIM_SDK_MAX_PARALLEL_DOWNLOAD_REQUESTS",
        "1.x",
        _refused("hub downloads run with huggingface_hub's own parallelism: unset it"),
    ),
    NimVariable(
        "NIM_CACHE_PROBE_TIMEOUT",
        "2.x",
        _refused("the cache is not probed over a network here: unset it"),
    ),
    NimVariable(
        "NIM_TOKENIZER_MODE",
        "1.x",
        _refused("the model's own fast tokenizer is always used", frozenset({"auto"})),
    ),
    NimVariable("NIM_REWARD_MODEL", "1.x", _refused(_REWARD, FALSE)),
    NimVariable("NIM_REWARD_MODEL_STRING", "1.x", _refused(_REWARD)),
    NimVariable("NIM_REWARD_LOGITS_RANGE", "1.x", _refused(_REWARD)),
    # --- memory and scheduling ------------------------------------------------------------------
    NimVariable("NIM_ENABLE_KV_CACHE_REUSE", "1.x"),
    NimVariable("NIM_KVCACHE_PERCENT", "1.x"),
    NimVariable(
        "NIM_NUM_KV_CACHE_SEQ_LENS",
        "1.x",
        _refused("cap the KV cache in tokens with NIM_KV_CACHE_MAX_TOKENS (sequences x NIM_MAX_MODEL_LEN)"),
    ),
    NimVariable(
        "NIM_RELAX_MEM_CONSTRAINTS",
        "1.x",
        _refused(
            "selection fits profiles to the memory there is: choose one with NIM_MODEL_PROFILE and "
            "size the KV cache with NIM_KV_CACHE_PERCENT or NIM_KV_CACHE_MAX_TOKENS",
            FALSE,
        ),
    ),
    NimVariable(
        "NIM_ENABLE_KV_CACHE_HOST_OFFLOAD",
        "1.x",
        _refused("the KV cache is not offloaded to host memory here", FALSE),
    ),
    NimVariable(
        "NIM_KV_CACHE_HOST_MEM_FRACTION",
        "1.x",
        _refused("the KV cache is not offloaded to host memory here"),
    ),
    NimVariable(
        "NIM_SCHEDULER_POLICY",
        "1.x",
        _refused("one queue, first come first served; no other policy is offered", frozenset({"fcfs"})),
    ),
    NimVariable(
        "NIM_DISABLE_OVERLAP_SCHEDULING",
        "1.x",
        _refused("steps are not overlapped here: unset it", TRUE),
    ),
    NimVariable("NIM_DISABLE_CUDA_GRAPH", "2.x"),
    NimVariable(
        "NIM_FORCE_DETERMINISTIC",
        "1.x",
        _refused(
            "no deterministic mode is offered: greedy and seeded requests are batch-invariant on "
            "the CPU paths already (docs/engine.md: Batch invariance), on CUDA not yet verified",
            FALSE,
        ),
    ),
    # --- LoRA -----------------------------------------------------------------------------------
    NimVariable("NIM_PEFT_SOURCE", "1.x, 2.x"),
    NimVariable("NIM_PEFT_REFRESH_INTERVAL", "1.x, 2.x"),
    NimVariable(
        "NIM_PEFT_API_TIMEOUT_SECS",
        "2.x",
        _refused(
            "adapters are read from NIM_PEFT_SOURCE on local disk: nothing is fetched that could time out"
        ),
    ),
    NimVariable("NIM_MAX_LORA_RANK", "1.x"),
    NimVariable("NIM_MAX_GPU_LORAS", "1.x"),
    NimVariable("NIM_MAX_CPU_LORAS", "1.x"),
    # --- API and output -------------------------------------------------------------------------
    NimVariable("NIM_CHAT_TEMPLATE", "1.x"),
    NimVariable("NIM_ENABLE_AUTO_TOOL_CHOICE", "1.x"),
    NimVariable("NIM_TOOL_CALL_PARSER", "1.x"),
    NimVariable(
        "NIM_TOOL_PARSER_PLUGIN",
        "1.x",
        _refused(
            "parsers are built in and never loaded from a file: set NIM_TOOL_CALL_PARSER to one of them"
        ),
    ),
    NimVariable("NIM_GUIDED_DECODING_BACKEND", "1.x"),
    NimVariable(
        "NIM_CUSTOM_GUIDED_DECODING_BACKENDS",
        "1.x",
        _refused("custom structured-output backends are never loaded: xgrammar is built in"),
    ),
    NimVariable(
        "NIM_ENABLE_PROMPT_LOGPROBS",
        "1.x",
        _refused("prompt logprobs are always available (prompt_logprobs, echo with logprobs)", TRUE),
    ),
    NimVariable(
        "NIM_PER_REQ_METRICS_ENABLE",
        "1.x",
        _refused("per-request metrics are not added to responses: see /v1/metrics", FALSE),
    ),
    # --- server ---------------------------------------------------------------------------------
    NimVariable("NIM_SERVER_PORT", "1.x, 2.x"),
    NimVariable(
        "NIM_HEALTH_PORT",
        "2.x",
        _refused("health is served on NIM_SERVER_PORT (/v1/health/live, /v1/health/ready, /health)"),
    ),
    NimVariable("NIM_CACHE_PATH", "1.x, 2.x"),
    NimVariable("NIM_LOG_LEVEL", "1.x, 2.x"),
    NimVariable("NIM_JSONL_LOGGING", "1.x, 2.x"),
    NimVariable(
        "NIM_DISABLE_LOG_REQUESTS",
        "1.x",
        _refused("prompts and outputs are never logged here", TRUE),
    ),
    NimVariable("NIM_SSL_MODE", "1.x, 2.x"),
    NimVariable("NIM_SSL_KEY_PATH", "1.x, 2.x"),
    NimVariable("NIM_SSL_CERTS_PATH", "1.x, 2.x"),
    NimVariable("NIM_SSL_CA_CERTS_PATH", "1.x, 2.x"),
    NimVariable("NIM_CORS_ALLOW_ORIGINS", "1.x, 2.x"),
    NimVariable("NIM_CORS_ALLOW_METHODS", "1.x, 2.x"),
    NimVariable("NIM_CORS_ALLOW_HEADERS", "1.x, 2.x"),
    NimVariable("NIM_CORS_EXPOSE_HEADERS", "2.x"),
    NimVariable("NIM_CORS_MAX_AGE", "2.x"),
    NimVariable(
        "NIM_MIDDLEWARE_CONFIG_PATH",
        "2.x",
        _refused("no middleware is loaded from configuration: API keys are NIM_API_KEY / NIM_API_KEYS_FILE"),
    ),
    NimVariable(
        "NIM_NGINX_DIR",
        "2.x",
        _refused("no nginx proxy runs here: the server itself listens on NIM_SERVER_PORT"),
    ),
    NimVariable(
        "NIM_SAGEMAKER_MODE",
        "2.x",
        _refused("SageMaker's /invocations is not served (its /ping is)", FALSE),
    ),
    NimVariable("NIM_CAPTURE_ENABLE", "2.x", _refused("request capture is not implemented", FALSE)),
    NimVariable("NIM_CAPTURE_ARGS", "2.x", _refused("request capture is not implemented")),
    NimVariable("NIM_ENABLE_OTEL", "1.x"),
    NimVariable("NIM_OTEL_SERVICE_NAME", "1.x"),
    NimVariable("NIM_OTEL_TRACES_EXPORTER", "1.x"),
    NimVariable("NIM_OTEL_EXPORTER_OTLP_ENDPOINT", "1.x"),
    NimVariable(
        "NIM_OTEL_METRICS_EXPORTER",
        "1.x",
        _refused(
            "metrics are scraped from /v1/metrics (Prometheus), not exported over OTLP", frozenset({"none"})
        ),
    ),
)

BY_NAME: Mapping[str, NimVariable] = {v.name: v for v in NIM_VARIABLES}

# A Kubernetes service link's suffix after <SERVICE>_ (service names upper-cased, '-' as '_'):
# SERVICE_HOST, SERVICE_PORT[_<PORT NAME>], PORT, PORT_<N>_<PROTO>[_PROTO|_PORT|_ADDR].
_LINK_SUFFIX = re.compile(
    r"SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT(?:_\d+_(?:TCP|UDP|SCTP)(?:_PROTO|_PORT|_ADDR)?)?"
)
_LINK_URL = re.compile(r"(tcp|udp|sctp)://\S+")


@dataclass
class EnvironmentCheck:
    """What the environment's NIM_* variables come to: refusals (one line each; any stops the
    start) and the Kubernetes service-link variables ignored."""

    problems: list[str] = field(default_factory=list)
    service_links: list[str] = field(default_factory=list)


def check_environment(env: Mapping[str, str], read: Mapping[str, str]) -> EnvironmentCheck:
    """Check every NIM_* variable of `env` against the documented table and `read` (each variable
    Settings reads -> the setting's own variable). Names compare as pydantic-settings reads them:
    case-insensitively."""
    upper = {name.upper(): (name, value) for name, value in env.items()}
    links = _service_links(upper)
    known = {name.upper() for name in read} | set(BY_NAME)
    check = EnvironmentCheck(service_links=sorted(upper[name][0] for name in links))
    for name in sorted(upper):
        if not name.startswith(PREFIX) or name in links:
            continue
        given, value = upper[name]
        documented = BY_NAME.get(name)
        if documented is not None and documented.refusal is not None:
            refusal = documented.refusal
            if value.strip().lower() not in refusal.accepted:
                check.problems.append(f"{given} is not supported here: {refusal.instead}")
        elif name not in known:
            check.problems.append(_unknown(given, known))
    return check


def _unknown(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name.upper(), sorted(known), n=1, cutoff=0.75)
    hint = f"did you mean {close[0]}?" if close else "see the configuration table in docs/configuration.md"
    return f"{name} is not a setting of this server: {hint} (unset it)"


def _service_links(upper: Mapping[str, tuple[str, str]]) -> set[str]:
    """The names (upper-cased) of `upper` that are Kubernetes service links: every variable of a
    service whose <SERVICE>_SERVICE_HOST and <SERVICE>_PORT=<proto>://... are both present."""
    groups: dict[str, list[str]] = {}
    for name in upper:
        for service in _link_services(name):
            groups.setdefault(service, []).append(name)
    linked: set[str] = set()
    for service, names in groups.items():
        port = upper.get(f"{service}_PORT")
        if f"{service}_SERVICE_HOST" in upper and port is not None and _LINK_URL.fullmatch(port[1].strip()):
            linked.update(names)
    return linked


def _link_services(name: str) -> list[str]:
    """Every service `name` could be a link variable of: each prefix followed by a link suffix."""
    cuts = (match.start() for match in re.finditer("_", name))
    return [name[:cut] for cut in cuts if _LINK_SUFFIX.fullmatch(name[cut + 1 :])]


def markdown_table(read: Mapping[str, str]) -> str:
    """The table as docs/configuration.md renders it: every documented variable, in NIM's versions, and what
    happens to it here (`read`: each variable Settings reads -> the setting's own variable)."""
    lines = ["| variable | NIM | here | what instead / note |", "|---|---|---|---|"]
    for variable in NIM_VARIABLES:
        refusal = variable.refusal
        if refusal is not None:
            accepted = sorted(refusal.accepted)
            here = "refused" + (f" (passes: {', '.join(f'`{v}`' for v in accepted)})" if accepted else "")
            note = refusal.instead
        elif read.get(variable.name, variable.name) == variable.name:
            here, note = "honoured", "see Configuration"
        else:
            here, note = f"alias of `{read[variable.name]}`", f"read as `{read[variable.name]}`"
        lines.append(f"| `{variable.name}` | {variable.documented} | {here} | {note} |")
    return "\n".join(lines)
