"""The utility commands: detect, list-model-profiles, download-to-cache, create-model-store, health."""

from __future__ import annotations

import json
import shutil
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

from service.config import Settings
from service.selection.manifests import Profile, ProfileError
from service.selection.planning import assess_profiles, current_system, fetch_profile, make_plan, manifest_for
from service.selection.profiles import Verdict
from service.selection.system_info import describe
from service.store.model_download import DownloadError
from service.store.model_store import STORE_DESCRIPTOR, ModelNotFoundError


class CommandError(RuntimeError):
    """A command could not do what was asked; the message says why in one line."""


def detect(settings: Settings) -> None:
    print(json.dumps(current_system(settings).to_dict(), indent=2))


def list_model_profiles(settings: Settings, explain: bool = False) -> None:
    system = current_system(settings)
    print(describe(system))
    try:
        manifest, verdicts = assess_profiles(settings, system)
    except (ModelNotFoundError, FileNotFoundError, DownloadError, ProfileError) as exc:
        raise CommandError(str(exc)) from None
    try:
        plan = make_plan(settings)
        selected, why = plan.profile.id, plan.selection.explanation[0]
        # notes beside the choice (a profile skipped for its engine); not the per-profile table
        notes = [line for line in plan.selection.explanation[1:] if not line.startswith(" ")]
    except ProfileError as exc:
        selected, why, notes = None, f"no profile selected: {exc}", []
    print(f"MODEL PROFILES ({manifest.model})")
    groups = [
        ("Compatible with system and runnable:", [v for v in verdicts if v.status == "compatible"]),
        ("Compatible with system but low memory:", [v for v in verdicts if v.status == "low_memory"]),
        ("Incompatible with system:", [v for v in verdicts if v.status == "incompatible"]),
    ]
    for title, members in groups:
        print(f"- {title}")
        plain = [v for v in members if not v.profile.feat_lora]
        lora = [v for v in members if v.profile.feat_lora]
        for verdict in plain:
            print(_line(verdict, selected, "  "))
        if lora:
            print("  - With LoRA support:")
            for verdict in lora:
                print(_line(verdict, selected, "    "))
        if not members:
            print("  (none)")
    if explain:
        print("SELECTION")
        print(f"- {why}")
        for note in notes:
            print(f"- {note}")
        print("- ranking: native precision over emulated, TensorRT-LLM over torch, built for this GPU over")
        print("  generic, lower precision first (a torch precision whose CUDA kernels have not been measured")
        print("  on a GPU ranks below the float ones; on a CPU without bf16 instructions bf16 and int last),")
        order = "smallest" if settings.profile_type == "throughput" else "largest"
        print(f"  {settings.profile_type} profiles first, then the {order} tp")
        if system.gpus:
            print("- tensor parallelism: a tp=N profile runs on GPUs 0..N-1 when each has room for its")
            print("  shard; NIM_TENSOR_PARALLEL_SIZE=N also runs the tp=1 torch profiles sharded over N GPUs")
        else:
            print("- tensor parallelism on the CPU runs only when NIM_TENSOR_PARALLEL_SIZE=N asks for it:")
            print("  the tp=1 torch profiles, sharded over N processes that share this host's cores")


def _line(verdict: Verdict, selected: str | None, indent: str) -> str:
    marker = " (selected)" if verdict.profile.id == selected else ""
    detail = "" if verdict.status == "compatible" else f" [{verdict.summary()}]"
    if verdict.status != "incompatible" and verdict.mode == "emulated":
        detail = f" [emulated: {verdict.mode_note.removeprefix('emulated ')}]{detail}"
    return f"{indent}- {verdict.profile.id} ({verdict.profile.name}){marker}{detail}"


def _profiles(settings: Settings, wanted: list[str], everything: bool) -> list[Profile]:
    try:
        manifest = manifest_for(settings)
        if everything:
            return list(manifest.profiles)
        if not wanted:
            return [make_plan(settings).profile]
    except (ProfileError, ModelNotFoundError, FileNotFoundError, DownloadError) as exc:
        raise CommandError(str(exc)) from None
    chosen = []
    for key in wanted:
        matches = [p for p in manifest.profiles if key in (p.id, p.name)]
        if not matches:
            raise CommandError(f"{key!r} names no profile of {manifest.model}; see list-model-profiles")
        chosen.append(matches[0])
    return chosen


def download_to_cache(settings: Settings, wanted: list[str], everything: bool) -> None:
    """Fetch each profile's files into the cache, printing where they are. One that cannot be fetched
    (offline and not cached, say a tensorrt_llm profile's Hugging Face checkpoint under --all) is
    reported on stderr and the rest are still fetched; then CommandError names those that failed."""
    failed: list[str] = []
    for profile in _profiles(settings, wanted, everything):
        try:
            path = fetch_profile(profile, settings)
        except DownloadError as exc:
            print(f"error: {profile.name}: {exc}", file=sys.stderr, flush=True)
            failed.append(profile.name)
            continue
        print(f"{profile.id} ({profile.name}): {path}", flush=True)
    if failed:
        raise CommandError(
            f"{len(failed)} profile(s) not downloaded: {', '.join(failed)} (the reasons are above)"
        )


def create_model_store(settings: Settings, wanted: str, directory: Path) -> None:
    """Copy one profile's files into `directory`, with a descriptor, so that NIM_MODEL_NAME=directory
    serves it with no network and no cache."""
    (profile,) = _profiles(settings, [wanted], False)
    try:
        source = fetch_profile(profile, settings)
    except DownloadError as exc:
        raise CommandError(f"{profile.name}: {exc}") from None
    if directory.exists() and any(directory.iterdir()):
        raise CommandError(f"{directory} exists and is not empty; choose a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    if source.is_file():
        files = [source]
        shutil.copy2(source, directory / source.name)
    else:
        files = [f for f in source.iterdir() if f.is_file()]
        for file in files:
            shutil.copy2(file.resolve(), directory / file.name)  # resolve: hub caches hold symlinks
    descriptor = {
        "model": profile.model,
        "profile_id": profile.id,
        "profile_name": profile.name,
        "profile": profile.tags(),
        "weights_gb": profile.weights_gb,
        "source": {"repo": profile.source.repo, "revision": profile.source.revision},
        "files": sorted(f.name for f in files),
    }
    (directory / STORE_DESCRIPTOR).write_text(json.dumps(descriptor, indent=2) + "\n")
    print(f"created {directory} with {profile.name} ({profile.id}); serve it with NIM_MODEL_NAME={directory}")


def health(settings: Settings, timeout: float) -> int:
    """Ask the server on this host whether it is ready: 0 if so, else 1 (the image's HEALTHCHECK).

    With TLS the certificate is not verified (this is the server checking on itself over loopback);
    with mutual TLS the server's own certificate is presented, which works when it chains to the
    CA the server trusts for clients."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    scheme = "http" if settings.ssl_mode == "DISABLED" else "https"
    context = None
    if scheme == "https":
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if settings.ssl_mode == "MTLS":
            context.load_cert_chain(str(settings.ssl_certs_path), str(settings.ssl_key_path))
    bare = host.strip("[]")
    url = f"{scheme}://{f'[{bare}]' if ':' in bare else bare}:{settings.port}/v1/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            print(f"ready ({response.status})")
            return 0
    except urllib.error.HTTPError as exc:
        print(f"not ready ({exc.code}): {exc.read(512).decode(errors='replace')}")
    except (OSError, ssl.SSLError) as exc:
        print(f"not answering at {url}: {exc}")
    return 1
