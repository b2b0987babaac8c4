#!/usr/bin/env python3
"""Tool-call chat fixtures for text/chat_template (tests/engine/chat_template_test.cc, "tools"):
renders a vendor template over conversations with tools, assistant tool calls and tool results
with transformers' own renderer (render_jinja_template, as make_chat_fixtures.py does) and writes
tests/fixtures/chat-tools/<name>.json: the template, and per case the tools, the messages, the
keyword arguments and the expected text (or the template's error). Tool call arguments are JSON
strings, as OpenAI's API carries them. Deterministic.

Run with a Python that has jinja2 and transformers (e.g. /tmp/refvenv/bin/python):
  make_tool_fixtures.py --templates <llama.cpp>/models/templates --out tests/fixtures/chat-tools
"""
import argparse
import json
import os

from transformers.utils.chat_template_utils import render_jinja_template

# strftime_now's date (gpt-oss's "Current date: ..."): make_chat_fixtures fixes it when imported,
# and the fixture records it as "date" for the test to pass to ChatTemplate::with_date.
from make_chat_fixtures import FIXED_DATE

# name: (template file, bos, eos, whether tool call arguments go in as objects: GLM's, gpt-oss's
# and DeepSeek's templates iterate them or write them with tojson, which would quote a string, so
# a server parses them first, as vLLM does)
TEMPLATES = {"qwen3": ("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>", False),
             "glm4.5": ("GLM-4.6.jinja", "[gMASK]", "<|endoftext|>", True),
             "gpt-oss": ("openai-gpt-oss-120b.jinja", "<|startoftext|>", "<|return|>", True),
             "deepseek3": ("deepseek-ai-DeepSeek-V3.1.jinja", "<｜begin▁of▁sentence｜>",
                           "<｜end▁of▁sentence｜>", True),
             "deepseek4": ("deepseek-ai-DeepSeek-V4.jinja", "<｜begin▁of▁sentence｜>",
                           "<｜end▁of▁sentence｜>", True),
             "deepseek4-flash": ("deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
                                 "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", True),
             "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>", True),
             "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "<s>", "</s>",
                                   True)}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C, «unicode» kept)",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "exact": {"type": "boolean"},
        "filters": {"type": "array", "items": {"type": "string"}}},
        "required": ["q"], "additionalProperties": False}}}
# A schema with every kind of parameter type that gpt-oss's template writes as TypeScript.
PLAN = {"type": "function", "function": {
    "name": "plan_trip", "description": "Plan a trip",
    "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "description": "Labels"},
        "scores": {"type": "array", "items": {"type": "number"}},
        "counts": {"type": "array", "items": {"type": "integer"}, "nullable": True},
        "flags": {"type": "array", "items": {"type": "boolean"}},
        "stops": {"type": "array", "items": {"type": "object", "properties": {
            "city": {"type": "string"}, "nights": {"type": "integer"}}, "required": ["city"]}},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "anything": {"type": "array"},
        "blobs": {"type": "array", "items": {"type": "object"}},
        "mode": {"type": "string", "enum": ["fast", "cheap"], "default": "fast"},
        "note": {"type": "string", "nullable": True, "default": "none"},
        "budget": {"type": "number", "default": 100.5, "description": "Euros"},
        "either": {"type": ["string", "integer"]},
        "single": {"type": ["boolean"]},
        "one": {"oneOf": [{"type": "string", "description": "a name"},
                          {"type": "integer", "default": 3}]},
        "shape": {"oneOf": [{"type": "object"}, {"type": "string"}]},
        "obj": {"type": "object"},
        "nested": {"type": "object", "properties": {
            "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "string"}},
            "c": {"type": "object", "properties": {"d": {"type": "boolean"}}}},
            "required": ["a"]},
        "free": {"description": "Anything at all"}},
        "required": ["tags", "mode"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time",
                                        "parameters": {"type": "object", "properties": {}}}}
BARE = {"type": "function", "function": {"name": "ping", "description": "Ping"}}


