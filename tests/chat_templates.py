"""Chat templates written for these tests, modelled on behaviours of real model families: a system message folded
into the last user message (as Mistral's instruct templates do), in two spacing styles, reasoning that is
kept only in the answer to the last question (as Qwen3's template does), Gemma's turns (the system text
opening the first user turn, the assistant's role rendered as "model") and Phi-3's (every role its own turn,
closed by <|end|>, and an end-of-text token after the whole conversation)."""

# [INST]-style turns without a system turn: the system text opens the last user message, so the render of a
# conversation cut before an earlier answer (where that earlier question was the last) is not a prefix of the
# whole render. The answer line is the one tests wrap in {% generation %}.
LAST_USER_SYSTEM = r"""{%- set has_system = messages[0].role == "system" %}
{%- set turns = messages[1:] if has_system else messages %}
{%- set last = namespace(user=-1) %}
{%- for m in turns %}
    {%- if m.role != ["user", "assistant"][loop.index0 % 2] %}
        {{- raise_exception("expected alternating user and assistant messages after the system message") }}
    {%- endif %}
    {%- if m.role == "user" %}
        {%- set last.user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for m in turns %}
    {%- if m.role == "assistant" %}
        {{- " " ~ m.content | trim ~ eos_token }}
    {%- elif has_system and loop.index0 == last.user %}
        {{- "[INST] " ~ messages[0].content ~ "\n\n" ~ m.content ~ "[/INST]" }}
    {%- else %}
        {{- "[INST] " ~ m.content ~ "[/INST]" }}
    {%- endif %}
{%- endfor %}
"""

# The same folding with tight spacing: nothing between [INST], the question, [/INST] and the answer, which is
# written as given (not trimmed).
LAST_USER_SYSTEM_TIGHT = r"""{%- set system = messages[0].content if messages[0].role == "system" else none %}
{%- set turns = messages[1:] if system is not none else messages %}
{%- set n_users = turns | selectattr("role", "equalto", "user") | list | length %}
{%- set seen = namespace(users=0, expect="user") %}
{{- bos_token }}
{%- for m in turns %}
    {%- if m.role != seen.expect %}
        {{- raise_exception("expected alternating user and assistant messages after the system message") }}
    {%- elif m.role == "user" %}
        {%- set seen.users = seen.users + 1 %}
        {%- set seen.expect = "assistant" %}
        {{- "[INST]" }}
        {%- if system is not none and seen.users == n_users %}
            {{- system ~ "\n\n" }}
        {%- endif %}
        {{- m.content ~ "[/INST]" }}
    {%- else %}
        {%- set seen.expect = "user" %}
        {{- m.content ~ eos_token }}
    {%- endif %}
{%- endfor %}
"""

# ChatML turns for a reasoning model. Answers before the last user message lose their <think>...</think> part
# (only the stripped text after </think> stays); the answer after it always shows a think block, an empty one
# when the message has no reasoning. Tools, when given, are listed in the system turn.
REASONING = r"""{%- set has_system = messages[0].role == "system" %}
{%- if tools or has_system %}
    {{- "<|im_start|>system\n" }}
    {%- if has_system %}
        {{- messages[0].content }}
    {%- endif %}
    {%- if tools %}
        {{- ("\n\n" if has_system else "") ~ "Tools you can call (JSON schemas, one per line):" }}
        {%- for tool in tools %}
            {{- "\n" ~ tool | tojson }}
        {%- endfor %}
    {%- endif %}
    {{- "<|im_end|>\n" }}
{%- endif %}
{%- set last = namespace(user=-1) %}
{%- for m in messages %}
    {%- if m.role == "user" %}
        {%- set last.user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role != "assistant" %}
        {%- if not (loop.first and has_system) %}
            {{- "<|im_start|>" ~ m.role ~ "\n" ~ m.content ~ "<|im_end|>\n" }}
        {%- endif %}
    {%- else %}
        {%- set parts = m.content.split("</think>") %}
        {%- set reasoning = parts[0].replace("<think>", "").strip() if parts | length > 1 else "" %}
        {%- set answer = parts[-1].strip() if parts | length > 1 else m.content %}
        {{- "<|im_start|>assistant\n" }}
        {%- if loop.index0 > last.user %}
            {{- "<think>\n" ~ reasoning ~ "\n</think>\n\n" }}
        {%- endif %}
        {{- answer ~ "<|im_end|>\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\n" }}
{%- endif %}
"""


# Gemma-style turns: <start_of_turn>user / model ... <end_of_turn>, the system message prepended to the first
# user turn. The answer line (up to the turn's end, without the newline after it) is the one tests wrap in
# {% generation %}.
GEMMA = r"""{{- bos_token }}
{%- set first = namespace(user=true) %}
{%- set system = messages[0].content ~ "\n\n" if messages[0].role == "system" else "" %}
{%- for m in (messages[1:] if system else messages) %}
    {%- if m.role == "assistant" %}
        {{- "<start_of_turn>model\n" }}
        {{- m.content | trim ~ "<end_of_turn>" }}
        {{- "\n" }}
    {%- else %}
        {{- "<start_of_turn>user\n" ~ (system if first.user else "") ~ m.content | trim ~ "<end_of_turn>\n" }}
        {%- set first.user = false %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<start_of_turn>model\n" }}{%- endif %}
"""


# Phi-3-style turns: <|system|>, <|user|>, <|assistant|>, each closed by <|end|> and a newline; the render of a
# whole conversation (no generation prompt) ends with eos_token, outside every turn. The answer line (the
# content and its <|end|>) is the one tests wrap in {% generation %}.
PHI3 = r"""{%- for m in messages %}
    {%- if m.role == "assistant" %}
        {{- "<|assistant|>\n" }}
        {{- m.content ~ "<|end|>" }}
        {{- "\n" }}
    {%- else %}
        {{- "<|" ~ m.role ~ "|>\n" ~ m.content ~ "<|end|>\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|assistant|>\n" }}{%- else %}{{- eos_token }}{%- endif %}
"""
