"""A run read from a file (Slurm, `> log`): no tqdm carriage returns, a header whose figures equal counts taken
independently from the model and the data (the steps that train.epochs derives from it), one plain line per logged step,
tokens_per_s counting every position computed (padding included) and label_tokens_per_s the label tokens, hints naming the interpreter actually used; and the small frictions of a MiniMind
user: MiniMind's argument names suggest Sluice's keys, a truncated JSONL line is named at the column where it ends."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.step import IGNORE_INDEX
from tests.conftest import ROOT
from tests.equivalence import compose_run_config
from training.config.schema import compose_config, model_config
from training.config.run_model import unknown_key
from training.data import build_data, build_tokenizer, run_data_spec
from training.data.jsonl import parse_row
from training.data.rows import TASKS
from training.report.header import partition_line, run_header


def header_of(messages: list[str]) -> dict[str, str]:
    """The run header's lines by label: what rank 0 logs between the run directory and the first step."""
    start = next(i for i, m in enumerate(messages) if m.startswith("run directory: ")) + 1
    stop = next(i for i, m in enumerate(messages) if m.startswith("step ") and i > start)
    return {m[:10].strip(): m[11:] for m in messages[start:stop]}


def parameters_of(cfg) -> int:
    """The model's parameters as transformers counts them (a model on the CPU, each tied tensor once)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_config(cfg)).num_parameters()


def test_a_redirected_run_has_no_bar_and_counts_label_tokens(tmp_path, data_cache):
    log = tmp_path / "out.txt"
    args = [sys.executable, "train.py", "model=tiny", "train.task=sft", "train.epochs=0.01", "train.seq_len=64",
            "train.micro_batch_size=2", "schedule.n_microbatches=1", "data.num_docs=300", "logger=none",
            "train.log_every=1", f"data.cache_dir={data_cache}", f"hydra.run.dir={tmp_path / 'run'}"]
    with open(log, "wb") as out:
        done = subprocess.run(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=300,
                              stdin=subprocess.DEVNULL)
    text = log.read_bytes()
    assert done.returncode == 0, text[-2000:]
    assert b"\r" not in text
    lines = text.decode().splitlines()
    assert sum(" - step " in line for line in lines) == 2  # one plain line per logged step
    python = os.path.relpath(sys.executable, ROOT) if Path(sys.executable).is_relative_to(ROOT) else sys.executable
    assert any(line.endswith(f"  export:   {python} scripts/export_hf.py {tmp_path / 'run' / 'checkpoints'} "
                             "<out folder>") for line in lines), lines[-6:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # SFT pads each conversation: the label tokens are a part of the positions computed
        assert row["label_tokens_per_s"] == pytest.approx(row["tokens"] / row["step_time_s"], rel=1e-6)
        assert row["tokens_per_s"] == pytest.approx(2 * 64 / row["step_time_s"], rel=1e-6)
        assert row["label_tokens_per_s"] < row["tokens_per_s"]
    step_lines = [line.split(" - ", 1)[1] for line in lines if " - step " in line]
    assert step_lines[0].startswith("step 1/2 ") and " tokens_per_s " in step_lines[0] \
        and " label_tokens_per_s " in step_lines[0], step_lines

    # The header, counted again here: the model's parameters by transformers, the label tokens from the rows
    # the two steps read (and as the steps counted them), 300 embedded conversations padded one per sample.
    cfg = compose_config([a for a in args[2:] if not a.startswith("hydra.")])
    stream, _ = build_data(cfg, 0, 1, verbose=False)
    labels = sum(int((mb.labels[:, 1:] != IGNORE_INDEX).sum()) for step in range(2) for mb in stream.batch(step))
    assert labels == sum(row["tokens"] for row in rows)
    n = parameters_of(cfg)
    assert header_of([line.split(" - ", 1)[1] for line in lines if "][sluice][INFO] - " in line]) == {
        "model": f"minimind, 4 layers, hidden 64: {n:,} ({n / 1000:.3g}k) parameters, all trainable",
        "data": "train 300 rows -> 300 samples of 64 tokens, no val split (chat)",
        "steps": "train.epochs=0.01 -> 2 x 2 samples = 4 samples = 0.0133 epochs of the 300 training samples",
        "layout": "dp 1 x tp 1 x pp 1 (1 process); 1 micro-batch x 2 sequences per replica; 2 x 64 tokens per step",
        "partition": "4 layers on one stage",
        "tokens": f"128 per step, label tokens {100 * labels / 256:.2f}% ({labels} of 256 over this run's 2 steps)"}


@pytest.mark.parametrize("key, suggestion", [
    ("data.data_path", "data.path"), ("data_path", "data.path"), ("max_seq_len", "train.seq_len"),
    ("batch_size", "train.micro_batch_size"), ("learning_rate", "optim.lr"), ("accumulation_steps",
                                                                            "schedule.n_microbatches"),
    ("from_weight", "checkpoint.load_dense"), ("epochs", "train.epochs")])
def test_minimind_argument_names_suggest_the_key(key, suggestion):
    assert f"did you mean {suggestion}?" in str(unknown_key(key))


def test_a_truncated_line_is_named_where_it_ends():
    line = b'{"text": "a line that a full disk cut off in the middle of its'
    assert parse_row(line, TASKS["text"]) == (None, f"line is not JSON: it ends at column {len(line) + 1} before its "
                                                    "value is complete, in a string opened at column 10 (a truncated "
                                                    "line?)")
    assert parse_row(b'{"text": "abc"', TASKS["text"])[1].startswith("line is not JSON: it ends at column 15")
    assert parse_row(b'{"text": "abc" x}', TASKS["text"])[1] == ("line is not JSON (Expecting ',' delimiter at "
                                                                 "column 16)")


def test_the_documented_continue_commands_match_the_run_they_continue():
    """docs/checkpoints.md continues README's `experiment=demo` run: the same model, or the resume is refused
    (exit 2)."""
    import shlex

    from models import config_record
    from training.config.schema import compose_config, model_config

    demo = config_record(model_config(compose_config(["experiment=demo"])))
    lines = [line for line in (ROOT / "docs" / "checkpoints.md").read_text().splitlines()
             if line.startswith(".venv/bin/python train.py") and "checkpoint.resume=" in line and "runs/demo" in line]
    assert len(lines) >= 2
    for line in lines:
        words = shlex.split(line.split("  #")[0])[2:]
        kept = [w for w in words if not w.startswith(("checkpoint.resume=", "hydra.run.dir=", "train.steps="))]
        assert config_record(model_config(compose_config(kept))) == demo, line


def test_the_header_counts_adapters_rows_and_the_partition(tmp_path, data_cache):
    """LoRA's share counted by peft, the rows of a JSONL file with bad lines and of its val file, the packed samples
    from the tokenizer's lengths, the epochs, the interleaved partition and the label tokens of a dp2 step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    texts = [f"row {i} " + "word " * (i % 13) for i in range(60)]
    lines = [json.dumps({"text": t}) for t in texts]
    (tmp_path / "train.jsonl").write_text("\n".join([*lines[:30], "{bad", *lines[30:], "not json"]) + "\n")
    (tmp_path / "val.jsonl").write_text("\n".join(lines[:11]) + "\n")
    cfg = compose_run_config(["model=tiny", "data=jsonl", f"data.path={tmp_path / 'train.jsonl'}",
                              f"data.val_path={tmp_path / 'val.jsonl'}", "data.tokenizer=synthetic",
                              "data.skip_bad_lines=true", "data.format=packed", "lora.rank=4",
                              "lora.targets=[q_proj,down_proj]", "parallel.pp=2", "parallel.vpp=2",
                              "parallel.emulate=true", "parallel.dp=2", "schedule=interleaved-1f1b",
                              "train.steps=50"], data_cache)
    stream, _ = build_data(cfg, 0, 2, verbose=False)
    header = dict((line[:10].strip(), line[11:]) for line in run_header(cfg, stream, dp=2, processes=2))

    model = get_peft_model(AutoModelForCausalLM.from_config(model_config(cfg)),
                           LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    trainable, total = model.get_nb_trainable_parameters()
    tokenizer = build_tokenizer(run_data_spec(cfg))
    tokens = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 2 for t in texts]  # [bos] text [eos]
    train, val = sum(tokens) // 32, sum(tokens[:11]) // 32
    per_step = 2 * 8 * 2  # dp x n_microbatches (interleaved-1f1b's preset) x micro_batch_size
    assert header == {
        "model": f"minimind, 4 layers, hidden 64: {total:,} ({total / 1000:.3g}k) parameters, {trainable:,} trainable "
                 f"({100 * trainable / total:.2f}%: LoRA rank 4 on 8 linears, the rest frozen)",
        "data": f"train 60 rows -> {train} samples of 32 tokens, val 11 rows -> {val} samples of 32 tokens (packed); "
                "2 bad lines skipped",
        "steps": f"50 x {per_step} samples = {50 * per_step:,} samples = {50 * per_step / train:.3g} epochs of the "
                 f"{train} training samples",
        "layout": "dp 2 x tp 1 x pp 2 (2 processes, pp emulated), schedule interleaved-1f1b; 8 micro-batches x 2 "
                  "sequences per replica; 32 x 32 tokens per step",
        "partition": "4 layers in 4 stages (1 each, 2 per rank, loop placement): rank 0 layers 0, 2 | rank 1 layers "
                     "1, 3",
        "tokens": f"1,024 per step, label tokens 96.88% ({50 * per_step * 31:,} of {50 * 1024:,} over this run's 50 "
                  "steps)"}