# Call ids of 9 alphanumeric characters, as Mistral's templates require (the others do not write
# them).
def call(name, args, cid="call00001"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def cases():
    u = {"role": "user", "content": "What is the weather in Paris?"}
    s = {"role": "system", "content": "You are terse."}
    a_call = {"role": "assistant", "content": "",
              "tool_calls": [call("get_weather", '{"city": "Paris", "unit": "c"}')]}
    tool = {"role": "tool", "tool_call_id": "call00001", "content": '{"temp": 21, "sky": "clear"}'}
    two = {"role": "assistant", "content": "Let me check both.",
           "tool_calls": [call("get_weather", '{"city":"Paris"}', "call00001"),
                          call("search", '{"q": "Paris events", "filters": ["today"]}', "call00002")]}
    t1 = {"role": "tool", "tool_call_id": "call00001", "content": "21 C"}
    t2 = {"role": "tool", "tool_call_id": "call00002", "content": "A concert at 8 pm."}
    final = {"role": "assistant", "content": "It is 21 C; a concert at 8 pm."}
    thought = {"role": "assistant", "content": "<think>\nThe user wants weather.\n</think>\n\n",
               "tool_calls": [call("get_weather", '{"city": "Oslo"}')]}
    # Arguments of every JSON type, and none.
    typed = {"role": "assistant", "content": "",
             "tool_calls": [call("get_weather", '{"city": "Oslo", "days": 3}', "call00001"),
                            call("now", "{}", "call00002")]}
    tools1, tools2 = [WEATHER], [WEATHER, SEARCH]
    out = []
    for gen in (True, False):
        out += [
            (tools1, [u], gen, None),
            (tools2, [s, u], gen, None),
            (tools1, [u, a_call, tool], gen, None),
            (tools2, [s, u, two, t1, t2, final], gen, None),
            (tools2, [u, two, t1, t2, final, {"role": "user", "content": "Thanks!"}], gen, None),
            (None, [u, a_call, tool], gen, None),
            (tools1, [u, thought, tool], gen, None),
            (tools1, [u, a_call, tool], gen, {"enable_thinking": False}),
            (tools2, [s, u, two, t1], gen, {"enable_thinking": True}),
            ([PLAN, NOW, BARE], [s, u], gen, None),
            (tools1, [u, tool], gen, None),
            (tools2, [u, two, t1, t2], gen, {"reasoning_effort": "high"}),
            ([WEATHER, NOW], [u, typed, t1, t2], gen, {"thinking": True}),
            (tools1, [u, dict(a_call, tool_calls=[call("get_weather", "{}", "call_1")]),
                      dict(tool, tool_call_id="call_1")], gen, None),
        ]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--templates", required=True)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                  "../../tests/fixtures/chat-tools"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, (src, bos, eos, objects) in TEMPLATES.items():
        text = open(os.path.join(args.templates, src)).read()
        doc = {"name": name, "source": f"llama.cpp models/templates/{src}", "template": text,
               "bos": bos, "eos": eos, "cases": []}
        if "strftime_now" in text:
            doc["date"] = FIXED_DATE.strftime("%Y-%m-%d")
        for tools, messages, gen, kwargs in cases():
            case = {"tools": tools, "messages": messages, "add_generation_prompt": gen}
            if objects:
                messages = json.loads(json.dumps(messages))
                for m in messages:
                    for tc in m.get("tool_calls", []):
                        tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
            if kwargs is not None:
                case["kwargs"] = kwargs
            try:
                rendered = render_jinja_template(conversations=[messages], tools=tools,
                                                 chat_template=text, add_generation_prompt=gen,
                                                 bos_token=bos, eos_token=eos, **(kwargs or {}))
                case["output"] = rendered[0][0]
            except Exception as e:
                case["error"] = str(e)
            doc["cases"].append(case)
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"{name}: {len(doc['cases'])} cases")


if __name__ == "__main__":
    main()
