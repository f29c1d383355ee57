"""Objectives as units (training/objectives/): the registry's lookup and traits, what reads them (the command
line's choices, the trainer of each kind), and no module outside the objectives' own files comparing an
objective's name or the string of the data kind it reads (DataKind, data/kinds.py), shown to catch such a
comparison."""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from wgpu_train.cli.main import build_parser
from wgpu_train.data.sources import resolve_data
from wgpu_train.training.trainers import TRAINERS
from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives import (OBJECTIVES, PREFERENCE_OBJECTIVES, DataKind, PreferenceObjective,
                                            TrainerKind, objective_class)

PACKAGE = Path(__file__).resolve().parent.parent / "wgpu_train"
OWN_FILES = PACKAGE / "training" / "objectives"


def _names(node) -> set:
    """The string literals of a comparison's operand: a string, or a tuple / list / set of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _flagged(names: set, others: list) -> list:
    """The objective names among `names` compared with `others`. The preference objectives' names mean nothing
    else in the package; "sft" is also data/'s record kind, so it counts where the other side is an objective."""
    about_objective = any("objective" in ast.unparse(o) for o in others)
    return sorted(n for n in names & set(OBJECTIVES) if n != "sft" or about_objective)


def name_comparisons(source: str) -> list:
    """(line, name) of every comparison (==, !=, in, not in, is, a match statement's case) of an objective's name
    in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                others = operands[:i] + operands[i + 1:]
                found += [(node.lineno, n) for n in _flagged(_names(operand), others)]
        elif isinstance(node, ast.Match):
            for case in node.cases:
                values = {p.value for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)}
                found += [(case.pattern.lineno, n) for v in values for n in _flagged(_names(v), [node.subject])]
    return sorted(found)


def test_no_module_outside_the_objectives_compares_an_objective_name():
    scanned = [p for p in PACKAGE.rglob("*.py") if OWN_FILES not in p.parents]
    assert len(scanned) > 50                                        # the whole package, not an empty glob
    found = {str(p.relative_to(PACKAGE)): hits for p in scanned if (hits := name_comparisons(p.read_text()))}
    assert found == {}, "read the objective's traits (training/objectives/) instead of comparing its name"


def test_the_check_catches_name_comparisons():
    source = '''
if config.objective == "kto":
    pass
paired = settings.objective != "kto"
if args.objective not in ("dpo", "kto"):
    pass
trainer = DataParallelTrainer if cfg.objective == "sft" else DataParallelPreferenceTrainer
match name:
    case "orpo" | "simpo":
        pass
settings = PreferenceSettings("dpo")
times = {"sft": [], "dpo": []}
detector = detect_format if kind == "sft" else detect_preference_format
'''
    assert name_comparisons(source) == [(2, "kto"), (4, "kto"), (5, "dpo"), (5, "kto"), (7, "sft"), (9, "orpo"),
                                        (9, "simpo")]


def kind_comparisons(source: str) -> list:
    """(line, value) of every comparison of a data kind's string (a DataKind value) with something named kind."""
    values = {k.value for k in DataKind}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                others = operands[:i] + operands[i + 1:]
                if any("kind" in ast.unparse(o) for o in others):
                    found += [(node.lineno, v) for v in sorted(_names(operand) & values)]
    return sorted(found)


def test_no_module_compares_a_data_kind_as_a_string():
    own = {PACKAGE / "data" / "kinds.py"}
    scanned = [p for p in PACKAGE.rglob("*.py") if OWN_FILES not in p.parents and p not in own]
    assert len(scanned) > 50
    found = {str(p.relative_to(PACKAGE)): hits for p in scanned if (hits := kind_comparisons(p.read_text()))}
    assert found == {}, "compare DataKind members (data/kinds.py), not their strings"


def test_the_kind_check_catches_string_comparisons():
    source = '''
if kind == "prompts":
    pass
detector = detect_format if kind == "sft" else detect_preference_format
if kind != "sft" and self.kind not in ("unpaired", "preference"):
    pass
if op.kind == "rmsnorm" or fmt == "unpaired" or kind is DataKind.SFT:
    pass
'''
    assert kind_comparisons(source) == [(2, "prompts"), (4, "sft"), (5, "preference"), (5, "sft"), (5, "unpaired")]


def test_data_is_read_by_the_objectives_kind(tmp_path):
    """resolve_data takes the objective's DataKind itself (or its value); another string is one line."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "P", "chosen": "A", "rejected": "B"}\n')
    by_kind = resolve_data(path, valid_split=0.0, kind=objective_class("dpo").data)
    assert by_kind.format == "preference" and by_kind.train == resolve_data(path, valid_split=0.0,
                                                                            kind="preference").train
    assert resolve_data(path, valid_split=0.0, kind=DataKind.PROMPTS).format != "preference"
    with pytest.raises(ConfigError, match=r"^unknown record kind 'pairs'; the kinds are sft, preference, unpaired, "
                                          r"prompts$"):
        resolve_data(path, kind="pairs")


def test_lookup_is_one_line_listing_the_choices():
    assert objective_class("kto").data is DataKind.UNPAIRED
    with pytest.raises(ConfigError, match=r"^objective must be one of sft, dpo, simpo, orpo, kto, grpo, got 'ppo'$"):
        objective_class("ppo")
    with pytest.raises(ConfigError, match=r"^objective must be one of dpo, simpo, orpo, kto, got 'sft'$"):
        objective_class("sft", PREFERENCE_OBJECTIVES)


def test_traits():
    traits = {name: (cls.data, cls.trainer, cls.uses_reference, cls.length_normalised, cls.trains_prompt)
              for name, cls in OBJECTIVES.items()}
    pairs, preference = DataKind.PAIRS, TrainerKind.PREFERENCE
    assert traits == {"sft": (DataKind.SFT, TrainerKind.SUPERVISED, False, False, False),
                      "dpo": (pairs, preference, True, False, False),
                      "simpo": (pairs, preference, False, True, False),
                      "orpo": (pairs, preference, False, True, True),
                      "kto": (DataKind.UNPAIRED, preference, True, False, False),
                      "grpo": (DataKind.PROMPTS, TrainerKind.ONLINE, False, False, False)}
    for cls in OBJECTIVES.values():     # the trainer kind and the loss go together
        assert (cls.trainer is TrainerKind.PREFERENCE) == issubclass(cls, PreferenceObjective), cls.name


def test_every_kind_of_objective_has_a_trainer():
    assert {cls.trainer for cls in OBJECTIVES.values()} <= set(TRAINERS)


def _choices(parser: argparse.ArgumentParser, command: str, option: str):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return next(a for a in sub._actions if option in a.option_strings).choices


def test_the_command_line_offers_the_registered_objectives():
    parser = build_parser()
    assert tuple(_choices(parser, "finetune", "--objective")) == tuple(OBJECTIVES)
    assert tuple(_choices(parser, "eval", "--objective")) == PREFERENCE_OBJECTIVES == ("dpo", "simpo", "orpo", "kto")
