"""How often tool_choice auto calls a tool on the embedded SmolLM2-135M (default settings).

Usage: .venv/bin/python bench/tool_auto.py http://127.0.0.1:8000 [temperature]  (a server running
the embedded model with default settings); prints one line per prompt and the counts.
"""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

base = sys.argv[1]
temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
S = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "get_time": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    "send_email": {
        "type": "object",
        "properties": {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        "required": ["to", "subject", "body"],
    },
    "convert_currency": {
        "type": "object",
        "properties": {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
        "required": ["amount", "from", "to"],
    },
}
D = {
    "get_weather": "Get the current weather in a city",
    "get_time": "Get the current time in a time zone",
    "send_email": "Send an email",
    "convert_currency": "Convert an amount of money between currencies",
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": D[n], "parameters": p}} for n, p in S.items()
]
WANT = [
    ("What's the weather in Paris right now?", "get_weather"),
    ("Is it raining in London?", "get_weather"),
    ("How hot is it in Cairo today?", "get_weather"),
    ("Weather forecast for Tokyo please.", "get_weather"),
    ("Check the weather in New York.", "get_weather"),
    ("What's the temperature in Berlin?", "get_weather"),
    ("What time is it in Tokyo?", "get_time"),
    ("Tell me the current time in UTC.", "get_time"),
    ("What's the time in Los Angeles?", "get_time"),
    ("Current time in the Europe/Madrid time zone?", "get_time"),
    ("Email bob@example.com that the meeting moved to 3pm.", "send_email"),
    ("Send an email to alice@example.com with subject Hello saying hi.", "send_email"),
    ("Please email my boss (boss@corp.com) that I'm sick today.", "send_email"),
    ("Write to team@example.com: the release is done, subject Release.", "send_email"),
    ("Convert 100 USD to EUR.", "convert_currency"),
    ("How many yen is 50 dollars?", "convert_currency"),
    ("Convert 20 GBP into USD.", "convert_currency"),
    ("What is 1000 EUR in CHF?", "convert_currency"),
    ("Use the weather tool for Sydney.", "get_weather"),
    ("Call get_time for Asia/Kolkata.", "get_time"),
]
NOT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Who wrote Hamlet?",
    "Tell me a joke.",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is a prime number?",
    "Name three colours.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What does CPU stand for?",
    "Summarise the plot of Cinderella.",
    "Hi! How are you?",
    "What is the boiling point of water in Celsius?",
    "Spell 'necessary'.",
    "Recommend a good book.",
    "What language is spoken in Brazil?",
    "Why is the sky blue?",
    "Thank you!",
]


def ask(prompt):
    t = time.monotonic()
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        max_tokens=60,
        temperature=temperature,
        seed=0,
    )
    c = r.choices[0]
    calls = c.message.tool_calls or []
    out = []
    for call in calls:
        try:
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, S[call.function.name])
            ok = True
        except Exception:
            ok = False
        out.append((call.function.name, ok, call.function.arguments))
    marker = "<tool_call>" in (c.message.content or "")
    return out, c.finish_reason, marker, (c.message.content or "")[:80], time.monotonic() - t


pool = ThreadPoolExecutor(40)
want_results = list(pool.map(lambda item: ask(item[0]), WANT))
not_results = list(pool.map(ask, NOT))
stats = {"want_called": 0, "want_right_name": 0, "want_valid_args": 0, "not_called": 0, "unparsed_marker": 0}
for (_prompt, name), result in zip(WANT, want_results, strict=False):
    calls, fin, marker, content, dt = result
    stats["unparsed_marker"] += marker
    if calls:
        stats["want_called"] += 1
        stats["want_right_name"] += calls[0][0] == name
        stats["want_valid_args"] += calls[0][0] == name and calls[0][1]
    print("WANT", name, calls, fin, marker, repr(content), f"{dt:.1f}s", flush=True)
for _prompt, result in zip(NOT, not_results, strict=False):
    calls, fin, marker, content, dt = result
    stats["unparsed_marker"] += marker
    stats["not_called"] += bool(calls)
    print("NOT ", calls, fin, marker, repr(content), f"{dt:.1f}s", flush=True)
print(json.dumps({"temperature": temperature, **stats}))
