"""NVIDIA Dynamo: the request mapping, the KV event relay, and a real deployment on loopback.

The first part is pure Python (no Dynamo needed): every field of Dynamo's request dict is honoured
or refused (service.dynamo.requests.FIELDS), the router's requests survive the trip exactly, and
the engine's KV events reach a publisher in an order Dynamo's router accepts.

The second part starts two workers (one with its engine in a process of its own) and this
server's router with file discovery on 127.0.0.1 (skipped, with the reason, where the Dynamo
packages cannot be imported), and a KvRouter in this process that sees what the workers publish:
requests through the router's API, requests straight to each worker through Dynamo's own request
shape, the KV events against the worker's own prefix-cache hashes, and a worker killed
mid-stream (the stream ends with an error, the next request goes to the survivor).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.dynamo.cards import WorkerCard
from service.dynamo.kv_publish import KvEventRelay
from service.dynamo.requests import (
    FIELDS,
    ModelView,
    RefusedField,
    fields_table,
    from_chunk,
    from_dynamo,
    to_chunk,
    to_dynamo,
)
from service.engine.protocol import (
    EngineFeatures,
    EngineInfo,
    GenerationRequest,
    GuidedDecoding,
    KVBlocksRemoved,
    KVBlockStored,
    KVCacheCleared,
    PathChoice,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from tests.conftest import EMBEDDED_NAME, ServerProcess, free_port

REPO = Path(__file__).resolve().parent.parent
VIEW = ModelView("served", vocab_size=1000, max_model_len=4096, eos_token_ids=(2,), adapters=("ad1",))

# What Dynamo 1.6.1's KvRouter delivers besides what the caller set (seen on a worker).
DYNAMO_DEFAULTS: dict[str, Any] = {
    "model": "served",
    "eos_token_ids": [],
    "mdc_sum": None,
    "annotations": [],
    "routing": {"dp_rank": 0},
    "router_config_override": None,
}
NULL_STOP = dict.fromkeys(["max_tokens", "stop", "stop_token_ids", "stop_token_ids_visible",
                           "stop_token_ids_hidden", "min_tokens", "ignore_eos",
                           "max_thinking_tokens"])  # fmt: skip
NULL_SAMPLING = dict.fromkeys(["n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
                               "temperature", "top_p", "top_k", "min_p", "use_beam_search", "length_penalty",
                               "seed", "include_stop_str_in_output", "guided_decoding"])  # fmt: skip
NULL_OUTPUT = dict.fromkeys(["logprobs", "prompt_logprobs", "skip_special_tokens", "formatted_prompt",
                             "return_tokens_as_token_ids"])  # fmt: skip


def delivered(request: dict[str, Any]) -> dict[str, Any]:
    """`request` as a worker receives it: Dynamo's structs filled with nulls."""
    out = copy.deepcopy({**DYNAMO_DEFAULTS, **{k: v for k, v in request.items() if v is not None}})
    for key, nulls in (("stop_conditions", NULL_STOP), ("sampling_options", NULL_SAMPLING),
                       ("output_options", NULL_OUTPUT)):  # fmt: skip
        out[key] = {**nulls, **(request.get(key) or {})}
    return out


def random_request(rng: random.Random, i: int) -> GenerationRequest:
    guided = rng.choice([
        None,
        GuidedDecoding("json_schema", '{"type": "object"}', prefix="<tool_call>\n", suffix="</tool_call>"),
        GuidedDecoding("json_object"),
        GuidedDecoding("regex", "[a-z]+", start_after=(7, 8)),
        GuidedDecoding("choice", '["yes", "no"]'),
        GuidedDecoding("grammar", 'root ::= "a"'),
    ])  # fmt: skip
    sampling = SamplingParams(
        max_tokens=rng.randint(1, 64),
        temperature=rng.choice([0.0, 0.7, 1.3]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]),
        min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.1]),
        presence_penalty=rng.choice([0.0, 0.3]),
        frequency_penalty=rng.choice([0.0, -0.2]),
        logit_bias=rng.choice([{}, {5: 1.5, 9: -100.0}]),
        seed=rng.choice([None, 7]),
        stop=rng.choice([(), ("\n", "END")]),
        stop_token_ids=rng.choice([(), (3, 3, 4)]),
        include_stop_str_in_output=rng.random() < 0.5,
        ignore_eos=guided is None and rng.random() < 0.5,
        min_tokens=0 if guided is not None else rng.choice([0, 1]),
        logprobs=rng.choice([None, 0, 3]),
        prompt_logprobs=rng.choice([None, 2]),
        skip_special_tokens=rng.random() < 0.5,
        guided=guided,
    )
    prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
    return GenerationRequest(f"r{i}", prompt, sampling, 0.0, rng.choice([None, "ad1"]))


