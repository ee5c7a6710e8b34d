"""`helm test` check for nim-torch, run as `python3 -c "<this file>" models|completion|chat`.

Standard library only, so it runs in the service's own image, also air-gapped. Configuration from the
environment: NIM_TEST_BASE_URL (required), NIM_TEST_MODEL (served model name; default the first id of
/v1/models), NIM_API_KEY (first of a comma-separated list is sent as a Bearer token), NIM_TEST_MAX_TOKENS,
NIM_TEST_TIMEOUT_SECONDS, and for HTTPS NIM_TEST_CA_FILE / NIM_TEST_CLIENT_CERT / NIM_TEST_CLIENT_KEY.
Exit status 0 = pass; anything else prints FAIL and the reason.
"""

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request

BASE = os.environ["NIM_TEST_BASE_URL"].rstrip("/")
TIMEOUT = float(os.environ.get("NIM_TEST_TIMEOUT_SECONDS", "600"))
MAX_TOKENS = int(os.environ.get("NIM_TEST_MAX_TOKENS", "16"))


def tls_context():
    if not BASE.startswith("https://"):
        return None
    ca = os.environ.get("NIM_TEST_CA_FILE", "")
    if ca and os.path.isfile(ca):
        # Verify the chain; the Service DNS name need not be among the certificate's names.
        ctx = ssl.create_default_context(cafile=ca)
        ctx.check_hostname = False
    else:
        ctx = ssl._create_unverified_context()
    cert, key = os.environ.get("NIM_TEST_CLIENT_CERT", ""), os.environ.get("NIM_TEST_CLIENT_KEY", "")
    if cert and key and os.path.isfile(cert) and os.path.isfile(key):
        ctx.load_cert_chain(cert, key)
    return ctx


CONTEXT = tls_context()


def headers():
    out = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    key = os.environ.get("NIM_API_KEY", "").split(",")[0].strip()
    if key:
        out["Authorization"] = "Bearer " + key
    return out


def request(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, headers=headers())
    return urllib.request.urlopen(req, timeout=TIMEOUT, context=CONTEXT)


def fail(message):
    print("FAIL: " + message, flush=True)
    sys.exit(1)


def wait_ready():
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            with request("/v1/health/ready") as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                fail(f"service not ready after {TIMEOUT}s: {exc}")
        time.sleep(5)


def get_json(path, body=None):
    try:
        with request(path, body) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        fail(f"{path} answered {exc.code}: {exc.read()[:500]!r}")


def model_ids():
    listing = get_json("/v1/models")
    if listing.get("object") != "list" or not listing.get("data"):
        fail(f"/v1/models returned no models: {listing!r}")
    return [m["id"] for m in listing["data"]]


def served_model():
    return os.environ.get("NIM_TEST_MODEL") or model_ids()[0]


def check_models():
    ids = model_ids()
    wanted = os.environ.get("NIM_TEST_MODEL")
    if wanted and wanted not in ids:
        fail(f"model {wanted!r} not in /v1/models {ids!r}")
    print(f"PASS /v1/models: {', '.join(ids)}")


def check_completion():
    body = {"model": served_model(), "prompt": "The capital of France is", "max_tokens": MAX_TOKENS}
    out = get_json("/v1/completions", body)
    choices = out.get("choices") or []
    if out.get("object") != "text_completion" or not choices or not isinstance(choices[0].get("text"), str):
        fail(f"unexpected completion: {out!r}")
    print(f"PASS /v1/completions: {choices[0]['text']!r} (usage {out.get('usage')})")


def check_chat_stream():
    body = {
        "model": served_model(),
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    events = []
    try:
        with request("/v1/chat/completions", body) as resp:
            kind = resp.headers.get("Content-Type", "")
            if not kind.startswith("text/event-stream"):
                fail(f"streaming chat answered Content-Type {kind!r}")
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    events.append(line[5:].strip())
    except urllib.error.HTTPError as exc:
        fail(f"/v1/chat/completions answered {exc.code}: {exc.read()[:500]!r}")
    if not events or events[-1] != "[DONE]":
        fail(f"stream did not end with data: [DONE] (last events {events[-3:]!r})")
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        fail(f"stream carried an error: {[c for c in chunks if 'error' in c]!r}")
    text = "".join(
        (choice.get("delta") or {}).get("content") or "" for c in chunks for choice in c.get("choices", [])
    )
    if not any(c.get("object") == "chat.completion.chunk" for c in chunks):
        fail("no chat.completion.chunk in the stream")
    print(f"PASS streaming /v1/chat/completions: {len(chunks)} chunks, {text!r}, data: [DONE]")


CHECKS = {"models": check_models, "completion": check_completion, "chat": check_chat_stream}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        fail(f"usage: smoke_test.py {'|'.join(CHECKS)}")
    wait_ready()
    CHECKS[sys.argv[1]]()


main()
