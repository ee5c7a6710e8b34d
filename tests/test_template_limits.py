"""A hostile chat template costs its own request a bounded time and memory, and nothing else (issue 43).

Jinja's compiler evaluated constant expressions while compiling (`{{ 'x'|center(1000000000) }}`
was built there, outside the render's watchdog, and the cache then held it), and filters, string
methods and formats built whatever they were asked for before any size was checked. Here every
operation a template can ask for that could build a large value is refused before building it,
nothing is evaluated at compile time, and the cache is bounded by what compiled templates hold.

In process: each of the hostile templates compiles in milliseconds, renders to a one-line
ChatTemplateError within the CPU limit, and raises this process's peak resident memory (its
high-water mark, reset before each through /proc/self/clear_refs) by a bounded amount. Over HTTP,
on a real server that trusts request templates: the issue's four probes, and a template that runs
to its CPU limit, each get a 400 in bounded time while /v1/health/live answers within 1 s
throughout, and the server's resident memory is back within 200 MB afterwards. NIM_CHAT_TEMPLATE is
compiled the same way at start.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.config_loading import load_settings
from service.text.chat_template import RENDER_CPU_SECONDS, ChatTemplate, ChatTemplateError, TemplateCache
from tests.conftest import EMBEDDED_NAME, ServerProcess, start_server, wait_ready

HI = [{"role": "user", "content": "hi"}]
MB = 1 << 20

# The issue's four probes: each was folded by the compiler (or, tojson, built past the output check)
ISSUE_PROBES = {
    "printf-width": "{{ '%1000000000d' % 1 }}",
    "center": "{{ 'x'|center(1000000000) }}",
    "indent": "{{ 'x\\ny'|indent(1000000000) }}",
    "tojson-indent": "{{ messages|tojson(indent=300000000) }}",
}
BIG = "{% set s = 'x' * 30000000 %}"  # the largest value a render may build, nearly
# The same kind of request through every other door a template has to a large value
MORE_PROBES = {
    "format-filter": "{{ '%1000000000s'|format('x') }}",
    "format-method": "{{ '{:>1000000000}'.format('x') }}",
    "format-nested-width": "{{ '{:{w}}'.format('x', w=1000000000) }}",
    "format-map": "{{ '{a:1000000000}'.format_map({'a': 'x'}) }}",
    "printf-star-width": "{{ '%*d' % (1000000000, 1) }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "zfill": "{{ '1'.zfill(1000000000) }}",
    "expandtabs": "{{ '\\t'.expandtabs(1000000000) }}",
    "replace-method": BIG + "{{ s.replace('', 'yy') }}",
    "replace-filter": BIG + "{{ s|replace('x', 'yyyyyyyy') }}",
    "translate": BIG + "{{ s.translate({120: 'yyyy'}) }}",
    "join-method": BIG + "{{ ''.join([s, s]) }}",
    "join-filter": BIG + "{{ [s, s]|join }}",
    "concat": BIG + "{{ s ~ s }}",
    "plus": BIG + "{{ s + s }}",
    "str-of-a-list": BIG + "{{ [s, s] }}",
    "string-filter": BIG + "{{ [s, s]|string }}",
    "list-repeat-str": BIG + "{% set l = [s] * 1000000 %}{{ l|length }}{{ l }}",
    "tojson-many": BIG + "{{ ([s] * 1000)|tojson }}",
    "pprint": BIG + "{{ [s, s]|pprint }}",
    "escape": "{{ ('<' * 30000000)|e|length }}",
    "wordwrap": "{{ ('x' * 1000000)|wordwrap(1, true, 'y' * 1000) }}",
    "to-bytes": "{{ (1).to_bytes(1000000000, 'big')|length }}",
    "encode-center": "{{ 'x'.encode().center(1000000000)|length }}",
    "batch-fill": "{{ [1]|batch(1000000000, 0)|list }}",
    "slice-fill": "{{ [1]|slice(1000000000, 0)|list|length }}",
    "sum-of-lists": "{% set l = [1] * 100000 %}{{ ([l] * 100000)|sum(start=[])|length }}",
    "split": "{{ ('a ' * 15000000).split()|length }}",
    "list-of-a-string": "{{ ('é' * 30000000)|list|length }}",
    "lipsum": "{{ lipsum(1000000000)|length }}",
    "strftime": "{{ strftime_now('%Y' * 10000000)|length }}",
    "set-block-buffer": BIG + "{% set t %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}{{ t }}",
    "macro-buffer": BIG + "{% macro m() %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endmacro %}"
    "{{ m() }}",
    "literal-buffer": "{% set t %}{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
    "{% endfor %}{% endset %}{{ t|length }}",
    "accumulate": BIG + "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + [s ~ i] %}{% endfor %}{{ ns.l|length }}",
    "filter-block": "{% filter center(1000000000) %}x{% endfilter %}",
    "map-filter": "{{ ['x']|map('center', 1000000000)|list }}",
    "autoescape-constant": "{% autoescape 'x'|center(1000000000) == 'x' %}{% endautoescape %}x",
}
PEAK_LIMIT = 768 * MB  # the most a probe may raise the process's peak resident memory
# A benign template near MAX_TEMPLATE_BYTES, as dense in code as a template gets
_UNIT = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ m.content|trim }}"
    "{% else %}{{ (m.content ~ 'x')|upper }}{% endif %}{% endfor %}"
)
LARGE_TEMPLATE = _UNIT * (64000 // len(_UNIT))


def _status(pid: int | str, field: str) -> int:
    """A /proc/<pid>/status field in bytes (VmRSS, VmHWM)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)[1]) * 1024  # type: ignore[index]


