"""The trainers are made of parts they own (no mixins sharing `self`): each kind's classes are the Trainer's line
alone, and a trainer's files, resume point, progress and Ctrl-C handling are objects of their own, its progress
read through the trainer's attributes."""
from __future__ import annotations

import inspect

from wgpu_train.training.config import TrainConfig
from wgpu_train.training.interrupt import Interrupt
from wgpu_train.training.progress import Progress
from wgpu_train.training.run_files import RunFiles
from wgpu_train.training.trainer import Trainer
from wgpu_train.training.trainers import TRAINERS


def test_no_mixins():
    assert Trainer.__bases__ == (object,)
    for kind in TRAINERS.values():
        assert all(cls is object or issubclass(cls, Trainer) for cls in inspect.getmro(kind)), kind


def test_the_parts_are_objects_the_trainer_owns(tmp_path):
    trainer = Trainer(TrainConfig(out=str(tmp_path / "run")), log=lambda msg: None)
    assert isinstance(trainer.files, RunFiles) and isinstance(trainer.progress, Progress)
    assert isinstance(trainer.interrupt, Interrupt) and trainer.resume is None
    trainer.step = 3                     # kept by the progress part
    assert trainer.progress.step == 3 and trainer.history is trainer.progress.history


def test_interrupt_asks_once_and_knows_a_step():
    said = []
    interrupt = Interrupt(said.append, lambda: False)
    with interrupt.step():
        assert interrupt.in_step
    assert not interrupt.in_step
    interrupt.request("stop")
    interrupt.request("stop again")
    assert interrupt.requested and said == ["stop"]
