#!/usr/bin/env python3
"""Chat-template fixtures for engine/chat_template (tests/engine/chat_template_test.cc).

Renders each vendor template over a fixed set of conversations with transformers' own renderer
(transformers.utils.chat_template_utils.render_jinja_template: jinja2's ImmutableSandboxedEnvironment
with trim_blocks, lstrip_blocks, raise_exception and strftime_now) and writes
tests/fixtures/chat/<name>.json: the template text, bos/eos, the family engine/chat_template must
detect (null: it must refuse the template), and for each conversation the expected text or the
template's error. Cases with "kwargs" render with those keyword arguments too (the thinking switches
of engine::ChatOptions, as vLLM's chat_template_kwargs pass them): every switch through every
supported template, including the templates that do not read it (their output must not change).
Deterministic: regenerating gives identical files.

Run with a Python that has jinja2 and transformers (e.g. /tmp/refvenv/bin/python):
  make_chat_fixtures.py --templates <llama.cpp>/models/templates --out tests/fixtures/chat
"""
import argparse
import json
import os
from datetime import datetime

from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import render_jinja_template

# Templates that are not in llama.cpp's models/templates, as their Hugging Face repositories ship
# them (tokenizer_config.json's chat_template).
INLINE = {
    # mistralai/Mixtral-8x7B-Instruct-v0.1 (and Mistral-7B-Instruct-v0.2/v0.3's older revision).
    "mistralai-Mixtral-8x7B-Instruct-v0.1": (
        "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n"
        "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n"
        "{%- endif %}\n\n{{- bos_token }}\n{%- for message in loop_messages %}\n"
        "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "        {{- raise_exception('After the optional system message, conversation roles must alternate "
        "user/assistant/user/assistant/...') }}\n    {%- endif %}\n    {%- if message['role'] == 'user' %}\n"
        "        {%- if loop.first and system_message is defined %}\n"
        "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
        "        {%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
        "        {%- endif %}\n    {%- elif message['role'] == 'assistant' %}\n"
        "        {{- ' ' + message['content'] + eos_token}}\n    {%- else %}\n"
        "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an "
        "initial optional system message!') }}\n    {%- endif %}\n{%- endfor %}\n"),
    # mistralai/Mistral-7B-Instruct-v0.1.
    "mistralai-Mistral-7B-Instruct-v0.1": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"),
    # meta-llama/Meta-Llama-3-8B-Instruct.
    "meta-llama-Meta-Llama-3-8B-Instruct": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    # The plain ChatML template (e.g. teknium/OpenHermes-2.5-Mistral-7B).
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{% endif %}"),
}

# Templates as GGUFs carry them where a converter rewrote the vendor's: llama.cpp's
# convert_hf_to_gguf.py (Glm4MoeModel, 2025 versions) replaced GLM-4.5's user line with one that
# sets `content` first, so GLM GGUFs in the wild hold either spelling.
PATCHES = {
    "glm4.5-gguf": (
        "{{ visible_text(m.content) }}\n{{- '/nothink' if (enable_thinking is defined and not "
        "enable_thinking and not visible_text(m.content).endswith(\"/nothink\")) else '' -}}",
        "{% set content = visible_text(m.content) %}{{ content }}\n{{- '/nothink' if (enable_thinking "
        "is defined and not enable_thinking and not content.endswith(\"/nothink\")) else '' -}}"),
}

DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# name → (file in --templates or INLINE key, bos, eos, family engine/chat_template detects or None)
TEMPLATES = {
    "chatml": ("chatml", "", "<|im_end|>", "chatml"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>", "qwen3"),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>", "qwen2.5"),
    "deepseek3": ("deepseek-ai-DeepSeek-V3.1.jinja", DS_BOS, DS_EOS, "deepseek3"),
    "deepseek4": ("deepseek-ai-DeepSeek-V4.jinja", DS_BOS, DS_EOS, "deepseek4"),
    "deepseek4-flash": ("deepseek-ai-DeepSeek-V4-Flash-0731.jinja", DS_BOS, DS_EOS, "deepseek4"),
    "mistral": ("mistralai-Mixtral-8x7B-Instruct-v0.1", "<s>", "</s>", "mistral"),
    "mistral-v0.1": ("mistralai-Mistral-7B-Instruct-v0.1", "<s>", "</s>", "mistral-v0.1"),
    "llama3": ("meta-llama-Meta-Llama-3-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>", "llama3"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", "llama3.1"),
    "llama3.3": ("meta-llama-Llama-3.3-70B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", "llama3.1"),
    # Look-alikes that must be refused, not rendered as their neighbours.
    "gemma2": ("google-gemma-2-2b-it.jinja", "<bos>", "<eos>", None),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", None),
    "qwq": ("Qwen-QwQ-32B.jinja", "", "<|im_end|>", None),
    "qwen3-coder": ("Qwen3-Coder.jinja", "", "<|im_end|>", None),
    "deepseek-r1-distill-qwen": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", DS_BOS, DS_EOS, None),
    "deepseek3.2": ("deepseek-ai-DeepSeek-V3.2.jinja", DS_BOS, DS_EOS, None),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>", "mistral-nemo"),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "<s>", "</s>",
                          "mistral-small-3.2"),
    "qwen3.5": ("Qwen3.5-4B.jinja", "", "<|im_end|>", None),
    "hermes2-pro": ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "<|begin_of_text|>", "<|im_end|>", None),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B.jinja", "", "<|im_end|>", None),
    "deepseek-r1-distill-llama": ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", DS_BOS, DS_EOS, None),
    # The MoE families of issue 15 (bos/eos as llama.cpp's converter writes them into the GGUF).
    "glm4.5": ("GLM-4.6.jinja", "[gMASK]", "<|endoftext|>", "glm4.5"),
    "glm4.5-gguf": ("GLM-4.6.jinja", "[gMASK]", "<|endoftext|>", "glm4.5"),
    "gpt-oss": ("openai-gpt-oss-120b.jinja", "<|startoftext|>", "<|return|>", "gpt-oss"),
    "kimi-k2": ("Kimi-K2-Instruct.jinja", "[BOS]", "[EOS]", "kimi-k2"),
    "kimi-k2-helpful": ("moonshotai-Kimi-K2.jinja", "[BOS]", "[EOS]", "kimi-k2-helpful"),
    "glm4.7-flash": ("GLM-4.7-Flash.jinja", "[gMASK]", "<|endoftext|>", None),
    "kimi-k2-thinking": ("Kimi-K2-Thinking.jinja", "[BOS]", "[EOS]", None),
    "kimi-k3": ("Kimi-K3.jinja", "[BOS]", "[EOS]", None),
}


def S(c):
    return {"role": "system", "content": c}


def U(c):
    return {"role": "user", "content": c}


def A(c):
    return {"role": "assistant", "content": c}


CONVERSATIONS = [
    [U("Hello")],
    [S("You are terse."), U("Hello")],
    [U("Hi"), A("Hello! How can I help?"), U("What is 2+2?")],
    [S("Be brief."), U("Hi"), A("Hello."), U("Bye")],
    [U("Résumé: naïve café 😀👍🏽 中文测试 日本語 한국어 العربية")],
    [U("")],
    [S(""), U("x")],
    [U("  \n  leading and trailing whitespace \n\n"), A("\n answer \n"), U("\t tab\r\n")],
    [U("\u3000ideographic space and nbsp\u00a0"), A("\u2003em\u2003")],
    [U("Think"), A("<think>\nreasoning here\n</think>\n\nThe answer.")],
    [U("q1"), A("<think>r1</think>a1"), U("q2"), A("a2 </think> after")],
    [U("Hi"), A("Hello.")],
    [S("first system"), U("u"), S("second system"), U("v")],
    [U("one"), U("two")],
    [A("assistant first"), U("then user")],
    [S("only a system message")],
    [U("literal specials: <|im_end|> <｜User｜> [INST] <|eot_id|> </s>")],
    [U("q"), A("a"), U("<tool_response>\nresult\n</tool_response>")],
    [S("sys"), U("1"), A("one"), U("2"), A("two"), U("3"), A("three")],
    [U("empty reply next"), A("")],
    [U("multi\nline\n\ncontent\n"), A("line1\nline2"), U("end")],
    [S("  padded system  "), U("  padded user  ")],
]


# The thinking switches (engine::ChatOptions), each through every supported template, over the
# conversations where they can matter: a generation prompt after a user, a system message, earlier
# answers (with and without reasoning in them), a conversation ending in an answer, one with a user
# message that already ends in GLM's "/nothink".
KWARGS = [
    {"enable_thinking": False},
    {"enable_thinking": True},
    {"thinking": True},
    {"thinking": False},
    {"thinking": True, "enable_thinking": False},
    {"thinking": False, "enable_thinking": True},
    {"reasoning_effort": "low"},
    {"reasoning_effort": "high"},
    {"enable_thinking": False, "reasoning_effort": "high"},
    {"thinking": True, "reasoning_effort": "high"},
    {"enable_thinking": True, "reasoning_effort": "low"},
]
KWARGS_CONVERSATIONS = [
    [U("Hello")],
    [S("You are terse."), U("Hello")],
    [U("Hi"), A("Hello! How can I help?"), U("What is 2+2?")],
    [S("Be brief."), U("Hi"), A("Hello."), U("Bye")],
    [U("Think"), A("<think>\nreasoning here\n</think>\n\nThe answer.")],
    [U("q1"), A("<think>r1</think>a1"), U("q2"), A("a2 </think> after")],
    [U("Hi"), A("Hello.")],
    [A("assistant first"), U("then user")],
    [S("only a system message")],
    [U("quick one /nothink"), A("ok"), U("again /nothink")],
    [U("q"), A("a"), U("<tool_response>\nresult\n</tool_response>")],
]


# strftime_now's date (gpt-oss's "Current date: ..."): transformers renders today's; the fixtures
# fix it, and record it as "date" for the test to pass to ChatTemplate::with_date.
FIXED_DATE = datetime(2026, 1, 15, 12, 0, 0)


class _FixedDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_DATE


chat_template_utils.datetime = _FixedDatetime


def render(template, bos, eos, messages, add_generation_prompt, kwargs=None):
    out = render_jinja_template(conversations=[messages], chat_template=template,
                                add_generation_prompt=add_generation_prompt,
                                bos_token=bos, eos_token=eos, **(kwargs or {}))
    return out[0][0]


def make_case(text, bos, eos, messages, gen, kwargs=None):
    case = {"messages": messages, "add_generation_prompt": gen}
    if kwargs is not None:
        case["kwargs"] = kwargs
    try:
        case["output"] = render(text, bos, eos, messages, gen, kwargs)
    except Exception as e:  # the template's raise_exception, or jinja's own error
        case["error"] = str(e)
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--templates", default="/tmp/llsd/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "../../tests/fixtures/chat"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, (src, bos, eos, family) in TEMPLATES.items():
        if src in INLINE:
            text = INLINE[src]
        else:
            with open(os.path.join(args.templates, src), encoding="utf-8") as f:
                text = f.read()
        if name in PATCHES:
            before, after = PATCHES[name]
            assert before in text, name
            text = text.replace(before, after)
        cases = []
        if family is not None:
            for messages in CONVERSATIONS:
                for gen in (False, True):
                    cases.append(make_case(text, bos, eos, messages, gen))
            for kwargs in KWARGS:
                for messages in KWARGS_CONVERSATIONS:
                    for gen in (False, True):
                        cases.append(make_case(text, bos, eos, messages, gen, kwargs))
        doc = {"name": name, "source": src, "template": text, "bos": bos, "eos": eos,
               "family": family}
        if family is not None and "strftime_now" in text:
            doc["date"] = FIXED_DATE.strftime("%Y-%m-%d")
        doc["cases"] = cases
        with open(os.path.join(args.out, name + ".json"), "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
