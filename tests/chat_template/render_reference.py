#!/usr/bin/env python3
"""Renders every (template, conversation) pair of cases.json with Jinja2 configured as Hugging Face's
apply_chat_template configures it, into one JSON file of expected outputs that test_chat_template
compares the C++ renderer against, byte for byte.

The environment mirrors transformers' chat template compilation (transformers/utils/chat_template_utils.py):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols]),
a tojson
filter that is json.dumps (no HTML escaping, ensure_ascii=False by default, indent/separators/sort_keys
passed through), and the globals raise_exception (raises TemplateError with the template's message) and
strftime_now (here pinned to the manifest's "now", so the output is reproducible). The render call
passes what apply_chat_template passes: messages, tools (None when absent), documents=None,
add_generation_prompt, the tokenizer's special tokens, then the conversation's extra keys.

Usage: render_reference.py --out expected.json
"""
import argparse
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))


class GenerationTag(Extension):
    """{% generation %}...{% endgeneration %}: transformers' AssistantTracker tag. It marks assistant text
    for return_assistant_tokens_mask; the rendered text is the body's, run as a call block."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_env(now):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.fromtimestamp(now).strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    manifest = read_json(os.path.join(HERE, "cases.json"))
    env = make_env(manifest["now"])
    cases = []
    for t in manifest["templates"]:
        # newline="" keeps the file's bytes; Jinja2 normalizes newlines itself.
        with open(os.path.join(HERE, "templates", t["file"]), encoding="utf-8", newline="") as f:
            template = env.from_string(f.read())
        for conv_file in manifest["conversations"]:
            conv = read_json(os.path.join(HERE, "conversations", conv_file))
            extra = {k: v for k, v in conv.items() if k not in ("messages", "tools", "add_generation_prompt")}
            for add_generation_prompt in (False, True):
                kwargs = dict(t.get("special_tokens", {}))
                kwargs.update(extra)
                case = {
                    "template": t["file"],
                    "conversation": conv_file,
                    "add_generation_prompt": add_generation_prompt,
                }
                try:
                    case["output"] = template.render(
                        messages=conv["messages"],
                        tools=conv.get("tools"),
                        documents=None,
                        add_generation_prompt=add_generation_prompt,
                        **kwargs,
                    )
                except Exception as e:  # the C++ renderer must fail on the same pairs
                    case["error"] = f"{type(e).__name__}: {e}"
                    case["raised_by_template"] = type(e) is jinja2.exceptions.TemplateError
                cases.append(case)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"jinja2_version": jinja2.__version__, "cases": cases}, f, ensure_ascii=False, indent=1)
    errors = sum("error" in c for c in cases)
    print(f"rendered {len(cases)} cases with Jinja2 {jinja2.__version__} ({errors} raise an error)", file=sys.stderr)


if __name__ == "__main__":
    main()
