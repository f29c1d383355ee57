"""Preference records in TRL's formats: pairs {"prompt", "chosen", "rejected"} with an explicit or an implicit
prompt, standard (strings) or conversational (message lists), and unpaired {"prompt", "completion", "label"}
for KTO; checked, normalised, and remembering where they were read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from wgpu_train.data.kinds import DataKind
from wgpu_train.data.records import BadRecord, Message, convert_messages, record_tools, string_field
from wgpu_train.errors import ConfigError

# a prompt or an answer: a string (standard format) or a list of Message (conversational format)
Part = Union[str, list]

UNPAIRED_FORMAT = "unpaired"
UNPAIR_BATCH = 1000  # TRL's unpair_preference_dataset maps batches of this many pairs (datasets' default)

_SHAPES = {
    "preference": '{"prompt", "chosen", "rejected"}',
    "implicit preference": '{"chosen", "rejected"} sharing their prompt',
    "unpaired": '{"prompt", "completion", "label"}',
}


@dataclass
class PreferenceRecord:
    """A prompt with a chosen and a rejected answer; all three strings, or all three message lists (the answers
    then hold the assistant turn(s) that follow the prompt). `source` is "file:line" ("" when built in code)."""

    prompt: Part
    chosen: Part
    rejected: Part
    source: str = ""
    tools: list | None = None       # the tools column (JSON schemas, or functions in code) the template renders
    images: list = field(default_factory=list)     # the images column: those the prompt's placeholders take


@dataclass
class UnpairedRecord:
    """A prompt and one completion labelled desirable (True) or undesirable (False), KTO's data; both strings or
    both message lists. `source` is "file:line" ("" when built in code)."""

    prompt: Part
    completion: Part
    label: bool
    source: str = ""
    tools: list | None = None       # the tools column (JSON schemas, or functions in code) the template renders
    images: list = field(default_factory=list)     # the images column: those the prompt's placeholders take


def is_conversational(part: Part) -> bool:
    """Whether a prompt or answer is a message list (TRL's conversational format) rather than a string."""
    return isinstance(part, list)


def _present(obj: dict, key: str) -> bool:
    return obj.get(key) is not None


def _is_message_list(value: Any) -> bool:
    """TRL's is_conversational test of one field: a list whose first item is a message object."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def detect_preference_format(obj: Any, kind: DataKind = DataKind.PAIRS) -> str:
    """The format of one record object read as `kind` (PAIRS or UNPAIRED): "preference" (explicit
    prompt), "implicit preference" (the prompt is the shared beginning of chosen and rejected, also when a prompt
    column is of the other type than the answers, as TRL's maybe_extract_prompt decides) or, for UNPAIRED,
    also "unpaired". BadRecord when it has none."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object, got {type(obj).__name__}")
    if kind is DataKind.UNPAIRED and (_present(obj, "completion") or _present(obj, "label")):
        return "unpaired"
    if _present(obj, "chosen") or _present(obj, "rejected"):
        if not _present(obj, "prompt"):
            return "implicit preference"
        answer = obj.get("chosen") if _present(obj, "chosen") else obj.get("rejected")
        return "preference" if _is_message_list(obj["prompt"]) == _is_message_list(answer) else "implicit preference"
    keys = ", ".join(sorted(map(str, obj))[:6]) or "none"
    wanted = (_SHAPES["unpaired"] + " (or pairs " + _SHAPES["preference"] + ")" if kind is DataKind.UNPAIRED
              else _SHAPES["preference"] + " or " + _SHAPES["implicit preference"])
    raise BadRecord(f"not a preference record (keys: {keys}); expected {wanted}")


def _part(obj: dict, key: str) -> Part:
    """A prompt or answer field: a non-blank string or a non-empty list of messages."""
    value = obj.get(key)
    if isinstance(value, list):
        return convert_messages(value, key)
    return string_field(obj, key)


def _leading_context(messages: Sequence[Message]) -> list[Message]:
    """The messages of an answer list before its first assistant turn: a prompt it carries itself."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out


def _check_answer(messages: Sequence[Message], key: str) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord(f'"{key}" has no assistant message')


def extract_prompt(chosen: Part, rejected: Part) -> tuple[Part, Part, Part]:
    """(prompt, chosen, rejected) of an implicit-prompt pair, split as TRL's extract_prompt splits it: the prompt
    is the longest common beginning (of messages, or of characters, where a space before the point of difference
    goes with the answers). Like TRL, when one holds the other entirely the last shared item starts the answers."""
    n = min(len(chosen), len(rejected))
    idx = n - 1  # TRL's loop variable when it finds no difference
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _convert_pair(obj: dict, fmt: str) -> tuple[Part, Part, Part]:
    chosen, rejected = _part(obj, "chosen"), _part(obj, "rejected")
    if is_conversational(chosen) != is_conversational(rejected):
        raise BadRecord('"chosen" and "rejected" must both be strings or both message lists')
    if fmt == "preference":
        prompt = _part(obj, "prompt")
        if is_conversational(chosen):
            _check_answer(chosen, "chosen")
            _check_answer(rejected, "rejected")
            if _leading_context(chosen) != _leading_context(rejected):
                raise BadRecord('"chosen" and "rejected" carry different prompts (their messages before the first '
                                "assistant turn differ)")
        return prompt, chosen, rejected
    prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if not prompt:
        what = "message" if is_conversational(chosen) else "character"
        raise BadRecord(f'"chosen" and "rejected" share no prompt: they differ from their first {what}')
    if is_conversational(chosen):
        for key, answer in (("chosen", chosen), ("rejected", rejected)):
            if answer[0]["role"] != "assistant":
                raise BadRecord(f'"chosen" and "rejected" differ before their answers: "{key}" continues the '
                                f"shared prompt with a {answer[0]['role']} message")
    return prompt, chosen, rejected


def _label(obj: dict) -> bool:
    value = obj.get("label")
    if value is None:
        raise BadRecord('missing field "label"')
    if not isinstance(value, bool):
        raise BadRecord(f'field "label" must be true or false, got {value!r}')
    return value


def convert_preference(obj: Any, fmt: str, source: str = "") -> PreferenceRecord | UnpairedRecord:
    """Check `obj` against `fmt` (a name of detect_preference_format) and turn it into a record read at
    `source`. Pairs are read as PreferenceRecord in any kind; unpaired ones as UnpairedRecord."""
    found = detect_preference_format(obj, DataKind.UNPAIRED if fmt == UNPAIRED_FORMAT else DataKind.PAIRS)
    if found != fmt:
        raise BadRecord(f"record looks like {found} format {_SHAPES[found]}, "
                        f"but the file is {fmt} format {_SHAPES[fmt]}")
    if fmt != UNPAIRED_FORMAT:
        return PreferenceRecord(*_convert_pair(obj, fmt), source=source, tools=record_tools(obj))
    prompt, completion = _part(obj, "prompt"), _part(obj, "completion")
    if is_conversational(prompt) != is_conversational(completion):
        raise BadRecord('"prompt" and "completion" must both be strings or both message lists')
    if is_conversational(completion):
        _check_answer(completion, "completion")
    return UnpairedRecord(prompt, completion, _label(obj), source, record_tools(obj))


def unpair_preferences(records: Sequence[PreferenceRecord]) -> list[UnpairedRecord]:
    """Pairs -> unpaired records, as TRL's KTOTrainer unpairs paired data (unpair_preference_dataset): per batch
    of UNPAIR_BATCH pairs, every chosen answer labelled True, then every rejected one labelled False."""
    out: list[UnpairedRecord] = []
    for b in range(0, len(records), UNPAIR_BATCH):
        batch = records[b:b + UNPAIR_BATCH]
        out += [UnpairedRecord(r.prompt, r.chosen, True, r.source, r.tools, r.images) for r in batch]
        out += [UnpairedRecord(r.prompt, r.rejected, False, r.source, r.tools, r.images) for r in batch]
    return out


def check_labels(records: Sequence[UnpairedRecord], where: str) -> None:
    """ConfigError unless the unpaired training records hold both labels (KTO needs desirable and undesirable
    examples)."""
    n_desirable = sum(1 for r in records if r.label)
    if n_desirable in (0, len(records)):
        which = "desirable (label true)" if n_desirable else "undesirable (label false)"
        raise ConfigError(f"{where}: all {len(records)} unpaired records are {which}; KTO needs both desirable and "
                          "undesirable examples")
