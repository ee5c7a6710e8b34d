"""The LoRA adapter tiers (service.engine.lora_store): what the source holds, host copies under an
LRU bound, device slots held by requests; hot add, hot remove and replacement while requests run."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from service.engine.lora import LoraAdapter, read_adapter
from service.engine.lora_store import LoraStore, NoFreeSlotError, NotPreparedError, UnknownAdapterError
from tests.test_lora import CONFIG, write_adapter


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
        store.prepare(name)
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
        store.prepare(name)
    with pytest.raises(NotPreparedError, match="a is not in host memory"):
        store.acquire("a")  # evicted from host memory by c
    store.prepare("a")
    assert store.acquire("a").fill is not None
    with pytest.raises(UnknownAdapterError):
        store.prepare("nope")


def test_an_adapter_removed_while_in_use_serves_its_requests_to_the_end(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["a", "b"], slots=1)
    store.prepare("a")
    held = store.acquire("a")
    shutil.rmtree(tmp_path / "loras" / "a")
    assert store.refresh().removed == ("a",)
    assert store.names() == ["b"]
    with pytest.raises(UnknownAdapterError):
        store.acquire("a")
    store.prepare("b")
    with pytest.raises(NoFreeSlotError):
        store.acquire("b")  # the one slot still serves a's request
    store.release(held.slot)
    assert store.acquire("b").fill is not None


def test_a_replaced_adapter_is_reread_and_old_slots_drain(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["a"], slots=2)
    store.prepare("a")
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
        store.prepare("good")


def test_an_adapter_named_like_the_served_model_is_refused_once(tmp_path: Path) -> None:
    source = tmp_path / "loras"
    for seed, name in enumerate(["base-model", "sql"]):
        write_adapter(source / name, seed=seed)
    store = LoraStore(source, reader, device_slots=1, host_capacity=1, reserved=frozenset({"base-model"}))
    first = store.refresh()
    assert store.names() == ["sql"] and any("the served model's own name" in r for r in first.refused)
    assert store.refresh().refused == ()
