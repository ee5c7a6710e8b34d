"""Which LoRA adapters exist, which are read into host memory, and which occupy device slots.

Three tiers, each bounded:
- known: every valid adapter under NIM_PEFT_SOURCE at the last scan (`refresh`); the names
  /v1/models lists and requests may name;
- host: adapters read from disk (`load`, a blocking read meant for a worker thread, never the
  step thread), at most NIM_MAX_CPU_LORAS, least recently used first out;
- device: NIM_MAX_GPU_LORAS slots the batched LoRA term reads (service.engine.models.lora_ops);
  `acquire` places an adapter in a slot for a request (evicting the least recently used adapter
  no request holds) and `release` returns it when the request ends.

One owner reads adapters into host memory: the engine's LoRA admission
(service.engine.torch.lora_admission) calls `load` when a request of an adapter that is not in
host memory could take a slot. The API only asks whether a name is served (`names`, `prepare`).

Invariants: an adapter held by a request keeps its slot and its host copy until released; a slot
holds at most one adapter; an adapter removed from the source at a refresh disappears from `known`
at once (new requests are refused) but the requests already holding it finish with it. An adapter
whose files changed (another path, newer files, another size) is re-read at the refresh; slots
holding the old version serve their requests to the end and are never handed out again.

One bad adapter never harms the others: whatever goes wrong reading one (service.engine.lora
refuses it with an AdapterError; anything else is caught too) refuses that adapter alone, at start
as at every rescan, and is logged once per version of its files (a refusal of the scan itself,
such as a symlink leading out of the source, once while it lasts).

Adapters by name (`add`, `remove`): NIM_LORA_MODULES names adapters with their paths at start, and
vLLM's runtime API (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) adds and removes them
while serving. An added adapter is read and checked in full before it is listed, exactly as a
scanned one; the API's adds must resolve inside the source (no path outside it, no symlink leading
out). Rescans keep added adapters (re-reading them when their files change) and never bring back
one that was removed. Removing is immediate for what is new: the name leaves `names` and `prepare`
refuses it; the requests already accepted (running, or queued for a slot) finish with it, since
`acquire` and `load` still serve a removed adapter's name. Adding a name again serves it again.
"""

from __future__ import annotations

import logging
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from service.engine.config import LoraConfig
from service.engine.lora import (
    ADAPTER_NAME,
    CONFIG_FILE,
    LoraAdapter,
    read_adapter,
    scan_source,
)
from service.engine.protocol import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    UnknownAdapterError,
)
from service.model.config import ModelConfig

log = logging.getLogger(__name__)

Reader = Callable[[Path, str], LoraAdapter]  # read_adapter with the model's config and rank limit
Version = tuple[str, int, int]  # an adapter's files: where they are, last change (ns), total bytes


class NoFreeSlotError(RuntimeError):
    """Every device slot is held by a running request; the request waits for one."""


class NotPreparedError(RuntimeError):
    """The adapter is known but not in host memory (never read, or evicted since): `load` it
    (off the step thread) and acquire again."""


@dataclass(frozen=True)
class Placement:
    slot: int
    fill: LoraAdapter | None  # the weights to copy into the slot; None: already there
    version: str  # identifies the adapter's files (salts its prefix-cache blocks)


@dataclass(frozen=True)
class RefreshResult:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    refused: tuple[str, ...]  # one line each: adapters found but not servable, and why


@dataclass
class _Slot:
    name: str | None = None
    holders: int = 0
    stale: bool = False  # holds a version the source has replaced: drained, never handed out


_RESERVED: Version = ("reserved", 0, 0)  # the "version" of a directory refused for its name


def _version(path: Path) -> Version:
    """What identifies an adapter's files: where they are, when they last changed and their total
    size (a file still being copied changes size even within one timestamp tick)."""
    stats = []
    for file in sorted(path.iterdir()):
        try:
            info = file.stat()
        except OSError:  # a dangling link, or a file removed meanwhile
            continue
        if stat.S_ISREG(info.st_mode):
            stats.append(info)
    return str(path), max((i.st_mtime_ns for i in stats), default=0), sum(i.st_size for i in stats)


