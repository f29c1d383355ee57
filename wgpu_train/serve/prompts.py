"""Requests -> prompt token ids: chat messages through the chat template (or as raw prompt text, for an adapter
trained without it), completion prompts as text after BOS or as token ids; and the answer's budget within the
model's positions, a prompt past them refused as OpenAI does (400, context_length_exceeded)."""
from __future__ import annotations

from dataclasses import dataclass

from wgpu_train.data.tokenize import generation_prompt_ids
from wgpu_train.errors import WgpuTrainError
from wgpu_train.serve.api_error import ApiError

COMPLETION_TOKENS = 16          # /v1/completions' max_tokens when none is given, as OpenAI's


@dataclass(frozen=True)
class PromptStyle:
    """How a served model (the base or an adapter) is asked, as generate asks it."""

    chat_template: bool = True      # False: the raw prompt text, as finetune --no-chat-template trains
    completions: bool = False       # raw text of an adapter trained on completions data: no separator after it


def chat_prompt_ids(tokenizer, messages: list, style: PromptStyle) -> list[int]:
    """The ids asking for the assistant's answer after `messages`."""
    if not style.chat_template and style.completions:
        messages = messages[:-1] + [{**messages[-1], "raw_separator": ""}]
    try:
        return generation_prompt_ids(tokenizer, messages, style.chat_template)
    except WgpuTrainError as e:          # the template raised (e.g. roles out of its order)
        raise ApiError(400, str(e), "messages", "invalid_value") from None


def image_chat_prompt_ids(tokenizer, vision, messages: list, style: PromptStyle, images: list,
                          plan=None) -> list[int]:
    """The ids asking for the answer after `messages` whose contents list {"type": "image"} parts: the chat
    template's prompt, each image's placeholder expanded to the vision model's (VisionModel) image tokens for
    that image of `images` (decoded: SmolVLM's expansion depends on its size). plan: a request's tools
    (serve/tool_calls.plan_tools'), its prompt (rendered with the tools) expanded so, then its prefill."""
    from wgpu_train.data.vision_records import expand_placeholders, vision_chat_ids

    if not style.chat_template:
        raise ApiError(400, "images need the chat template, and this model is served without it", "messages",
                       "images_not_supported")
    try:
        span = vision.image_span(tokenizer)
        if plan is not None:
            return tokenizer.encode(expand_placeholders(plan.prompt, span, [span.expansion(im) for im in images])
                                    + plan.prefill)
        return vision_chat_ids(tokenizer, messages, len(images), span, images)
    except WgpuTrainError as e:
        raise ApiError(400, str(e), "messages", "invalid_value") from None


def tool_prompt(tokenizer, messages: list, style: PromptStyle, tools: tuple) -> str:
    """The prompt's text with the request's tools rendered by the chat template (a 400 for a model served
    without its chat template, or messages the template refuses)."""
    if not style.chat_template:
        raise ApiError(400, "tools need the chat template, and this model is served without it", "tools",
                       "tools_not_supported")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=list(tools))
    except WgpuTrainError as e:
        raise ApiError(400, str(e), "messages", "invalid_value") from None


def completion_prompt_ids(tokenizer, prompt, vocab_size: int, index: int = 0) -> list[int]:
    """The ids of a completion prompt: text after BOS where the tokenizer adds one, or ids as given."""
    if isinstance(prompt, str):
        ids = ([tokenizer.bos_token_id] if tokenizer.add_bos_token else []) + tokenizer.encode(prompt)
    else:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"prompt {index}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           "prompt", "invalid_value")
        ids = list(prompt)
    if not ids:
        raise ApiError(400, f"prompt {index} is empty", "prompt", "invalid_value")
    return ids


def budget(prompt_tokens: int, asked: int | None, positions: int, default: int | None = None,
           prompt_param: str = "messages") -> int:
    """The answer's most tokens: `asked` (max_tokens), else `default` or what the positions leave, capped to
    them; a 400 when the prompt (the request's `prompt_param`) leaves no room or `asked` does not fit."""
    room = positions - prompt_tokens
    if room < 1:
        raise ApiError(400, f"this model's maximum context length is {positions} tokens, and the prompt has "
                            f"{prompt_tokens}: no room for an answer", prompt_param, "context_length_exceeded")
    if asked is None:
        return min(default, room) if default else room
    if asked > room:
        raise ApiError(400, f"this model's maximum context length is {positions} tokens, and {prompt_tokens + asked} "
                            f"were asked ({prompt_tokens} in the prompt, {asked} in max_tokens)", "max_tokens",
                       "context_length_exceeded")
    return asked
