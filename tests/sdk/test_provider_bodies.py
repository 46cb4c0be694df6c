"""The bodies `equiroute serve` sends upstream, validated against each provider's own request
types as its official Python SDK ships them: `openai` (ChatCompletion create params, for the
`openai` and `azure_openai` providers), `anthropic` (Message create params), `google-genai`
(`Content` and `GenerateContentConfig`, the REST body's camelCase members) and botocore's
`bedrock-runtime` service model (Converse's input shape).

Real client requests (the official `openai` SDK's `chat.completions.create`: plain, a system
message, several turns, tools and their results, JSON mode and a JSON schema, an image, a
stream, max_tokens/temperature/top_p/stop) go through the gateway to one provider of each
dialect, all played by `equiroute mock-upstream`; the mock keeps the bodies as they came
(`GET /_requests`), and each is validated. A request a dialect cannot express (JSON mode on
Anthropic and Bedrock) must be refused by the gateway with a 400 and send nothing.

Run by `.ci/run` (which installs the SDKs and botocore into a virtualenv):
    python tests/sdk/test_provider_bodies.py target/debug/equiroute
"""

import collections.abc
import importlib
import json
import os
import pkgutil
import sys
import tempfile
import urllib.parse
import urllib.request

import anthropic.types
import botocore.session
import openai
import openai.types
import pydantic
from botocore.validate import validate_parameters
from google.genai import types as genai_types
from typing_extensions import is_typeddict

from harness import mock_and_gateway, run_checks, stop

# Each dialect's provider (its id is the dialect, its interface too): the configured model, and
# the rest of its table (`{mock}`: the mock's address).
PROVIDERS = {
    "openai": ("gpt-4o", 'base_url = "http://{mock}/v1"\napi_key_env = "EQUIROUTE_SDK_MOCK_KEY"'),
    "azure_openai": (
        "gpt-4o",
        'deployment = "prod-4o"\nendpoint = "http://{mock}"\napi_key_env = "EQUIROUTE_SDK_MOCK_KEY"',
    ),
    "anthropic": (
        "claude-sonnet-4-5",
        'base_url = "http://{mock}/v1"\napi_key_env = "EQUIROUTE_SDK_MOCK_KEY"\nmax_tokens = 1000',
    ),
    "gemini": ("gemini-2.5-flash", 'base_url = "http://{mock}/v1beta"\napi_key_env = "EQUIROUTE_SDK_MOCK_KEY"'),
    "bedrock": ("anthropic.claude-sonnet-4-5-20250929-v1:0", 'region = "us-east-1"\nbase_url = "http://{mock}"'),
}
DIALECTS = list(PROVIDERS)

INTERFACE = """
[interfaces.{kind}]
kind = "chat"
policy = {{ name = "static", candidate = "{kind}" }}
[[interfaces.{kind}.providers]]
id = "{kind}"
kind = "{kind}"
model = "{model}"
{rest}
"""


def config(mock):
    return "".join(
        INTERFACE.format(kind=kind, model=model, rest=rest.format(mock=mock)) for kind, (model, rest) in PROVIDERS.items()
    )


# What each dialect cannot express (the gateway answers 400 and sends nothing).
REFUSED = {"anthropic": {"json_mode", "json_schema"}, "bedrock": {"json_mode", "json_schema"}}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# A 1×1 PNG.
PIXEL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)

