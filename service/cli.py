"""Command line, with NIM's command names: `serve` (the default; `nim-serve` too, as NIM 2.x names
it), `list-model-profiles`, `download-to-cache`, `create-model-store`, plus `detect`, `health`, and
the NVIDIA Dynamo roles `dynamo-worker` and `dynamo-router` (service.dynamo). NIM's short flags work
too: `download-to-cache -p ID...`, `create-model-store -p ID -m DIR`. `serve` takes vLLM's command
line (`serve MODEL --max-model-len 8192 ...`, service.serve_flags).

Parses flags, builds the one Settings object, and runs the command. entrypoint.py and the
`nim-torch` console script both land here.
"""

from __future__ import annotations

import argparse
import gc
import logging
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import uvicorn

from service.config import Settings
from service.config_loading import ConfigError, load_settings
from service.logs import configure_logging
from service.serve_flags import SERVE_COMMANDS, FlagError, parse_serve_flags, serve_help
from service.util import freeze_startup_heap

if TYPE_CHECKING:
    from service.api.app import BringUp

log = logging.getLogger("service")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nim-torch", description="NIM-style OpenAI-compatible LLM service")
    commands = parser.add_subparsers(dest="command")
    # `serve` parses its own command line (vLLM's flags: service.serve_flags); listed for --help.
    commands.add_parser(
        "serve", aliases=["nim-serve"], help="serve the model over HTTP (default); serve --help"
    )
    listing = commands.add_parser("list-model-profiles", help="show the system and which profiles can run")
    _add_model_flags(listing)
    listing.add_argument("--explain", action="store_true", help="also say why the selected profile won")
    download = commands.add_parser("download-to-cache", help="download profiles into NIM_CACHE_PATH")
    _add_model_flags(download)
    download.add_argument(
        "--profiles", "-p", nargs="+", metavar="ID", help="profile ids or names (default: the selected one)"
    )
    download.add_argument("--all", action="store_true", help="every profile of the model")
    store = commands.add_parser("create-model-store", help="write a self-contained model directory")
    _add_model_flags(store)
    store.add_argument("--profile", "-p", required=True, help="profile id or name")
    store.add_argument("--model-store", "-m", required=True, type=Path, help="directory to create")
    commands.add_parser("detect", help="print the detected system as JSON")
    # The Dynamo roles take serve's command line too; listed for --help.
    commands.add_parser(
        "dynamo-worker", help="serve the model as an NVIDIA Dynamo worker (tokens in, tokens out, KV events)"
    )
    commands.add_parser(
        "dynamo-router", help="serve the HTTP API over Dynamo workers, routed by their KV caches"
    )
    health = commands.add_parser("health", help="exit 0 if the server on this host is ready, else 1")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", dest="model_name", help="overrides NIM_MODEL_NAME")
    parser.add_argument("--max-model-len", type=int, help="overrides NIM_MAX_MODEL_LEN")


SETTINGS_FLAGS = ("model_name", "max_model_len")  # the model flags of the commands other than serve


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        build_parser().print_help()  # the commands; `serve --help` lists serve's flags
        return
    if not argv or argv[0].startswith("-"):
        argv = ["serve", *argv]  # `serve` is the default command
    if argv[0] in SERVE_COMMANDS:
        sys.exit(_serve_command(argv[1:]))
    if argv[0] in DYNAMO_COMMANDS:
        sys.exit(_serve_command(argv[1:], dynamo_role=argv[0]))
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k in SETTINGS_FLAGS}
    settings = _settings_or_exit(flags)
    from service import commands

    try:
        if args.command == "health":
            sys.exit(commands.health(settings, args.timeout))
        if args.command == "detect":
            commands.detect(settings)
        elif args.command == "list-model-profiles":
            commands.list_model_profiles(settings, explain=args.explain)
        elif args.command == "download-to-cache":
            commands.download_to_cache(settings, args.profiles or [], args.all)
        else:
            commands.create_model_store(settings, args.profile, args.model_store)
    except commands.CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


DYNAMO_COMMANDS = ("dynamo-worker", "dynamo-router")


