#include "text/preset_text.h"

namespace tpmoe::text {

std::string preset_chat_template() {
  // Written for this project (not copied): the layout MiniMax's released templates produce, minus
  // tool calls.
  return R"({{- bos_token -}}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
]~b]system
{{ message.content }}[e~[
{% elif message.role == 'user' -%}
]~b]user
{{ message.content }}[e~[
{% elif message.role == 'assistant' -%}
]~b]ai
{{ message.content }}[e~[
{% else -%}
{{- raise_exception('unsupported message role: ' ~ message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
]~b]ai
<think>
{% endif -%}
)";
}

nlohmann::ordered_json preset_special_tokens() {
  return {{"bos_token", "]~!b["}, {"eos_token", "[e~["}, {"pad_token", "]!p~["}};
}

}  // namespace tpmoe::text