def _reset_peak(pid: int | str = "self") -> int:
    """Reset a process's resident high-water mark to what it holds now; returns that."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status(pid, "VmRSS")


def _one_thread_cpu() -> float:
    return time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)


@pytest.mark.parametrize("template", [*ISSUE_PROBES.values(), *MORE_PROBES.values()],
                         ids=[*ISSUE_PROBES, *MORE_PROBES])  # fmt: skip
def test_a_value_too_large_is_refused_before_it_is_built(template: str) -> None:
    baseline = _reset_peak()
    started = _one_thread_cpu()
    compiled = ChatTemplate(template)
    assert compiled.error is None, compiled.error
    assert _one_thread_cpu() - started < 0.5  # nothing is evaluated while compiling
    with pytest.raises(ChatTemplateError) as info:
        compiled.render(HI)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    assert re.search(r"would build|CPU time", message), message
    assert _one_thread_cpu() - started < RENDER_CPU_SECONDS + 1.5
    assert _status("self", "VmHWM") - baseline < PEAK_LIMIT


def test_the_bounds_leave_large_honest_conversations_alone() -> None:
    """A conversation of 10 MB (the largest request body is 16 MB) renders through a template that
    copies, trims, escapes, splits and joins its text: the limits are above what it builds."""
    content = "Lorem ipsum dolor sit amet, <consectetur> adipiscing elit.\n" * 87000 + "The end."  # 5 MB
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": content}]
    template = (
        "{% for m in messages %}{{ m.role|upper }}: {{ m.content|trim }}\n"
        "{% set words = m.content.split() %}{{ words|length }} "
        "{{ m.content.split('\\n')|join('\\n')|length }}"
        "{{ (m.content ~ '.')|length }}{{ m.content|e|length }}{{ m|tojson|length }}{% endfor %}"
        "{{ '%-10s|%5d' % ('ok', 7) }}{{ '{:>6}'.format('ok') }}{{ 'ab'.center(6, '*') }}"
    )
    text = ChatTemplate(template).render(messages)
    assert text.count(content) == 2 and text.endswith("ok        |    7    ok**ab**")


def test_the_cache_is_bounded_by_what_compiled_templates_hold() -> None:
    """A compiled template holds code about as large as its source (no folded constants): the cache
    charges each entry its source and its generated code, and stays within its bound."""
    cache = TemplateCache(max_entries=64, max_bytes=2 * MB)
    for i in range(8):
        cache.get(ISSUE_PROBES["center"].replace("x", f"x{i}"))
    assert len(cache) == 8 and cache.nbytes < 64 * 1024
    long = "{# " + "y" * 40000 + " #}{{ messages|length }}"
    for i in range(200):
        cache.get(long + str(i))
    assert cache.nbytes <= 2 * MB and len(cache) < 64


def test_nim_chat_template_compiles_without_building_anything() -> None:
    """NIM_CHAT_TEMPLATE is compiled at start by the same compiler: a probe there is accepted at
    once (its renders are refused, one request at a time) and builds nothing while starting."""
    baseline = _reset_peak()
    started = _one_thread_cpu()
    settings = load_settings(chat_template=ISSUE_PROBES["center"])
    assert _one_thread_cpu() - started < 0.5
    assert _status("self", "VmHWM") - baseline < 64 * MB
    with pytest.raises(ChatTemplateError, match="would build"):
        ChatTemplate(settings.chat_template_source or "").render(HI)


# --- Over HTTP -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trusting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("template-limits") / "server.log"
    server = start_server(log, env={"NIM_TRUST_REQUEST_CHAT_TEMPLATE": "1"})
    try:
        wait_ready(server)
        yield server
    finally:
        server.stop()


class _Prober(threading.Thread):
    """Asks /v1/health/live every 0.1 s with a 1 s timeout; records each answer's latency."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.stopping = base_url, threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=1.0) as client:
            while not self.stopping.is_set():
                started = time.monotonic()
                try:
                    ok = client.get("/v1/health/live").status_code == 200
                except httpx.HTTPError as exc:
                    ok = False
                    self.failures.append(repr(exc))
                self.latencies.append(time.monotonic() - started)
                if not ok and not self.failures:
                    self.failures.append("not 200")
                self.stopping.wait(0.1)


