"""The official `openai` SDK on the Responses API and the official `anthropic` SDK on the
Messages API, against `equiroute serve`, through an OpenAI-dialect and an Anthropic-dialect
provider (both played by `equiroute mock-upstream`): plain, streamed, and a tool round trip.
The SDKs are used as they ship (no patching).

Run by `.ci/run` (which installs `openai` and `anthropic` into a virtualenv):
    python tests/sdk/test_client_apis.py target/debug/equiroute
"""

import json
import os
import sys
import tempfile
import urllib.request

import anthropic
import openai

from harness import mock_and_gateway, run_checks, stop

CONFIG = """
[interfaces.via-openai]
kind = "chat"
policy = {{ name = "static", candidate = "gpt" }}

[[interfaces.via-openai.providers]]
id = "gpt"
kind = "openai"
model = "gpt-mock"
base_url = "http://{mock}/v1"

[interfaces.via-anthropic]
kind = "chat"
policy = {{ name = "static", candidate = "claude" }}

[[interfaces.via-anthropic.providers]]
id = "claude"
kind = "anthropic"
model = "claude-mock"
base_url = "http://{mock}/v1"
api_key_env = "EQUIROUTE_SDK_MOCK_KEY"
max_tokens = 1000
"""

# (interface, the model that answers, the provider's id)
INTERFACES = [("via-openai", "gpt-mock", "gpt"), ("via-anthropic", "claude-mock", "claude")]

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}
QUESTION = "what is the weather in paris?"


def responses_tools():
    t = WEATHER_TOOL
    return [{"type": "function", "name": t["name"], "description": t["description"], "parameters": t["schema"]}]


def messages_tools():
    t = WEATHER_TOOL
    return [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]}]


