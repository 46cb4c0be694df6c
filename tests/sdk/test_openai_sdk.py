"""The official OpenAI Python SDK against `equiroute serve` with its embedded defaults.

Its learning is kept in a temporary XDG_STATE_HOME (the default state file), never in the
runner's home.

Run by `.ci/run` (which installs `openai` into a virtualenv):
    python tests/sdk/test_openai_sdk.py target/debug/equiroute
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import openai

from harness import run_checks

MESSAGES = [{"role": "user", "content": "what is the capital of france?"}]


def check_completion(client):
    r = client.chat.completions.create(model="chat", messages=MESSAGES)
    assert r.object == "chat.completion", r
    assert r.choices[0].message.role == "assistant", r
    assert r.choices[0].message.content.startswith("[sim-"), r
    assert r.model in ("sim-model", "sim-small"), r.model
    assert r.usage.total_tokens > 0, r.usage
    raw = client.chat.completions.with_raw_response.create(model="chat/sim-small", messages=MESSAGES)
    assert raw.headers.get("x-equiroute-provider") == "sim-small", raw.headers
    assert raw.headers.get("x-equiroute-request-id", "").startswith("req-"), raw.headers
    assert raw.parse().model == "sim-small"


def check_stream(client):
    chunks = list(client.chat.completions.create(model="chat", messages=MESSAGES, stream=True))
    assert len(chunks) >= 3, chunks
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("[sim-"), text
    assert chunks[-1].choices[0].finish_reason == "stop", chunks[-1]


def check_not_found(client):
    try:
        client.chat.completions.create(model="no-such-interface", messages=MESSAGES)
    except openai.NotFoundError as e:
        assert e.status_code == 404
        assert "is not a chat interface" in str(e), str(e)
        return
    raise AssertionError("expected openai.NotFoundError")


def check_bad_request(client):
    try:
        client.chat.completions.create(model="chat", messages=[])
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert "messages" in str(e), str(e)
        return
    raise AssertionError("expected openai.BadRequestError")


def check_bad_field(client):
    # A field the gateway reads, of a wrong value: the SDK sees the field in `param`.
    try:
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=-5)
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert e.param == "max_tokens", (e.param, str(e))
        assert e.code == "invalid_value", (e.code, str(e))
        return
    raise AssertionError("expected openai.BadRequestError")


def check_models(client):
    ids = [m.id for m in client.models.list()]
    assert "chat" in ids and "chat/sim-small" in ids, ids
    assert client.models.retrieve("chat/sim-small").id == "chat/sim-small"


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/equiroute"
    state_home = tempfile.mkdtemp(prefix="equiroute-sdk-state-")
    env = dict(os.environ, XDG_STATE_HOME=state_home)
    proc = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env)
    failed = 1
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://([0-9.]+:[0-9]+)", line)
        assert match, f"no address in {line!r}"
        learning = proc.stdout.readline()
        assert learning.startswith("learning: persists in " + state_home), learning
        client = openai.OpenAI(base_url=f"http://{match.group(1)}/v1", api_key="unused", max_retries=0)
        checks = (check_completion, check_stream, check_not_found, check_bad_request, check_bad_field, check_models)
        failed = run_checks([(c.__name__, lambda c=c: c(client)) for c in checks], "sdk")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(state_home, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