def test_hostile_request_templates_cost_their_own_request_only(trusting: ServerProcess) -> None:
    pid = trusting.process.pid
    body = {"model": EMBEDDED_NAME, "messages": HI, "max_tokens": 1}
    with httpx.Client(base_url=trusting.base_url, timeout=120) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200  # warm
        before = _reset_peak(pid)
        prober = _Prober(trusting.base_url)
        prober.start()
        try:
            # the largest template a request may bring, dense: compiled (about a second of CPU) off
            # the event loop
            large = {**body, "chat_template": LARGE_TEMPLATE, "max_tokens": 1}
            assert client.post("/v1/chat/completions", json=large).status_code == 200
            for _ in range(2):  # the second time from the cache
                for name, template in ISSUE_PROBES.items():
                    started = time.monotonic()
                    response = client.post("/v1/chat/completions", json={**body, "chat_template": template})
                    took = time.monotonic() - started
                    assert response.status_code == 400, (name, response.text)
                    error = response.json()["error"]
                    assert error["param"] == "chat_template" and "would build" in error["message"], error
                    assert took < 10, (name, took)
            # one that runs to its CPU limit (or, on a fast host, to the items it may build), building
            # as it goes: the server answers meanwhile
            slow = {**body, "chat_template": MORE_PROBES["literal-buffer"]}
            response = client.post("/v1/chat/completions", json=slow)
            assert response.status_code == 400
            assert re.search(r"CPU time|items in all", response.json()["error"]["message"]), response.text
            while len(prober.latencies) < 3:  # the probes above may all be answered before it asks
                time.sleep(0.05)
        finally:
            prober.stopping.set()
            prober.join()
        assert not prober.failures, prober.failures
        assert max(prober.latencies) < 1.0, prober.latencies
        assert _status(pid, "VmHWM") - before < PEAK_LIMIT
        deadline = time.monotonic() + 10
        while _status(pid, "VmRSS") - before > 200 * MB and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _status(pid, "VmRSS") - before <= 200 * MB
        assert client.post("/v1/chat/completions", json=body).status_code == 200