@dataclass
class LoraStore:
    source: Path | None  # NIM_PEFT_SOURCE; None: adapters by name only (NIM_LORA_MODULES)
    reader: Reader
    device_slots: int
    host_capacity: int
    _known: dict[str, Version] = field(default_factory=dict, init=False)  # name -> _version
    # Host copies in least-recently-used order (oldest first).
    _host: OrderedDict[str, LoraAdapter] = field(default_factory=OrderedDict, init=False)
    _slots: list[_Slot] = field(default_factory=list, init=False)
    _use_order: list[int] = field(default_factory=list, init=False)  # slot indices, least recent first
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _refused_versions: dict[str, Version] = field(default_factory=dict, init=False)
    _skipped: frozenset[str] = field(default_factory=frozenset, init=False)  # the last scan's refusals
    refresh_interval_s: float | None = None  # rescan period (start_refreshing); None: never
    reserved: frozenset[str] = frozenset()  # names requests use for other things (the base model's)
    _added: dict[str, Path] = field(default_factory=dict, init=False)  # by name: path (add)
    _removed: set[str] = field(default_factory=set, init=False)  # by name: listed no more (remove)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _refresher: threading.Thread | None = field(default=None, init=False)

    @classmethod
    def open(cls, lora: LoraConfig, model: ModelConfig, served_name: str) -> LoraStore:
        """The store for an engine's LoRA settings over `model` (the base model's name reserved),
        its source scanned once now."""
        if lora.source is None and not lora.modules:
            raise ValueError("LoRA settings without an adapter source or adapters")
        root = lora.source.resolve() if lora.source is not None else None

        def reader(path: Path, name: str) -> LoraAdapter:
            # An adapter inside the source is read as confined to it; one NIM_LORA_MODULES names
            # elsewhere, to its own directory (links leading out of it are refused either way).
            inside = root is not None and path.resolve().is_relative_to(root)
            return read_adapter(path, name, model, lora.max_rank, lora.source if inside else None)

        store = cls(
            source=lora.source,
            reader=reader,
            device_slots=lora.max_gpu_loras,
            host_capacity=lora.max_cpu_loras,
            refresh_interval_s=lora.refresh_interval_s,
            reserved=frozenset({served_name}),
        )
        for name, path in lora.modules:  # a bad one stops the start (it was asked for by name)
            store.add(name, path, within_source=False)
        result = store.refresh()
        log.info(
            "LoRA: %d adapter(s) from %s (%s); %d device slots of rank <= %d, %d kept in host memory%s",
            len(result.added) + len(lora.modules),
            lora.source if lora.source is not None else "NIM_LORA_MODULES",
            ", ".join([*result.added, *(name for name, _ in lora.modules)]) or "none yet",
            lora.max_gpu_loras,
            lora.max_rank,
            lora.max_cpu_loras,
            f", rescanned every {lora.refresh_interval_s:g} s" if lora.refresh_interval_s else "",
        )
        return store

    def __post_init__(self) -> None:
        if self.device_slots < 1 or self.host_capacity < self.device_slots:
            raise ValueError(
                f"LoRA capacity: {self.device_slots} device slots need at least 1 and at most the "
                f"{self.host_capacity} adapters host memory keeps (NIM_MAX_GPU_LORAS <= NIM_MAX_CPU_LORAS)"
            )
        self._slots = [_Slot() for _ in range(self.device_slots)]

    # --- what exists ----------------------------------------------------------------------------

    def refresh(self) -> RefreshResult:
        """Rescan the source: new adapters are read and checked now (a malformed one is refused
        with its reason and never listed), removed ones stop being known. Raises only when the
        source itself cannot be listed (OSError)."""
        found, skipped = scan_source(self.source) if self.source is not None else ({}, [])
        with self._lock:
            found.update(self._added)  # adapters by name are rescanned as the source's are
            for name in self._removed:
                found.pop(name, None)
        refused = [line for line in skipped if line not in self._skipped]  # reported once
        self._skipped = frozenset(skipped)
        refused_versions: dict[str, Version] = {}
        for name in sorted(self.reserved & found.keys()):
            del found[name]
            refused_versions[name] = _RESERVED
            if self._refused_versions.get(name) != _RESERVED:  # reported once
                refused.append(f"{name}: the served model's own name; rename the adapter's directory")
        with self._lock:
            known = dict(self._known)
        added = []
        for name, path in found.items():
            try:
                version = _version(path)
            except OSError:  # removed or unreadable since the scan: the reader says why
                version = (str(path), -1, -1)
            if known.get(name) == version:
                continue
            if self._refused_versions.get(name) == version:  # unchanged since it was refused
                refused_versions[name] = version
                continue
            try:
                adapter = self.reader(path, name)
            except Exception as exc:  # AdapterError; anything else must not stop the other adapters
                if not isinstance(exc, AdapterError):
                    log.exception("LoRA adapter %s: unexpected error reading it", name)
                refused.append(str(exc) if isinstance(exc, AdapterError) else f"adapter {name}: {exc!r}")
                refused_versions[name] = version
                continue
            with self._lock:
                if name in self._known:
                    self._retire(name)  # a new version: slots with the old one drain
                self._known[name] = version
                self._keep(adapter)
            added.append(name)
        with self._lock:
            # Gone from the source, or replaced by files that are refused (a removed name stays
            # known, unlisted, for the requests already accepted).
            removed = sorted(
                n for n in self._known if n not in self._removed and (n not in found or n in refused_versions)
            )
            for name in removed:
                self._forget(name)
            self._refused_versions = refused_versions
        for line in refused:  # each refusal is reported once, not at every rescan
            log.warning("LoRA adapter not served: %s", line)
        return RefreshResult(tuple(sorted(added)), tuple(removed), tuple(refused))

    def names(self) -> list[str]:
        with self._lock:
            return sorted(n for n in self._known if n not in self._removed)

    def path(self, name: str) -> Path | None:
        """Where a served adapter's files are (None: not served)."""
        with self._lock:
            version = self._known.get(name)
        return None if version is None else Path(version[0])

    def start_refreshing(self) -> None:
        """Rescan every `refresh_interval_s` on a thread of its own (no-op without an interval)."""
        if self.refresh_interval_s is None or self._refresher is not None:
            return
        interval = self.refresh_interval_s

        def loop() -> None:
            failing = ""  # the error the last rescan failed with: logged once while it lasts
            while not self._stop.wait(interval):
                try:
                    result = self.refresh()
                except Exception as exc:  # a transient filesystem error must not end the rescans
                    if repr(exc) != failing:
                        log.exception("LoRA source rescan failed (logged again only if the error changes)")
                        failing = repr(exc)
                    continue
                if failing:
                    log.info("LoRA source rescans succeed again")
                    failing = ""
                if result.added or result.removed:
                    log.info(
                        "LoRA adapters: added %s, removed %s",
                        ", ".join(result.added) or "none",
                        ", ".join(result.removed) or "none",
                    )

        self._stop.clear()
        self._refresher = threading.Thread(target=loop, name="lora-refresh", daemon=True)
        self._refresher.start()

    def stop_refreshing(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(5)
            self._refresher = None

    # --- host memory (off the step thread) -------------------------------------------------------

    def prepare(self, name: str) -> None:
        """Raise UnknownAdapterError (a KeyError) unless `name` is served now. Reads nothing: the
        engine reads an adapter into host memory (`load`) when one of its requests can take a
        device slot, so a request never waits on a read before it reaches the engine."""
        with self._lock:
            if name not in self._known or name in self._removed:
                raise UnknownAdapterError(name)

    # --- adapters by name (NIM_LORA_MODULES, the runtime API) -------------------------------------

    def add(self, name: str, path: Path, replace: bool = False, within_source: bool = True) -> None:
        """Serve the adapter at `path` as `name`, read and checked in full first (blocking: call it
        off the event loop). With `within_source` (the runtime API) `path` must resolve inside the
        source; a relative one is taken from it. Raises AdapterExistsError when `name` is served
        already and `replace` is not set, AdapterError (one line) for a name, path or adapter that
        cannot be served; with `replace`, the old version's requests finish with it."""
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterError(
                f"adapter name {name!r} is not valid: letters, digits, '.', '_' and '-', at most 128"
            )
        if name in self.reserved:
            raise AdapterError(f"adapter {name}: the served model's own name; choose another name")
        with self._lock:
            served = name in self._known and name not in self._removed
        if served and not replace:
            raise AdapterExistsError(name)
        directory = self._adapter_directory(name, path, within_source)
        adapter = self.reader(directory, name)
        version = _version(directory)
        with self._lock:
            if name in self._known:
                self._retire(name)  # a new version: slots with the old one drain
            self._known[name] = version
            self._added[name] = directory
            self._removed.discard(name)
            self._refused_versions.pop(name, None)
            self._keep(adapter)
        log.info("LoRA adapter %s added from %s", name, directory)

    def remove(self, name: str) -> None:
        """Stop serving `name`: unlisted and refused to new requests at once, while the requests
        already accepted finish with it; rescans do not bring it back. UnknownAdapterError when
        it is not served."""
        with self._lock:
            if name not in self._known or name in self._removed:
                raise UnknownAdapterError(name)
            self._removed.add(name)
            self._added.pop(name, None)
            for index, slot in enumerate(self._slots):
                if slot.name == name and not slot.holders:
                    self._slots[index] = _Slot()  # idle: its slot is free for others now
        log.info("LoRA adapter %s removed (requests already accepted finish with it)", name)

    def _adapter_directory(self, name: str, path: Path, within_source: bool) -> Path:
        """`path` resolved (links followed); with `within_source` it must lie inside the source."""
        if within_source and self.source is None:
            raise AdapterError(f"adapter {name}: there is no adapter source (NIM_PEFT_SOURCE) to load from")
        given = path  # as the caller named it, in messages
        if within_source and self.source is not None and not path.is_absolute():
            path = self.source / path
        try:
            resolved = path.expanduser().resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
            raise AdapterError(f"adapter {name}: {given} cannot be resolved: {exc}") from exc
        if within_source and self.source is not None:
            base = self.source.resolve()
            if not resolved.is_relative_to(base):
                raise AdapterError(
                    f"adapter {name}: {given} resolves to {resolved}, outside the adapter source {base}"
                )
        if not (resolved / CONFIG_FILE).is_file():
            raise AdapterNotFoundError(f"adapter {name}: no adapter at {given} (no {CONFIG_FILE} there)")
        return resolved

    def load(self, name: str) -> None:
        """Make sure `name` is in host memory (reads it from disk if it is not); blocking, for the
        engine's LoRA reader thread. Raises UnknownAdapterError when it is not served,
        AdapterError (with the reason) when its files went bad since it was listed (it is then no
        longer served); nothing else."""
        with self._lock:
            version = self._known.get(name)
            if version is None:
                raise UnknownAdapterError(name)
            if name in self._host:
                self._host.move_to_end(name)
                return
        path = Path(version[0])
        try:
            now: Version | None = _version(path)  # taken first: files fixed meanwhile are re-read
        except OSError:
            now = None
        try:
            adapter = self.reader(path, name)
        except Exception as exc:  # changed or removed on disk since it was listed: not served now
            if not isinstance(exc, AdapterError):
                log.exception("LoRA adapter %s: unexpected error reading it", name)
            refusal = exc if isinstance(exc, AdapterError) else AdapterError(f"adapter {name}: {exc!r}")
            log.warning("LoRA adapter %s is no longer served: %s", name, refusal)
            with self._lock:
                if self._known.get(name) == version:
                    self._forget(name)
                    if now is not None:  # the next rescan does not report these files again
                        self._refused_versions[name] = now
            raise refusal from exc
        with self._lock:
            if self._known.get(name) == version:  # not replaced or removed meanwhile
                self._keep(adapter)

    # --- device slots (the step thread) -----------------------------------------------------------

    def acquire(self, name: str) -> Placement:
        """A slot holding `name` for one more request: the slot that holds it already, else one no
        request holds. Raises UnknownAdapterError (not served), NoFreeSlotError (it is in no slot
        and every slot is held) or NotPreparedError (a slot is free but the adapter is not in host
        memory: `load` it, then acquire again), in that order: an adapter is read only when a
        slot could take it."""
        with self._lock:
            if name not in self._known:
                raise UnknownAdapterError(name)
            version = ":".join(map(str, self._known[name]))
            if name in self._host:
                self._host.move_to_end(name)
            for index, slot in enumerate(self._slots):
                if slot.name == name and not slot.stale:
                    slot.holders += 1
                    self._touch(index)
                    return Placement(index, None, version)
            index = self._free_slot()
            adapter = self._host.get(name)
            if adapter is None:
                raise NotPreparedError(f"LoRA adapter {name} is not in host memory")
            self._slots[index] = _Slot(name, 1)
            self._touch(index)
            return Placement(index, adapter, version)

    def release(self, slot_index: int) -> None:
        """A request that acquired `slot_index` ended."""
        with self._lock:
            slot = self._slots[slot_index]
            if slot.holders < 1:
                raise ValueError(f"release of LoRA slot {slot_index}, which no request holds")
            slot.holders -= 1
            if slot.holders == 0 and slot.stale:
                self._slots[slot_index] = _Slot()  # a removed or replaced version: gone now

    def running(self) -> dict[str, int]:
        """Adapters held by requests, with how many hold each (for metrics)."""
        with self._lock:
            return {s.name: s.holders for s in self._slots if s.name is not None and s.holders}

    # --- internals (under the lock) ---------------------------------------------------------------

    def _keep(self, adapter: LoraAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        held = {s.name for s in self._slots if s.holders}
        while len(self._host) > self.host_capacity:
            victim = next((n for n in self._host if n not in held and n != adapter.name), None)
            if victim is None:
                break  # everything else is in use: exceed the bound until requests end
            del self._host[victim]

    def _forget(self, name: str) -> None:
        del self._known[name]
        self._retire(name)
        self._host.pop(name, None)

    def _retire(self, name: str) -> None:
        """Slots holding `name` as it was: emptied now if idle, else drained by their requests."""
        for index, slot in enumerate(self._slots):
            if slot.name == name:
                if slot.holders:
                    slot.stale = True
                else:
                    self._slots[index] = _Slot()

    def _touch(self, index: int) -> None:
        self._use_order = [i for i in self._use_order if i != index] + [index]

    def _free_slot(self) -> int:
        for index, slot in enumerate(self._slots):
            if slot.name is None:
                return index
        for index in self._use_order:  # least recently used first
            if self._slots[index].holders == 0:
                return index
        raise NoFreeSlotError(f"all {len(self._slots)} LoRA slots are held by running requests")
