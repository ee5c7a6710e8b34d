"""The LoRA adapter tiers (service.engine.lora_store): what the source holds, host copies under an
LRU bound, device slots held by requests; hot add, hot remove and replacement while requests run."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from service.engine.config import LoraConfig
from service.engine.lora import AdapterError, LoraAdapter, read_adapter
from service.engine.lora_store import LoraStore, NoFreeSlotError, NotPreparedError
from service.engine.protocol import UnknownAdapterError
from tests.test_lora import CONFIG, lie_about_offsets, poison, truncate, write_adapter


def reader(path: Path, name: str) -> LoraAdapter:
    return read_adapter(path, name, CONFIG, max_rank=16)


def store_with(tmp_path: Path, names: list[str], slots: int = 2, host: int = 3) -> LoraStore:
    source = tmp_path / "loras"
    for seed, name in enumerate(names):
        write_adapter(source / name, seed=seed)
    store = LoraStore(source, reader, device_slots=slots, host_capacity=host)
    store.refresh()
    return store


def test_refresh_lists_servable_adapters_and_says_why_others_are_not(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["sql", "chat"])
    write_adapter(tmp_path / "loras" / "dora", seed=9, use_dora=True)
    result = store.refresh()
    assert store.names() == ["chat", "sql"]
    assert result.added == () and result.removed == ()
    assert len(result.refused) == 1 and "adapter dora: DoRA" in result.refused[0]


def test_slots_are_shared_reused_and_never_taken_from_running_requests(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["a", "b", "c"])
    for name in ("a", "b", "c"):
        store.load(name)
    first = store.acquire("a")
    assert first.fill is not None and first.fill.name == "a"
    again = store.acquire("a")
    assert again.slot == first.slot and again.fill is None  # already in its slot
    b = store.acquire("b")
    assert b.slot != first.slot
    with pytest.raises(NoFreeSlotError, match="all 2 LoRA slots are held"):
        store.acquire("c")
    store.release(b.slot)
    c = store.acquire("c")  # b's slot, idle now: refilled with c
    assert c.slot == b.slot and c.fill is not None and c.fill.name == "c"
    assert store.running() == {"a": 2, "c": 1}
    store.release(c.slot)
    with pytest.raises(ValueError, match="which no request holds"):
        store.release(c.slot)


def test_host_copies_are_bounded_least_recently_used_first(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["a", "b", "c"], slots=1, host=2)
    for name in ("a", "b", "c"):
        store.load(name)
    with pytest.raises(NotPreparedError, match="a is not in host memory"):
        store.acquire("a")  # evicted from host memory by c
    store.load("a")
    assert store.acquire("a").fill is not None
    with pytest.raises(UnknownAdapterError):
        store.load("nope")


def test_an_adapter_is_read_only_when_a_slot_could_take_it(tmp_path: Path) -> None:
    """acquire says "no slot" before "not in host memory", so the engine reads an adapter only
    when a slot is there for it; a slot that still holds an adapter evicted from host memory is
    taken again without a read. prepare (the API's) only checks the name and reads nothing."""
    store = store_with(tmp_path, ["a", "b", "c"], slots=1, host=1)
    store.prepare("b")
    with pytest.raises(UnknownAdapterError):
        store.prepare("nope")
    store.load("a")
    held = store.acquire("a")
    with pytest.raises(NoFreeSlotError):
        store.acquire("b")  # never read: the one slot is held
    store.load("c")  # a stays (held); host memory holds two until a's request ends
    store.release(held.slot)
    store.load("b")  # evicts a from host memory, a's slot still holds it
    again = store.acquire("a")
    assert again.slot == held.slot and again.fill is None
    store.release(again.slot)
    with pytest.raises(NotPreparedError):
        store.acquire("c")  # evicted by b: the slot is free, the adapter must be read first


def test_an_adapter_removed_while_in_use_serves_its_requests_to_the_end(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["a", "b"], slots=1)
    store.load("a")
    held = store.acquire("a")
    shutil.rmtree(tmp_path / "loras" / "a")
    assert store.refresh().removed == ("a",)
    assert store.names() == ["b"]
    with pytest.raises(UnknownAdapterError):
        store.acquire("a")
    store.load("b")
    with pytest.raises(NoFreeSlotError):
        store.acquire("b")  # the one slot still serves a's request
    store.release(held.slot)
    assert store.acquire("b").fill is not None


def test_a_replaced_adapter_is_reread_and_old_slots_drain(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["a"], slots=2)
    store.load("a")
    old = store.acquire("a")
    assert old.fill is not None
    before = old.fill.modules[(0, "q_proj")].a.clone()
    time.sleep(0.01)
    directory = write_adapter(tmp_path / "loras" / "a", seed=42)  # new weights in place
    later = time.time() + 5
    for file in directory.iterdir():
        os.utime(file, (later, later))
    assert store.refresh().added == ("a",)
    new = store.acquire("a")
    assert new.slot != old.slot and new.fill is not None
    assert not new.fill.modules[(0, "q_proj")].a.equal(before)
    store.release(old.slot)  # the old version's last request: its slot empties
    assert store.running() == {"a": 1}


def test_capacities_must_nest() -> None:
    with pytest.raises(ValueError, match="NIM_MAX_GPU_LORAS <= NIM_MAX_CPU_LORAS"):
        LoraStore(Path("."), reader, device_slots=4, host_capacity=2)


def test_a_refused_adapter_is_reported_once_and_a_broken_replacement_stops_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_with(tmp_path, ["good"], slots=1, host=2)
    (tmp_path / "loras" / "broken").mkdir()
    (tmp_path / "loras" / "broken" / "adapter_config.json").write_text("{")
    with caplog.at_level("WARNING"):
        first, again = store.refresh(), store.refresh()
    assert any("broken" in line for line in first.refused) and again.refused == ()
    assert sum("adapter broken" in r.message for r in caplog.records) == 1
    # "good" replaced by files that fail the checks: it stops being served at the next rescan.
    time.sleep(0.01)
    (tmp_path / "loras" / "good" / "adapter_config.json").write_text('{"r": 0, "lora_alpha": 1}')
    result = store.refresh()
    assert result.removed == ("good",) and store.names() == []
    with pytest.raises(UnknownAdapterError):
        store.load("good")


def test_an_adapter_named_like_the_served_model_is_refused_once(tmp_path: Path) -> None:
    source = tmp_path / "loras"
    for seed, name in enumerate(["base-model", "sql"]):
        write_adapter(source / name, seed=seed)
    store = LoraStore(source, reader, device_slots=1, host_capacity=1, reserved=frozenset({"base-model"}))
    first = store.refresh()
    assert store.names() == ["sql"] and any("the served model's own name" in r for r in first.refused)
    assert store.refresh().refused == ()


def test_bad_adapters_are_refused_alone_and_the_rescans_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NaN weights, a NaN or infinite lora_alpha, a rank_pattern that is no regex, a half-copied
    file, a header lying about its offsets, and a reader failing in a way nobody foresaw: each is
    refused with its name, once; the good adapters serve, later ones still appear and removed ones
    still disappear."""
    source = tmp_path / "loras"
    write_adapter(source / "good", seed=1)
    poison(write_adapter(source / "nan-weights", seed=2))
    (source / "nan-alpha").mkdir()
    write_adapter(source / "nan-alpha", seed=3, alpha=float("nan"))
    write_adapter(source / "inf-alpha", seed=3, alpha=float("inf"))
    write_adapter(source / "bad-regex", seed=4, rank_pattern={"layers.(0": 8})
    truncate(write_adapter(source / "half-copied", seed=5))
    lie_about_offsets(write_adapter(source / "liar", seed=6))
    write_adapter(source / "surprise", seed=7)

    def fragile_reader(path: Path, name: str) -> LoraAdapter:
        if name == "surprise":
            raise RuntimeError("a reader bug")
        return reader(path, name)

    store = LoraStore(source, fragile_reader, device_slots=1, host_capacity=2)
    with caplog.at_level("WARNING"):
        first = store.refresh()
        assert store.names() == ["good"] and first.added == ("good",)
        bad = ["nan-weights", "nan-alpha", "inf-alpha", "bad-regex", "half-copied", "liar", "surprise"]
        for name in bad:
            assert sum(line.startswith(f"adapter {name}: ") for line in first.refused) == 1, (
                name,
                first.refused,
            )
        assert any(
            "bad-regex: rank_pattern key 'layers.(0' is not a valid regular" in r for r in first.refused
        )
        assert any("nan-weights: layer 0 " in r and "NaN" in r for r in first.refused)
        write_adapter(source / "later", seed=8)
        shutil.rmtree(source / "good")
        second = store.refresh()
        assert second.added == ("later",) and second.removed == ("good",) and second.refused == ()
        assert store.names() == ["later"]
        assert store.refresh().refused == ()
    for name in bad:
        assert (
            sum(f"adapter {name}: " in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
            == 1
        )
    # Repaired in place: served at the next rescan.
    write_adapter(source / "half-copied", seed=5)
    assert store.refresh().added == ("half-copied",)


def test_links_out_of_the_source_are_refused_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "loras"
    write_adapter(source / "good", seed=1)
    outside = write_adapter(tmp_path / "elsewhere", seed=2)
    os.symlink(outside, source / "linked-dir")
    for name, file in (
        ("linked-config", "adapter_config.json"),
        ("linked-weights", "adapter_model.safetensors"),
    ):
        write_adapter(source / name, seed=3)
        (source / name / file).unlink()
        os.symlink(outside / file, source / name / file)
    with caplog.at_level("WARNING"):
        store = LoraStore.open(LoraConfig(source, 16, 1, 1), CONFIG, "base")  # refused at start
        for _ in range(2):
            store.refresh()
    assert store.names() == ["good"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 3, warnings
    assert sum("linked-dir: resolves to" in w for w in warnings) == 1
    assert sum("adapter linked-config: adapter_config.json resolves to" in w for w in warnings) == 1
    assert sum("adapter linked-weights: adapter_model.safetensors resolves to" in w for w in warnings) == 1


def test_an_adapter_whose_files_went_bad_after_leaving_host_memory_is_no_longer_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """load raises AdapterError with the reason, never the safetensors library's own error, for
    files damaged after the adapter was listed; then the adapter is unknown, and the next rescan
    does not report the same files again."""
    store = store_with(tmp_path, ["a", "b", "c"], slots=1, host=1)
    for name in ("a", "c", "b"):
        store.load(name)  # one host place: only b stays
    truncate(tmp_path / "loras" / "a")
    (tmp_path / "loras" / "c" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": NaN}')
    with caplog.at_level("WARNING"):
        with pytest.raises(AdapterError, match=r"adapter a: adapter_model\.safetensors is .* truncated"):
            store.load("a")
        with pytest.raises(AdapterError, match=r"adapter c: .* positive lora_alpha .*, has nan"):
            store.load("c")
        assert store.names() == ["b"]
        for name in ("a", "c"):
            with pytest.raises(UnknownAdapterError, match=f"^adapter {name} is not served"):
                store.load(name)
        assert store.refresh().refused == ()
    assert sum("adapter a:" in r.getMessage() for r in caplog.records) == 1


def test_a_failing_source_is_logged_once_while_it_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_with(tmp_path, ["a"])
    store.refresh_interval_s = 0.02
    source = tmp_path / "loras"
    source.rename(tmp_path / "moved")  # the source itself cannot be listed: every rescan fails
    with caplog.at_level("INFO"):
        store.start_refreshing()
        try:
            time.sleep(0.3)
            (tmp_path / "moved").rename(source)
            deadline = time.monotonic() + 5
            while not any("succeed again" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline
                time.sleep(0.02)
        finally:
            store.stop_refreshing()
    assert sum("rescan failed" in r.getMessage() for r in caplog.records) == 1
    assert store.names() == ["a"]
