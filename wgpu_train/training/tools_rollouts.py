"""A GRPO run's tool rollouts as TRL 1.16's GRPOTrainer makes them: prompts rendered with the tools' schemas, each
rollout's environment reset and its tools, turns parsed as transformers' parse_response reads the chat template's
tool-call syntax (formats/tool_calls.py), tool results tokenized as the template renders tool messages
(TRL's _get_tool_suffix_ids), and the loop of tools_loop.py run on the engine's KV cache; prompts with images:
their placeholders expanded, the images prefilled with the first turns and kept in context for the later ones."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from wgpu_train.data.vision_records import expand_placeholders
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tool_calls import parse_response, tool_call_format, tool_schemas
from wgpu_train.training.tools import Toolbox, reset_prompt, run_tool_calls
from wgpu_train.training.tools_loop import TurnSampler, tool_rollouts


@dataclass
class ToolBatch:
    """One generation's rows with tools: each row's prompt example (its environment's reset applied), its
    Rollout, its environment (None without one)."""

    examples: list
    rollouts: list
    environments: list | None

    @property
    def completions(self) -> list:
        return [r.ids for r in self.rollouts]

    def every_row(self, process, everyone: list, start: int) -> tuple[list, dict]:
        """(everyone, each step row's prompt example, with every process's rows as their environments reset them;
        row -> its turns, for every row): this batch's rows (those of `everyone` from `start`) and the other
        processes' (process.gather_objects), as one process running every rollout has them."""
        mine = [{"prompt": ex.record.prompt, "ids": ex.input_ids.tolist(), "turns": r.turns}
                for ex, r in zip(self.examples, self.rollouts)]
        every = process.gather_objects(mine, start, len(everyone))
        out = list(everyone)
        out[start:start + len(mine)] = self.examples
        for i, row in enumerate(every):
            if row["ids"] != out[i].input_ids.tolist():          # another process's reset changed its prompt
                out[i] = replace(out[i], input_ids=np.asarray(row["ids"], np.int32),
                                 record=replace(out[i].record, prompt=row["prompt"]))
        return out, {i: row["turns"] for i, row in enumerate(every)}


class ToolRollouts:
    """The tools of a run (a Toolbox) with the tokenizer whose chat template renders and parses them; span: how a
    vision model's images stand in the prompts (data/vision_records.model_image_span), None for text prompts."""

    sampler = TurnSampler          # what samples the turns (a test may script them)

    def __init__(self, toolbox: Toolbox, tokenizer, max_iterations: int | None, span=None):
        self.toolbox, self.tokenizer, self.span = toolbox, tokenizer, span
        self.max_iterations = max_iterations if max_iterations is not None else np.iinfo(np.int64).max
        self.format = tool_call_format(tokenizer.chat_template)
        if self.format is None:
            raise ConfigError("the model's chat template cannot render tool calls (a tool call and a tool message "
                              "did not show in its text): tools need a template with tool support")
        self.tools = toolbox.all_tools()
        self.schemas = tool_schemas(self.tools)
        self.specials = [t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special]

    def prompt_ids(self, messages, images=()) -> list:
        """A conversation's generation prompt rendered with the tools (TRL's apply_chat_template(tools=...)); with
        a span, each image placeholder expanded (span.expansion of each of `images`), as the processor does."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=self.schemas)
        if self.span is not None:
            text = expand_placeholders(text, self.span, [self.span.expansion(im) for im in images])
        return self.tokenizer.encode(text)

    def suffix_ids(self, tool_messages: list) -> list:
        """The tokens after an assistant turn's EOS that the chat template writes for `tool_messages` and the
        next generation prompt (TRL's _get_tool_suffix_ids: a dummy call of the first result's tool, rendered
        with and without them, the shorter cut after its last EOS)."""
        tok = self.tokenizer
        for m in tool_messages:           # TRL's multimodal tool responses: images the tower has not seen
            if isinstance(m["content"], list) and any(isinstance(p, dict) and p.get("type") == "image"
                                                      for p in m["content"]):
                raise DataError(f"tool {m['name']!r} returned an image: tool results with images are not "
                                f"supported yet (return text)")
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]
        prefix = tok.encode(tok.apply_chat_template(dummy))
        full = tok.encode(tok.apply_chat_template(dummy + list(tool_messages), add_generation_prompt=True))
        ends = [i for i, t in enumerate(prefix) if t == tok.eos_token_id]
        if ends:
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ConfigError("the chat template renders an assistant turn differently once a tool message "
                              "follows it: its tool results cannot be appended to a rollout")
        return full[len(prefix):]

    def parse(self, ids, prefix) -> dict:
        """A turn's ids as the assistant message TRL's parse_response makes of them after the prefix ids."""
        tok = self.tokenizer
        return parse_response(tok.decode(ids, skip_special_tokens=False), self.format, self.schemas,
                              prefix=tok.decode(prefix, skip_special_tokens=False), eos_token=tok.eos_token,
                              special_tokens=self.specials)

    def run(self, engine, examples, settings, seeds=None, greedy: bool = False, vision=None) -> ToolBatch:
        """The rollouts of `examples` (one row each) with sampling `settings` (GRPOSettings; greedy: temperature
        0), row i seeded by seeds[i]: environments reset, first turns sampled on one KV cache, the tool loop run
        on its held rows. vision: the VisionModel of prompts with images (each prompt's tower forward once, its
        rows sharing it; the engine's ids of its placeholders), else None."""
        environments = self.toolbox.environments(examples)
        if environments is not None:
            rows = []
            for ex, env in zip(examples, environments):
                prompt = reset_prompt(ex.record.prompt, env, {"prompt": ex.record.prompt, **ex.record.columns})
                if prompt is not ex.record.prompt:
                    ex = replace(ex, input_ids=np.asarray(self.prompt_ids(prompt, ex.record.images), np.int32),
                                 record=replace(ex.record, prompt=prompt))
                rows.append(ex)
            examples = rows
        prompts, fed, images = [ex.input_ids for ex in examples], None, None
        if vision is not None:          # (engine ids (T,), ImageTokens (1, T)) of each prompt
            made: dict = {}
            for ex in examples:
                if id(ex) not in made:
                    made[id(ex)] = vision.prompt_images(ex.input_ids, ex.record.images)
            fed, images = zip(*(made[id(ex)] for ex in examples))
        budget = settings.max_completion_length
        positions = engine.cfg.max_position_embeddings
        sampler = self.sampler(engine, list(fed or prompts), min(max(p.size for p in prompts) + budget, positions),
                               0.0 if greedy else settings.temperature, settings.top_k, settings.top_p, seeds,
                               self.tokenizer.eos_token_ids, images)
        try:
            toolsets = [self.toolbox.rollout_tools(e) for e in (environments or [None] * len(examples))]
            rollouts = tool_rollouts(sampler, [p.tolist() for p in prompts], self.parse, self.suffix_ids, toolsets,
                                     run_tool_calls, budget, positions, self.max_iterations)
        finally:
            sampler.close()
        return ToolBatch(examples, rollouts, environments)