def test_a_dpo_header_counts_the_label_tokens_of_chosen_and_rejected(tmp_path, data_cache):
    """Under DPO a step's positions are its pairs' two rows; the label tokens are the answers of both, counted here
    from the micro-batches the stream hands out."""
    def turn(question: str, answer: str) -> list[dict]:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    rows = [{"chosen": turn(f"q {i}", "yes " * (i % 5 + 1)), "rejected": turn(f"q {i}", "no " * (i % 3 + 1))}
            for i in range(40)]
    (tmp_path / "dpo.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose_run_config(["model=tiny", "train.task=dpo", "data=jsonl", f"data.path={tmp_path / 'dpo.jsonl'}",
                              "data.tokenizer=synthetic", "data.format=chat", "train.seq_len=64",
                              "train.micro_batch_size=4", "schedule.n_microbatches=2", "train.steps=3"], data_cache)
    stream, _ = build_data(cfg, 0, 1, verbose=False)
    tokens = dict((line[:10].strip(), line[11:]) for line in run_header(cfg, stream, dp=1, processes=1))["tokens"]
    labels = sum(mb.num_label_tokens() for _ in range(3) for mb in next(stream))
    positions = 3 * 2 * 4 * 64  # steps x micro-batches x sequences (two per pair) x seq_len
    assert 0 < labels < positions // 4
    assert tokens == (f"512 per step (4 pairs, chosen and rejected), label tokens {100 * labels / positions:.2f}% "
                      f"({labels:,} of {positions:,} over this run's 3 steps)")