def _serve_command(tokens: list[str], dynamo_role: str | None = None) -> int:
    """`serve [MODEL] [flags]` (or a Dynamo role's): its flags (vLLM's included) parsed, the
    settings built, served."""
    try:
        flags = parse_serve_flags(tokens)
    except FlagError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    if flags.help:
        print(serve_help())
        return 0
    settings = _settings_or_exit(flags.values, flags.sources, flags.needs_lora)
    code = serve(settings) if dynamo_role is None else serve_dynamo(dynamo_role, settings)
    # The process ends next: with its objects frozen the interpreter's shutdown skips collecting
    # them (with torch imported, ~0.9 s of every stop on 2 cores walking millions of objects whose
    # memory the OS takes back anyway). atexit handlers and module teardown still run; the engine,
    # its children and the exporters have ended already.
    gc.freeze()
    return code


def _settings_or_exit(
    flags: dict[str, object], sources: dict[str, str] | None = None, needs_lora: str | None = None
) -> Settings:
    """The settings, logging configured; exit code 2 with one line when they are refused."""
    try:
        settings = load_settings(sources=sources, needs_lora=needs_lora, **flags)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging(settings.python_log_level, settings.jsonl_logging)
    if settings.service_links:
        links = ", ".join(settings.service_links)
        log.info("ignoring Kubernetes service-link variables %s (from a Service whose name starts "
                 "with nim; enableServiceLinks: false in the pod spec drops them)", links)  # fmt: skip
    return settings


def serve_dynamo(command: str, settings: Settings) -> int:
    """A Dynamo role: refused in one line where Dynamo cannot run."""
    from service.dynamo import missing

    why = missing()
    if why is not None:
        log.error("%s needs NVIDIA Dynamo: %s", command, why)
        return 2
    if command == "dynamo-worker":
        from service.dynamo.worker import serve_worker

        return serve_worker(settings)
    from service.dynamo.routed import bring_up_router

    return serve(settings, bring_up_router(settings))


def serve(settings: Settings, bring_up: BringUp | None = None) -> int:
    """Run until stopped (the model loaded here, or `bring_up`'s); returns the process exit code
    (non-zero when the model failed). It owns its process: once the model is up the process's
    start-up heap is frozen (service.util.freeze_startup_heap)."""
    from service.api.app import create_app
    from service.selection.planning import served_name
    from service.server import DrainingServer
    from service.serving import bring_up_model

    failure: list[str] = []
    server: DrainingServer | None = None

    def on_fatal(reason: str) -> None:
        failure.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        model = bring_up if bring_up is not None else bring_up_model(settings)
        app = create_app(
            settings, served_name(settings), model, on_fatal=on_fatal, on_ready=freeze_startup_heap
        )
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return 2
    state = app.state.service
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.python_log_level.lower(),
        # asyncio's own loop, always: uvicorn's "auto" would switch to uvloop wherever it is installed
        # (NVIDIA Dynamo's runtime brings it), and the server is tested on asyncio's.
        loop="asyncio",
        timeout_graceful_shutdown=5,  # what is still open after the drain
        access_log=False,  # service.access logs each request with its id, status and time
        **tls_options(settings),
    )
    server = DrainingServer(
        config, state.begin_drain, state.busy, settings.shutdown_grace_seconds, state.stop_engine
    )
    scheme = "http" if settings.ssl_mode == "DISABLED" else "https"
    log.info(
        "listening on %s://%s:%d (NIM_SSL_MODE=%s)", scheme, settings.host, settings.port, settings.ssl_mode
    )
    server.run()
    if failure:
        log.error("exiting: %s", failure[0])
        return 1
    return 0


class TlsOptions(TypedDict, total=False):
    """The uvicorn.Config keyword arguments that `tls_options` sets."""

    ssl_keyfile: str
    ssl_certfile: str
    ssl_ca_certs: str
    ssl_cert_reqs: int


def tls_options(settings: Settings) -> TlsOptions:
    """uvicorn's TLS arguments for NIM_SSL_MODE (files were checked when Settings were built)."""
    if settings.ssl_mode == "DISABLED":
        return {}
    options: TlsOptions = {
        "ssl_keyfile": str(settings.ssl_key_path),
        "ssl_certfile": str(settings.ssl_certs_path),
    }
    if settings.ssl_mode == "MTLS":
        options["ssl_ca_certs"] = str(settings.ssl_ca_certs_path)
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options
