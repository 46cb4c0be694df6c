"""Streams that break after content, read by the official OpenAI Python SDK joining deltas.

Issue 43, bar 2: the joined text is one coherent answer (continued by prefix) or the SDK
raises the gateway's `stream_broken` error; never the old text followed by a new answer.
Provider `a` (first, `static` policy) is an `equiroute mock-upstream` model that breaks its
stream after "mock " (a cut, or a malformed event); `b` is healthy. Every interface has the
defaults but for the providers (and `stream_resume` where named).

Run by `.ci/run` (which installs `openai` into a virtualenv):
    python tests/sdk/test_stream_breaks.py target/debug/equiroute
"""

import os
import sys
import tempfile

import openai

from harness import run_checks, start, stop

ANSWER = "mock streamed answer"
MESSAGES = [{"role": "user", "content": "hi"}]

PROFILE = """
[models."cut"]
fault = "stream_cut"

[models."malformed"]
fault = "malformed_chunk"
"""

INTERFACE = """
[interfaces.{name}]
kind = "chat"
policy = {{ name = "static", candidate = "a" }}
{extra}

[[interfaces.{name}.providers]]
id = "a"
kind = "openai"
model = "{fault}"
base_url = "http://{mock}/v1"

[[interfaces.{name}.providers]]
id = "b"
{b}
"""

OPENAI_B = 'kind = "openai"\nmodel = "healthy"\nbase_url = "http://{mock}/v1"'
ANTHROPIC_B = (
    'kind = "anthropic"\nmodel = "claude-mock"\nbase_url = "http://{mock}/v1"\n'
    'api_key_env = "EQUIROUTE_SDK_MOCK_KEY"\nmax_tokens = 1000'
)

# (interface, a's model, b's table, extra interface lines)
INTERFACES = [
    ("prefix", "cut", ANTHROPIC_B, ""),
    ("malformed", "malformed", ANTHROPIC_B, ""),
    ("noprefill", "cut", OPENAI_B, ""),
    ("restart", "cut", OPENAI_B, 'stream_resume = { mode = "restart" }'),
]


def joined(client, model, headers=None, honour_restart=False):
    """The text a client joining `delta.content` shows, and the error the SDK raised (or None).
    `honour_restart`: drop the text joined so far at a restart marker, as a client that asked
    for restart events does."""
    text, error = "", None
    try:
        stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, extra_headers=headers or {})
        for chunk in stream:
            marker = (chunk.model_extra or {}).get("equiroute") or {}
            if honour_restart and marker.get("event") == "restart":
                text = ""
            for choice in chunk.choices:
                text += choice.delta.content or ""
    except openai.APIError as e:
        error = e
    return text, error


def assert_one_answer_or_an_error(text, error):
    # Never old + new: an answer whole, or what came before an error, a prefix of one answer.
    assert text.count("mock") <= 1, f"old + new text: {text!r}"
    if error is None:
        assert text == ANSWER, text
    else:
        assert ANSWER.startswith(text), text
        assert "stream_broken" in str(error.code or "") or "broke" in str(error), repr(error)


def check_cut_after_content_continues_by_prefix(client):
    text, error = joined(client, "prefix")
    assert_one_answer_or_an_error(text, error)
    assert error is None and text == ANSWER, (text, error)


def check_malformed_event_after_content_continues_by_prefix(client):
    text, error = joined(client, "malformed")
    assert_one_answer_or_an_error(text, error)
    assert error is None and text == ANSWER, (text, error)


def check_cut_without_prefill_is_an_error_not_old_plus_new(client):
    for model in ("noprefill", "restart"):
        text, error = joined(client, model)
        assert_one_answer_or_an_error(text, error)
        assert error is not None and text == "mock ", (model, text, error)


def check_restart_events_for_a_client_that_asks_for_them(client):
    headers = {"x-equiroute-stream-restart": "events"}
    text, error = joined(client, "restart", headers, honour_restart=True)
    assert error is None and text == ANSWER, (text, error)


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/equiroute"
    work = tempfile.mkdtemp(prefix="equiroute-sdk-streams-")
    env = dict(os.environ, XDG_STATE_HOME=work, EQUIROUTE_SDK_MOCK_KEY="mock-key")
    procs = []
    failed = 1
    try:
        profile = os.path.join(work, "mock.toml")
        with open(profile, "w") as f:
            f.write(PROFILE)
        mock, mock_addr = start([binary, "mock-upstream", "--listen", "127.0.0.1:0", "--profile", profile], env)
        procs.append(mock)
        config = os.path.join(work, "gateway.toml")
        with open(config, "w") as f:
            for name, fault, b, extra in INTERFACES:
                f.write(INTERFACE.format(name=name, fault=fault, extra=extra, mock=mock_addr, b=b.format(mock=mock_addr)))
        gateway, addr = start([binary, "serve", "--config", config, "--listen", "127.0.0.1:0", "--in-memory"], env)
        procs.append(gateway)
        client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0)
        checks = (
            check_cut_after_content_continues_by_prefix,
            check_malformed_event_after_content_continues_by_prefix,
            check_cut_without_prefill_is_an_error_not_old_plus_new,
            check_restart_events_for_a_client_that_asks_for_them,
        )
        failed = run_checks([(c.__name__, lambda c=c: c(client)) for c in checks], "sdk (stream breaks)")
    finally:
        stop(procs, work)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