# ------------------------------------------------------------------------------------------------
# the request mapping


def test_router_requests_survive_the_trip_exactly() -> None:
    rng = random.Random(41)
    for i in range(200):
        request = random_request(rng, i)
        payload = to_dynamo(request)
        payload["model"] = request.adapter or "served"
        # JSON both ways, as Dynamo carries it (keys become text, tuples lists)
        wire = json.loads(json.dumps(delivered(payload)))
        assert from_dynamo(wire, request.request_id, VIEW) == request


def test_dynamo_frontend_fields_map_onto_sampling_params() -> None:
    request = delivered({
        "token_ids": [1, 2, 3],
        "stop_conditions": {"max_tokens": 5, "stop": ["four"], "stop_token_ids": [5, 6], "min_tokens": 2,
                            "stop_token_ids_hidden": [2, 7], "stop_token_ids_visible": [8]},
        "sampling_options": {"temperature": 0.30000001192092896, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                             "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                             "seed": 7, "n": 1, "include_stop_str_in_output": True,
                             "guided_decoding": {"json": {"type": "object"}, "backend": "xgrammar"}},
        "output_options": {"logprobs": 3, "prompt_logprobs": 1, "skip_special_tokens": False,
                           "return_tokens_as_token_ids": True},
        "eos_token_ids": [2, 9],
        "annotations": ["llm_metrics"],
        "mdc_sum": "26b7a6",
    })  # fmt: skip
    got = from_dynamo(request, "x", VIEW)
    assert got.prompt_token_ids == [1, 2, 3] and got.adapter is None
    s = got.sampling
    assert (s.max_tokens, s.stop, s.min_tokens, s.seed, s.top_k) == (5, ("four",), 2, 7, 20)
    assert s.stop_token_ids == (5, 6, 8, 2, 7, 9)
    assert s.temperature == pytest.approx(0.3) and s.include_stop_str_in_output
    assert (s.logprobs, s.prompt_logprobs, s.skip_special_tokens) == (3, 1, False)
    assert s.guided == GuidedDecoding("json_schema", '{"type": "object"}')
    # unset max_tokens: the rest of the context; ignore_eos drops the model's EOS from hidden ids
    bare = from_dynamo(delivered({"token_ids": [1] * 96, "stop_conditions": {"ignore_eos": True,
                       "stop_token_ids_hidden": [2, 7]}, "eos_token_ids": [2]}), "y", VIEW)  # fmt: skip
    assert bare.sampling.max_tokens == 4000 and bare.sampling.stop_token_ids == (7,)
    assert bare.sampling.ignore_eos and bare.sampling.temperature == 1.0


@pytest.mark.parametrize(
    ("guided", "expected"),
    [
        ({"regex": "[a-z]+"}, GuidedDecoding("regex", "[a-z]+")),
        ({"choice": ["yes", "no"]}, GuidedDecoding("choice", '["yes", "no"]')),
        ({"grammar": 'root ::= "a"'}, GuidedDecoding("grammar", 'root ::= "a"')),
        ({"json": '{"type": "integer"}'}, GuidedDecoding("json_schema", '{"type": "integer"}')),
    ],
)
def test_guided_decoding_kinds(guided: dict[str, Any], expected: GuidedDecoding) -> None:
    request = delivered({"token_ids": [1], "sampling_options": {"guided_decoding": guided}})
    assert from_dynamo(request, "x", VIEW).sampling.guided == expected


