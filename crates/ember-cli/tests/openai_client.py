"""The official `openai` Python client against `ember serve` (run by tests/serve.rs).

argv: BASE_URL of the demo model, BASE_URL of a `--script` server (fixed tool-call output),
API key. Prints ALL OK on success; any failed assert exits non-zero.
"""
import json
import sys

import openai

model_url, script_url, key = sys.argv[1], sys.argv[2], sys.argv[3]

# Chat, non-streaming and streaming with the same seed give the same text. `ignore_eos` (the
# llama-server / vLLM extension, through the client's extra_body): the demo model's random
# weights sample an end token early on some hosts (the AVX2 and AVX-512 kernels sum in other
# orders), and these checks want max_tokens to end the text.
client = openai.OpenAI(base_url=model_url, api_key=key)
model = client.models.list().data[0].id
messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
full = client.chat.completions.create(model=model, messages=messages, max_tokens=24, seed=3, temperature=0.9,
                                      extra_body={"ignore_eos": True})
choice = full.choices[0]
assert choice.finish_reason == "length", choice.finish_reason
assert full.usage.completion_tokens == 24 and full.usage.total_tokens == full.usage.prompt_tokens + 24, full.usage
extra = choice.message.model_extra or {}
want = (extra.get("reasoning_content") or "") + (choice.message.content or "")

stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24, seed=3, temperature=0.9,
                                        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
got, finish, usage = "", None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        d = c.delta
        got += ((d.model_extra or {}).get("reasoning_content") or "") + (d.content or "")
        finish = c.finish_reason or finish
assert got == want, (got, want)
assert finish == "length" and usage.completion_tokens == 24, (finish, usage)

# Completions.
comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, seed=1, extra_body={"ignore_eos": True})
assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 8

# Errors surface as the client's typed exceptions.
try:
    client.chat.completions.create(model="no-such-model", messages=messages)
    raise AssertionError("expected NotFoundError")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
try:
    client.chat.completions.create(model=model, messages=messages, temperature=5)
    raise AssertionError("expected BadRequestError")
except openai.BadRequestError as e:
    assert e.body["param"] == "temperature", e.body
try:
    openai.OpenAI(base_url=model_url, api_key="wrong").models.list()
    raise AssertionError("expected AuthenticationError")
except openai.AuthenticationError:
    pass

# Tools, against the scripted server: two calls with typed arguments, streamed and not.
tools = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}},
]
sc = openai.OpenAI(base_url=script_url, api_key=key)
q = [{"role": "user", "content": "Weather in Paris?"}]
r = sc.chat.completions.create(model=model, messages=q, tools=tools)
m = r.choices[0].message
assert r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason
assert [c.function.name for c in m.tool_calls] == ["get_weather", "get_time"], m.tool_calls
assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
assert (m.model_extra or {}).get("reasoning_content") == "Let me check."

calls = {}
finish = None
for chunk in sc.chat.completions.create(model=model, messages=q, tools=tools, stream=True):
    for c in chunk.choices:
        finish = c.finish_reason or finish
        for tc in c.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "args": ""})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["args"] += tc.function.arguments
assert finish == "tool_calls", finish
assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"], calls
assert json.loads(calls[0]["args"]) == {"city": "Paris", "days": 3}, calls
assert all(c["id"] for c in calls.values())

# A follow-up turn with the calls and their results in the history is accepted.
history = q + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
        for tc in m.tool_calls]},
    {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"},
    {"role": "tool", "tool_call_id": m.tool_calls[1].id, "content": "12:00"},
]
r2 = sc.chat.completions.create(model=model, messages=history, tools=tools)
assert r2.choices[0].message.tool_calls

print("ALL OK")