# (name, the `chat.completions.create` arguments but `model`)
CASES = [
    ("plain", {"messages": [{"role": "user", "content": "hi"}]}),
    ("system", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}),
    (
        "multi_turn",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "name a colour"},
                {"role": "assistant", "content": "blue"},
                {"role": "user", "content": "another one"},
            ]
        },
    ),
    (
        "json_mode",
        {
            "messages": [{"role": "user", "content": "a colour as JSON"}],
            "response_format": {"type": "json_object"},
        },
    ),
    (
        "json_schema",
        {
            "messages": [{"role": "user", "content": "a colour"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "colour",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                        "additionalProperties": False,
                    },
                },
            },
        },
    ),
    (
        "image",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is in this picture?"},
                        {"type": "image_url", "image_url": {"url": PIXEL}},
                    ],
                }
            ]
        },
    ),
    (
        "sampling",
        {
            "messages": [{"role": "user", "content": "count to ten"}],
            "max_tokens": 50,
            "temperature": 0.2,
            "top_p": 0.9,
            "stop": ["END", "STOP"],
        },
    ),
    (
        "stream",
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 40,
        },
    ),
    (
        "tool_choice_named",
        {
            "messages": [{"role": "user", "content": "the weather in paris?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
]
# The tool round trip (a call, then its result) is its own check: the second request carries
# the call the first answer made (its id as the gateway gave it).


# --- validators: each raises on a body its SDK's types refuse ------------------------------------

def forbid_extras(package):
    """The SDK's request types are TypedDicts, which pydantic lets carry unknown keys: refuse
    them, as the API does."""
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # a module needing an optional dependency
            continue
        for v in vars(module).values():
            ours = isinstance(v, type) and is_typeddict(v) and v.__module__.startswith(package.__name__)
            if ours and "__pydantic_config__" not in v.__dict__:
                v.__pydantic_config__ = {"extra": "forbid"}


def exhaust(value):
    """pydantic validates an `Iterable[...]` member lazily, as it is read: read it all."""
    if isinstance(value, dict):
        for v in value.values():
            exhaust(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            exhaust(v)
    elif isinstance(value, collections.abc.Iterator):
        for v in value:
            exhaust(v)


class Validators:
    def __init__(self):
        forbid_extras(openai.types)
        forbid_extras(anthropic.types)
        from anthropic.types import message_create_params as amc
        from openai.types.chat import completion_create_params as occ

        self.openai = {
            False: pydantic.TypeAdapter(occ.CompletionCreateParamsNonStreaming),
            True: pydantic.TypeAdapter(occ.CompletionCreateParamsStreaming),
        }
        self.anthropic = {
            False: pydantic.TypeAdapter(amc.MessageCreateParamsNonStreaming),
            True: pydantic.TypeAdapter(amc.MessageCreateParamsStreaming),
        }
        model = botocore.session.get_session().get_service_model("bedrock-runtime")
        self.converse = {
            "converse": model.operation_model("Converse").input_shape,
            "converse-stream": model.operation_model("ConverseStream").input_shape,
        }
        self.counts = collections.Counter()

    def validate(self, sent):
        dialect, path, body = sent["dialect"], sent["path"], sent["body"]
        assert not sent["truncated"] and isinstance(body, dict), sent
        if dialect in ("openai", "azure_openai"):
            # Azure names the model in its URL; the body's `model` is optional there.
            body = dict(body, model=body.get("model", "prod-4o")) if dialect == "azure_openai" else body
            exhaust(self.openai[bool(body.get("stream"))].validate_python(body))
            self.counts["openai (ChatCompletion create params)"] += 1
        elif dialect == "anthropic":
            exhaust(self.anthropic[bool(body.get("stream"))].validate_python(body))
            self.counts["anthropic (MessageCreateParams)"] += 1
        elif dialect == "gemini":
            self.validate_gemini(path, body)
            self.counts["google-genai (Content, GenerateContentConfig)"] += 1
        elif dialect == "bedrock":
            # /model/{modelId}/converse[-stream]: the body is the rest of the input shape.
            _, _, model_id, method = path.split("?")[0].split("/")
            params = dict(body, modelId=urllib.parse.unquote(model_id))
            validate_parameters(params, self.converse[method])
            self.counts["botocore bedrock-runtime (Converse input)"] += 1
        else:
            raise AssertionError(f"no validator for {dialect}")

    @staticmethod
    def validate_gemini(path, body):
        # The REST body: `contents` and the members that sit beside `generationConfig`; the
        # SDK's one `GenerateContentConfig` holds both (its JSON names are the REST's camelCase).
        beside = {"systemInstruction", "tools", "toolConfig", "safetySettings", "cachedContent"}
        unknown = set(body) - beside - {"contents", "generationConfig"}
        assert not unknown, f"members a Gemini request has not: {unknown}"
        generation = body.get("generationConfig", {})
        misplaced = set(generation) & beside
        assert not misplaced, f"members of the request's top level inside generationConfig: {misplaced}"
        method = path.split("?")[0].rsplit(":", 1)[1]
        assert method in ("generateContent", "streamGenerateContent"), path
        assert (method == "streamGenerateContent") == ("alt=sse" in path), path
        for content in body["contents"]:
            genai_types.Content.model_validate_json(json.dumps(content))
        config = dict(generation, **{k: v for k, v in body.items() if k in beside})
        genai_types.GenerateContentConfig.model_validate_json(json.dumps(config))


# --- the checks ----------------------------------------------------------------------------------

def check_validators_refuse(validators):
    """Each validator refuses a body its API would: the checks below cannot pass by accident."""
    bad = [
        {"dialect": "openai", "path": "/v1/chat/completions", "body": {"model": "m", "messages": [], "max_output_tokens": 5}},
        {"dialect": "anthropic", "path": "/v1/messages", "body": {"model": "m", "max_tokens": 5, "messages": [], "stop": ["x"]}},
        {"dialect": "gemini", "path": "/v1beta/models/m:generateContent", "body": {"contents": [], "generationConfig": {"maxTokens": 5}}},
        {"dialect": "bedrock", "path": "/model/m/converse", "body": {"messages": [], "inferenceConfig": {"max_tokens": 5}}},
    ]
    counts = validators.counts.copy()
    for sent in bad:
        try:
            validators.validate(dict(sent, truncated=False))
        except Exception:
            continue
        raise AssertionError(f"the {sent['dialect']} validator took {sent['body']}")
    validators.counts = counts

def sent_since(mock_base, before):
    with urllib.request.urlopen(f"{mock_base}/_requests", timeout=10) as r:
        requests = json.load(r)["requests"]
    return requests[before:] if before is not None else requests


def call(client, dialect, args):
    """The request through the gateway; returns the answer (a stream read to its end)."""
    if args.get("stream"):
        chunks = list(client.chat.completions.create(model=dialect, **args))
        assert chunks and {c.model for c in chunks} == {PROVIDERS[dialect][0]}, chunks
        return chunks
    answer = client.chat.completions.create(model=dialect, **args)
    assert answer.model == PROVIDERS[dialect][0], answer
    return answer


def check_case(client, mock_base, validators, dialect, name, args):
    before = len(sent_since(mock_base, None))
    if name in REFUSED.get(dialect, ()):
        try:
            call(client, dialect, args)
        except openai.BadRequestError:
            pass
        else:
            raise AssertionError(f"{dialect} cannot express {name}: expected a 400")
        assert sent_since(mock_base, before) == [], "nothing is sent to a provider that cannot express it"
        return
    call(client, dialect, args)
    sent = sent_since(mock_base, before)
    assert len(sent) == 1 and sent[0]["dialect"] == dialect, sent
    validators.validate(sent[0])


def check_tool_round_trip(client, mock_base, validators, dialect):
    before = len(sent_since(mock_base, None))
    history = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "the weather in paris?"}]
    first = client.chat.completions.create(model=dialect, messages=history, tools=[WEATHER], tool_choice="auto")
    calls = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and calls, first
    history.append(first.choices[0].message.model_dump(exclude_none=True))
    for c in calls:
        history.append({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"})
    second = client.chat.completions.create(model=dialect, messages=history, tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop", second
    sent = sent_since(mock_base, before)
    assert len(sent) == 2, sent
    for s in sent:
        validators.validate(s)


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/equiroute"
    work = tempfile.mkdtemp(prefix="equiroute-sdk-bodies-")
    env = dict(
        os.environ,
        XDG_STATE_HOME=work,
        EQUIROUTE_SDK_MOCK_KEY="mock-key",
        AWS_ACCESS_KEY_ID="AKIDEXAMPLE",
        AWS_SECRET_ACCESS_KEY="wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
    )
    env.pop("AWS_SESSION_TOKEN", None)
    procs = []
    failed = 1
    try:
        mock_addr, addr = mock_and_gateway(binary, config, env, work, procs)
        mock_base = f"http://{mock_addr}"
        client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0)
        validators = Validators()
        named = [("the validators refuse bad bodies", lambda: check_validators_refuse(validators))] + [
            (f"{name} via {dialect}", lambda d=dialect, n=name, a=args: check_case(client, mock_base, validators, d, n, a))
            for dialect in DIALECTS
            for name, args in CASES
        ] + [
            (f"tool_round_trip via {dialect}", lambda d=dialect: check_tool_round_trip(client, mock_base, validators, d))
            for dialect in DIALECTS
        ]
        failed = run_checks(named, "provider bodies against the SDKs' request types")
        for validator, n in sorted(validators.counts.items()):
            print(f"  {validator}: {n} bodies valid")
        if len(validators.counts) != 4:
            print("FAILED: a validator validated no body")
            failed += 1
    finally:
        stop(procs, work)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