def _set(request: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, key = dotted.split(".")
    node = request
    for parent in parents:
        if not isinstance(node.get(parent), dict):
            node[parent] = {}
        node = node[parent]
    node[key] = value


REFUSALS: list[tuple[str, Any]] = [
    *[(f.name, {"x": 1} if "." not in f.name else 1) for f in FIELDS if f.handling == "refused"],
    ("sampling_options.n", 2),
    ("sampling_options.best_of", 3),
    ("sampling_options.use_beam_search", True),
    ("sampling_options.length_penalty", 0.5),
    ("sampling_options.guided_decoding.backend", "outlines"),
    ("output_options.formatted_prompt", True),
    ("routing.dp_rank", 1),
    ("model", "other-model"),
    ("stop_conditions.max_tokens", 5000),
    ("sampling_options.temperature", -1.0),
    ("sampling_options.top_k", "3"),
    ("token_ids", [1, 5000]),
    ("stop_conditions.stop_token_ids", [5000]),
    ("sampling_options.surprise", 1),
    ("surprise", "x"),
    ("extra_args.other", {"a": 1}),
    ("extra_args.nim.sampling", {"max_tokens": 4, "bogus": 1}),
]


@pytest.mark.parametrize(("field", "value"), REFUSALS, ids=[f"{f}={v!r}"[:60] for f, v in REFUSALS])
def test_each_refused_field_is_named(field: str, value: Any) -> None:
    request = delivered({"token_ids": [1, 2]})
    if field.startswith("sampling_options.guided_decoding."):
        request["sampling_options"]["guided_decoding"] = {"regex": "a"}
    _set(request, field, value)
    with pytest.raises(RefusedField) as refused:
        from_dynamo(request, "x", VIEW)
    # named: the field itself, or (a value out of range) its object with the field in the message
    assert refused.value.field == field or field.split(".")[-1] in str(refused.value), str(refused.value)


def test_null_means_not_sent_and_adapters_run_by_name() -> None:
    request = delivered({"token_ids": [1], "surprise": None, "prefill_result": None, "multi_modal_data": {}})
    assert from_dynamo(request, "x", VIEW).adapter is None
    assert from_dynamo({**request, "model": "ad1"}, "x", VIEW).adapter == "ad1"
    assert from_dynamo({**request, "model": ""}, "x", VIEW).adapter is None


def test_exact_parameters_exclude_dynamo_fields() -> None:
    payload = delivered({**to_dynamo(random_request(random.Random(1), 0)), "model": "served"})
    payload["sampling_options"]["temperature"] = 0.5
    with pytest.raises(RefusedField, match=r"sampling_options\.temperature: give Dynamo's fields or"):
        from_dynamo(payload, "x", VIEW)
    payload["sampling_options"]["temperature"] = None
    payload["stop_conditions"]["max_tokens"] = 999
    with pytest.raises(RefusedField, match="disagrees"):
        from_dynamo(payload, "x", VIEW)


def test_outputs_survive_the_trip() -> None:
    top = ((41, -0.1), (42, -2.0))
    entries = [TokenLogprob(42, -2.0, 2, top), TokenLogprob(9, -5.0, 3, top)]
    prompt = [5, 6, 7]
    prompt_entries = [None, TokenLogprob(6, -1.0, 1, ((6, -1.0), (3, -3.0))), TokenLogprob(7, -4.0, 3, top)]
    out = RequestOutput("r", "", [42, 9], 3, 7, True, "length", logprobs=entries,
                        prompt_logprobs=prompt_entries, num_cached_tokens=16)  # fmt: skip
    chunk = json.loads(json.dumps(to_chunk(out, lambda t: f"<{t}>", prompt)))
    assert chunk["finish_reason"] == "length" and chunk["top_logprobs"][0][0]["token"] == "<41>"
    assert chunk["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                                         "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
    back = from_chunk(chunk, prompt, top=2, prompt_top=2)
    assert back.token_ids == [42, 9] and back.finish_reason == "length" and back.num_cached_tokens == 16
    assert back.logprobs == [TokenLogprob(42, -2.0, 2, top), TokenLogprob(9, -5.0, 3, top)]
    assert back.prompt_logprobs == prompt_entries
    aborted = RequestOutput.last("r", 3, finish_reason="abort", time=0.0)
    assert from_chunk(to_chunk(aborted, str), prompt, None, None).finish_reason == "abort"


def test_worker_card_survives_json() -> None:
    paths = (PathChoice("cuda_graphs", False, "cpu", "X"),)
    features = EngineFeatures(guided_decoding=True)
    info = EngineInfo("torch", "llama", 8192, 49152, "fp32", "native", "float32", 16, 1300, "cpu", 1,
                      features, 0, 64, "float32", paths)  # fmt: skip
    card = WorkerCard("m", info, "id", "name", {"tp": 1}, ("why",), ("ad1",), 49152)
    assert WorkerCard.from_json(json.loads(json.dumps(card.to_json()))) == card


def test_docs_render_the_field_table() -> None:
    docs = (REPO / "docs" / "dynamo.md").read_text()
    start, end = "<!-- dynamo-fields:start -->\n", "<!-- dynamo-fields:end -->"
    assert docs[docs.index(start) + len(start) : docs.index(end)] == fields_table()


def test_every_setting_belongs_to_a_role_and_strays_are_named() -> None:
    from service.config import Settings
    from service.dynamo import SETTING_ROLES, unused_settings

    assert set(SETTING_ROLES) == set(Settings.model_fields)
    settings = Settings(api_key="k", num_threads=1, dynamo_namespace="x")
    assert unused_settings(settings, "engine") == ["NIM_API_KEY"]
    assert unused_settings(settings, "api") == ["NIM_NUM_THREADS"]


def test_one_dynamo_release_everywhere() -> None:
    """The pin in the extra, the Makefile's --no-deps half and the version the roles require agree."""
    from service.dynamo import DYNAMO_VERSION

    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'dynamo = ["ai-dynamo-runtime=={DYNAMO_VERSION}"]' in pyproject
    assert f"AI_DYNAMO := ai-dynamo=={DYNAMO_VERSION}" in (REPO / "Makefile").read_text()


# ------------------------------------------------------------------------------------------------
# KV events -> Dynamo's publisher


class FakePublisher:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def publish_stored(self, token_ids, num_block_tokens, block_hashes, parent_hash=None, lora_name=None):
        self.calls.append(
            ("stored", (block_hashes, parent_hash, lora_name, len(token_ids), num_block_tokens))
        )

    def publish_removed(self, block_hashes):
        self.calls.append(("removed", sorted(block_hashes)))


def stored(block: int, parent: int | None, lora: str | None = None, size: int = 4) -> KVBlockStored:
    return KVBlockStored(block, parent, tuple(range(size)), lora)


def test_relay_publishes_chains_in_runs_and_orphans_after_their_parent() -> None:
    fake = FakePublisher()
    relay = KvEventRelay(fake, block_size=4)
    relay.apply([stored(1, None), stored(2, 1), stored(3, 2, "ad1"), stored(9, 8), stored(5, 3, "ad1")])
    assert fake.calls == [
        ("stored", ([1, 2], None, None, 8, [4, 4])),
        ("stored", ([3, 5], 2, "ad1", 8, [4, 4])),
    ]
    assert 9 in relay.orphans  # its parent 8 was never stored
    fake.calls.clear()
    relay.apply([stored(8, 1), stored(7, 7 * 100), stored(6, None, size=3)])  # 6: a partial block
    assert fake.calls == [("stored", ([8, 9], 1, None, 8, [4, 4]))]
    fake.calls.clear()
    relay.apply([KVBlocksRemoved((2, 4242)), KVBlocksRemoved((700,))])
    assert fake.calls == [("removed", [2])]
    fake.calls.clear()
    relay.apply([KVCacheCleared()])
    assert fake.calls == [("removed", [1, 3, 5, 8, 9])] and not relay.orphans and not relay.known


# ------------------------------------------------------------------------------------------------
# a deployment: two workers and the router on loopback


def _dynamo_missing() -> str | None:
    from service.dynamo import missing

    return missing()


MISSING = _dynamo_missing()
needs_dynamo = pytest.mark.skipif(MISSING is not None, reason=f"Dynamo cannot be imported here: {MISSING}")


class Probe:
    """A Dynamo participant in this process: a KvRouter over the workers (it sees their KV events),
    on an event loop of its own."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dynamo-probe", daemon=True)
        self.thread.start()
        self.call(self._open())

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self) -> None:
        from dynamo.llm import KvRouter, KvRouterConfig
        from dynamo.runtime import DistributedRuntime

        self.runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
        endpoint = self.runtime.endpoint(f"{self.namespace}.backend.generate")
        self.client = await endpoint.client()
        self.router = KvRouter(endpoint, 16, KvRouterConfig())

    async def generate(self, worker: int, request: dict[str, Any]) -> list[dict[str, Any]]:
        stream = await self.router.generate(
            request["token_ids"], EMBEDDED_NAME, stop_conditions=request.get("stop_conditions"),
            sampling_options=request.get("sampling_options"), output_options=request.get("output_options"),
            worker_id=worker,
        )  # fmt: skip
        return [chunk async for chunk in stream]

    async def overlap(self, tokens: list[int]) -> dict[int, int]:
        scores = await self.router.get_overlap_scores(tokens)
        return {w["worker_id"]: w["device_blocks"] for w in scores["workers"]}

    async def stored_blocks(self, worker: int) -> dict[int, tuple[int | None, int]]:
        """The router's index for `worker`: block id -> (parent id, tokens hash)."""
        blocks: dict[int, tuple[int | None, int]] = {}
        for event in json.loads(await self.router.dump_events()):
            data = event.get("event", event).get("data", {})
            if event.get("worker_id") == worker and isinstance(data, dict) and data.get("stored"):
                store = data["stored"]
                parent = store.get("parent_hash")
                for block in store["blocks"]:
                    blocks[block["block_hash"]] = (parent, block["tokens_hash"])
                    parent = block["block_hash"]
        return blocks

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.runtime.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from service.dynamo.local import LOOPBACK_ENV, LocalDeployment

    workdir = tmp_path_factory.mktemp("dynamo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIM_")}
    env.update({"HF_HUB_OFFLINE": "1", "NIM_DYNAMO_NAMESPACE": "nimtest"})
    engine = {"NIM_NUM_THREADS": "1", "NIM_KV_CACHE_MAX_TOKENS": "16384"}
    # worker0's engine runs in a process of its own, worker1's in the worker's process
    per_worker = [{"NIM_ENGINE_PROCESS": "on"}, {}]
    deployment = LocalDeployment(2, free_port(), workdir, env=env, workers_env=engine, worker_env=per_worker)
    saved = {k: os.environ.get(k) for k in [*LOOPBACK_ENV, "DYN_FILE_KV"]}
    probe = None
    try:
        deployment.start()
        os.environ.update({**LOOPBACK_ENV, "DYN_FILE_KV": str(workdir / "discovery")})
        probe = Probe("nimtest")
        yield deployment, probe
    finally:
        if probe is not None:
            probe.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        codes = deployment.stop()
        for name, process in deployment.processes.items():
            assert process.poll() is not None, f"{name} still runs"
        assert all(code is not None for code in codes.values())
        with pytest.raises(ConnectionRefusedError):  # nothing listens on the router's port any more
            socket.create_connection(("127.0.0.1", deployment.port), timeout=5).close()


def worker_ids(deployment: Any) -> dict[str, int]:
    """Process name -> Dynamo worker id, from each worker's start-up line."""
    ids = {}
    for name in deployment.processes:
        if name.startswith("worker"):
            found = re.findall(r"Dynamo worker (\d+):", deployment.log(name))
            ids[name] = int(found[-1])
    return ids


def chat(url: str, content: str, max_tokens: int = 12, **extra: Any) -> httpx.Response:
    body = {"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


@needs_dynamo
def test_router_serves_the_api_with_a_single_servers_answers(deployment: Any, server: ServerProcess) -> None:
    dep, _ = deployment
    for prompt in ("Name the capital of France.", "Write one word about the sea."):
        routed, single = chat(dep.url, prompt), chat(server.base_url, prompt)
        assert routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["message"] == single.json()["choices"][0]["message"]
        assert routed.json()["usage"]["completion_tokens"] == single.json()["usage"]["completion_tokens"]
    # streamed, with a stop string, logprobs and usage: the same contract as one server
    body = {"model": EMBEDDED_NAME, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
            "stop": [" dog"], "logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    texts = {}
    for name, url in (("routed", dep.url), ("single", server.base_url)):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[6:]) for line in lines]
        texts[name] = ("".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
                       [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1],
                       chunks[-1]["usage"]["completion_tokens"])  # fmt: skip
    assert texts["routed"] == texts["single"]
    # refused before anything streams, as one server refuses it
    bad = chat(dep.url, "hi", stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}}})  # fmt: skip
    assert bad.status_code == 400, bad.text
    assert httpx.get(f"{dep.url}/v1/models", timeout=10).json()["data"][0]["id"] == EMBEDDED_NAME