def feedback(base, request_id):
    req = urllib.request.Request(
        f"{base}/v1/feedback",
        data=json.dumps({"request_id": request_id, "quality": 0.8}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["status"]


# --- the openai SDK on /v1/responses ---------------------------------------------------------

def check_responses_plain(client, base, iface, model, provider):
    raw = client.responses.with_raw_response.create(model=iface, input=QUESTION, instructions="Be brief.")
    assert raw.headers.get("x-equiroute-provider") == provider, raw.headers
    request_id = raw.headers.get("x-equiroute-request-id", "")
    assert request_id.startswith("req-"), raw.headers
    r = raw.parse()
    assert r.object == "response", r
    assert r.status == "completed", r
    assert r.model == model, r.model
    assert r.output_text == "mock answer", r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
    assert feedback(base, request_id) == "accepted"


def check_responses_stream(client, base, iface, model, provider):
    events = list(client.responses.create(model=iface, input=QUESTION, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "mock streamed answer", text
    assert events[-1].response.output_text == text, events[-1].response
    assert events[-1].response.usage.output_tokens > 0, events[-1].response.usage
    # The SDK's own stream helper accumulates the events into the final response.
    with client.responses.stream(model=iface, input=QUESTION) as stream:
        final = stream.get_final_response()
    assert final.output_text == "mock streamed answer", final


def check_responses_tool_round_trip(client, base, iface, model, provider):
    history = [{"role": "user", "content": QUESTION}]
    r = client.responses.create(model=iface, input=history, tools=responses_tools())
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1, r.output
    call = calls[0]
    assert call.name == "get_weather", call
    assert json.loads(call.arguments) == {"q": "mock"}, call.arguments
    history += r.output
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"})
    r2 = client.responses.create(model=iface, input=history, tools=responses_tools())
    assert [item.type for item in r2.output] == ["message"], r2.output
    assert r2.output_text == "mock answer", r2.output_text
    # Streamed, the call arrives as its own events.
    events = list(client.responses.create(model=iface, input=QUESTION, tools=responses_tools(), stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert len(added) == 1 and added[0].name == "get_weather", events
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"q": "mock"}, args


def check_responses_errors(client, base, iface, model, provider):
    try:
        client.responses.create(model=iface, input=QUESTION, previous_response_id="resp_earlier")
    except openai.BadRequestError as e:
        assert e.param == "previous_response_id", (e.param, str(e))
        assert "stateless" in str(e), str(e)
    else:
        raise AssertionError("expected openai.BadRequestError")
    try:
        client.responses.create(model="no-such-interface", input=QUESTION)
    except openai.NotFoundError as e:
        assert "is not a chat interface" in str(e), str(e)
    else:
        raise AssertionError("expected openai.NotFoundError")


# --- the anthropic SDK on /v1/messages -------------------------------------------------------

def check_messages_plain(client, base, iface, model, provider):
    raw = client.messages.with_raw_response.create(
        model=iface, max_tokens=200, system="Be brief.", messages=[{"role": "user", "content": QUESTION}]
    )
    assert raw.headers.get("x-equiroute-provider") == provider, raw.headers
    request_id = raw.headers.get("x-equiroute-request-id", "")
    m = raw.parse()
    assert m.type == "message" and m.role == "assistant", m
    assert m.model == model, m.model
    assert [b.type for b in m.content] == ["text"], m.content
    assert m.content[0].text == "mock answer", m.content
    assert m.stop_reason == "end_turn", m.stop_reason
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0, m.usage
    assert m.usage.output_tokens > 0, m.usage
    assert feedback(base, request_id) == "accepted"


def check_messages_stream(client, base, iface, model, provider):
    events = list(
        client.messages.create(model=iface, max_tokens=200, messages=[{"role": "user", "content": QUESTION}], stream=True)
    )
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == "mock streamed answer", text
    # The SDK's own stream helper accumulates the events into the final message.
    with client.messages.stream(model=iface, max_tokens=200, messages=[{"role": "user", "content": QUESTION}]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == "mock streamed answer", streamed
    assert final.content[0].text == streamed and final.stop_reason == "end_turn", final
    assert final.usage.output_tokens > 0, final.usage


def check_messages_tool_use(client, base, iface, model, provider):
    history = [{"role": "user", "content": QUESTION}]
    m = client.messages.create(model=iface, max_tokens=200, messages=history, tools=messages_tools())
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather", m.content
    assert uses[0].input == {"q": "mock"}, uses[0].input
    history.append({"role": "assistant", "content": m.content})
    history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"}]})
    m2 = client.messages.create(model=iface, max_tokens=200, messages=history, tools=messages_tools())
    assert m2.stop_reason == "end_turn", m2
    assert m2.content[0].text == "mock answer", m2.content
    # Streamed, through the SDK's helper: the tool input is assembled from its JSON deltas.
    with client.messages.stream(model=iface, max_tokens=200, messages=history[:1], tools=messages_tools()) as s:
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and uses and uses[0].input == {"q": "mock"}, final


def check_messages_errors(client, base, iface, model, provider):
    try:
        client.messages.create(model="no-such-interface", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    except anthropic.NotFoundError as e:
        assert e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error", e.body
    else:
        raise AssertionError("expected anthropic.NotFoundError")
    try:
        client.messages.create(
            model=iface,
            max_tokens=2048,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "hi"}],
        )
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error", e.body
        assert "`thinking`" in e.body["error"]["message"], e.body
    else:
        raise AssertionError("expected anthropic.BadRequestError")


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/equiroute"
    work = tempfile.mkdtemp(prefix="equiroute-sdk-apis-")
    env = dict(os.environ, XDG_STATE_HOME=work, EQUIROUTE_SDK_MOCK_KEY="mock-key")
    procs = []
    failed = 1
    try:
        _, addr = mock_and_gateway(binary, lambda mock: CONFIG.format(mock=mock), env, work, procs)
        base = f"http://{addr}"
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        checks = [
            (oa, check_responses_plain),
            (oa, check_responses_stream),
            (oa, check_responses_tool_round_trip),
            (oa, check_responses_errors),
            (an, check_messages_plain),
            (an, check_messages_stream),
            (an, check_messages_tool_use),
            (an, check_messages_errors),
        ]
        named = [
            (f"{check.__name__} via {iface}", lambda c=client, k=check, i=iface, m=model, p=provider: k(c, base, i, m, p))
            for iface, model, provider in INTERFACES
            for client, check in checks
        ]
        failed = run_checks(named, "sdk (responses, messages)")
    finally:
        stop(procs, work)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