@pytest.mark.parametrize("parallel, partition", [
    ([], "4 layers on one stage"),
    (["parallel.pp=2", "parallel.layers_per_stage=[3,1]"],
     "4 layers in 2 stages (1 to 3 each): rank 0 layers 0-2 | rank 1 layers 3"),
    (["parallel.pp=2", "parallel.vpp=2", "schedule=zbv"],
     "4 layers in 4 stages (1 each, 2 per rank, v placement): rank 0 layers 0, 3 | rank 1 layers 1, 2")])
def test_the_header_gives_each_rank_its_layers(parallel, partition):
    assert partition_line(compose_config(["model=tiny", *parallel]), 4) == partition


def test_a_resumed_run_says_where_it_resumed(tmp_path, data_cache, caplog):
    from parallel.grid import ParallelGrid
    from training.trainer import Trainer

    grid, run_dir = ParallelGrid.single(torch.device("cpu")), tmp_path / "run"
    overrides = ["model=tiny", "schedule.n_microbatches=1", "checkpoint.save_final=true"]
    Trainer(compose_run_config([*overrides, "train.steps=2"], data_cache), grid, run_dir).fit()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sluice"):
        Trainer(compose_run_config([*overrides, "train.steps=3", "checkpoint.resume=auto"], data_cache), grid,
                run_dir).fit()
    header = header_of(caplog.messages)
    assert header["resumed"] == (f"from step 2 ({run_dir / 'checkpoints' / 'step_00000002'}), at sample 4: this run "
                                 "does step 3")
    assert header["tokens"] == "64 per step, label tokens 96.88% (62 of 64 over this run's 1 step)"


def test_the_documented_header_is_what_the_demo_run_prints(data_cache):
    """docs/launching.md shows the header of README's `experiment=demo` run: the same lines, figure for figure."""
    page = (ROOT / "docs" / "launching.md").read_text()
    shown = page.split("`experiment=demo` run prints:\n\n```text\n", 1)[1].split("```", 1)[0].splitlines()
    cfg = compose_config(["experiment=demo", f"data.cache_dir={data_cache}"])
    stream, _ = build_data(cfg, 0, 1, verbose=False)
    assert shown == run_header(cfg, stream, dp=1, processes=1)