@needs_dynamo
def test_kv_events_match_each_workers_prefix_cache(deployment: Any) -> None:
    """Each worker (engine in its own process / in the worker's) gets a prompt straight through
    Dynamo's request shape; the router's index then holds exactly that prompt's full blocks for
    it, under the ids the worker's prefix cache computes, linked to their parents, with the tokens
    hash Dynamo computes; a repeat finds them (usage and the router's overlap agree)."""
    from dynamo.llm import compute_block_hash_for_seq

    from service.engine.torch.block_pool import ROOT_HASH, event_id, hash_block

    dep, probe = deployment
    for offset, (name, worker) in enumerate(sorted(worker_ids(dep).items())):
        prompt = [1000 + 37 * offset + i for i in range(80)]  # 5 full blocks
        request = {
            "token_ids": prompt,
            "stop_conditions": {"max_tokens": 2},
            "sampling_options": {"temperature": 0.0},
        }
        chunks = probe.call(probe.generate(worker, request))
        assert chunks[-1]["finish_reason"] == "length", chunks
        assert chunks[-1]["completion_usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        time.sleep(0.3)  # the worker's relay sends within milliseconds
        blocks = probe.call(probe.stored_blocks(worker))
        parent_hash, parent_id = ROOT_HASH, None
        tokens_hashes = compute_block_hash_for_seq(prompt, 16)
        for i in range(5):
            parent_hash = hash_block(parent_hash, prompt[16 * i : 16 * (i + 1)])
            block = event_id(parent_hash) % 2**64  # the router shows ids unsigned
            assert block in blocks, f"{name}: block {i} of the prompt is not indexed"
            stored_parent, tokens_hash = blocks[block]
            assert (stored_parent if stored_parent is None else stored_parent % 2**64) == parent_id
            assert tokens_hash == tokens_hashes[i]
            parent_id = block
        again = probe.call(probe.generate(worker, request))
        cached = again[-1]["completion_usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 64  # 4 of 5 blocks: the last prompt token is always computed
        assert probe.call(probe.overlap(prompt))[worker] >= 4
    # a field the worker does not honour is refused by name, in Dynamo's InvalidArgument
    from dynamo.llm.exceptions import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"sampling_options\.n"):
        probe.call(probe.generate(worker, {**request, "sampling_options": {"n": 2}}))


@needs_dynamo
def test_kv_routing_sends_a_conversation_back_to_its_worker(deployment: Any) -> None:
    dep, _ = deployment
    system = "You are a terse assistant. " * 20
    first = chat(dep.url, system + "Say one word.")
    assert first.status_code == 200
    second = chat(dep.url, system + "Say two words.")
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


@needs_dynamo
def test_a_worker_killed_mid_stream_ends_the_stream_and_the_next_request_goes_to_the_survivor(
    deployment: Any,
) -> None:
    dep, probe = deployment
    names = {v: k for k, v in worker_ids(dep).items()}
    body = {"model": EMBEDDED_NAME, "prompt": "A very long story about a lighthouse keeper. " * 4,
            "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    tokens = httpx.post(f"{dep.url}/tokenize", json={"model": EMBEDDED_NAME, "prompt": body["prompt"]}).json()
    frames = []
    with httpx.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                frames.append(line)
            if len(frames) == 3:
                break
        overlap = probe.call(probe.overlap(tokens["tokens"]))
        serving = max(overlap, key=lambda w: overlap[w])
        killed = time.monotonic()
        dep.kill(names[serving])
        rest = list(lines)
    data = [line for line in rest if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]", data[-3:]
    error = json.loads(data[-2][6:])["error"]
    assert "lost mid-generation" in error["message"] and error["code"] == "engine_error", error
    assert time.monotonic() - killed < 10
    # at once, and after: every request is served (by the survivor)
    for i in range(4):
        answer = chat(dep.url, f"Count to {i + 2}.", max_tokens=4)
        assert answer.status_code == 200, answer.text
        time.sleep(0.3)
