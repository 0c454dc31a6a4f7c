"""A run says what it is doing before a long silent wait (issue 38: DPO printed nothing until its reference pass
ended, 86 s under load): DPO's reference pass and distillation's teacher load are each announced on a line of their
own before they start, and a line after says what they did, all before step 1."""

import logging

import pytest
import torch

from minimind import MiniMindConfig, MiniMindForCausalLM
from parallel.grid import ParallelGrid
from tests.equivalence import compose_run_config
from training.trainer import Trainer

ONE_STEP = ["model=tiny", "train.steps=1", "schedule.n_microbatches=1", "train.log_every=1"]


def messages_of(overrides: list[str], data_cache, run_dir, caplog) -> list[str]:
    """The sluice logger's messages of a one-process run of `overrides`."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sluice"):
        Trainer(compose_run_config(overrides, data_cache), ParallelGrid.single(torch.device("cpu")), run_dir).fit()
    return caplog.messages


def index_of(messages: list[str], start: str) -> int:
    return next(i for i, m in enumerate(messages) if m.startswith(start))


def test_dpo_announces_its_reference_pass_before_running_it(tmp_path, data_cache, caplog):
    messages = messages_of([*ONE_STEP, "train.task=dpo"], data_cache, tmp_path / "run", caplog)
    before = index_of(messages, "dpo: computing the reference log-probabilities")
    after = index_of(messages, "dpo: reference log-probabilities of ")
    assert before < after < index_of(messages, "step 1")
    assert "(forward only, the starting weights)" in messages[before]


def test_distillation_announces_its_teacher_before_loading_it(tmp_path, data_cache, caplog):
    torch.manual_seed(0)
    teacher = tmp_path / "teacher"
    MiniMindForCausalLM(MiniMindConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1)).save_pretrained(teacher)
    messages = messages_of([*ONE_STEP, "train.task=distill", f"distill.teacher={teacher}"], data_cache,
                           tmp_path / "run", caplog)
    before = index_of(messages, "distill: loading the teacher")
    after = index_of(messages, "distill: teacher ")
    assert before < after < index_of(messages, "step 1")
    assert messages[before] == f"distill: loading the teacher {teacher} (forward only, on every rank); step 1 follows"
    assert messages[after].startswith("distill: teacher minimind, 0.")
    assert "alpha 0.5, temperature 1.5" in messages[after]
