"""train.task=grpo's bad input, each one line before launch (issue 45 item 7): settings, prompt rows without a user
turn, reward targets that do not import, reward-model folders that are not sequence classifiers or read another
tokenizer; and the reward model's clipped scores. A reward that raises or returns the wrong shape at run time, and
a group of equal rewards, are tests/test_grpo.py's."""

import json

import pytest
import torch

CPU = torch.device("cpu")


# --- bad input: one line before launch -------------------------------------------------------------------------------


def grpo_config(tmp_path, *overrides):
    """experiment=grpo's run config with `overrides` (its data cache under tmp_path)."""
    from training.config.schema import compose_config

    return compose_config(["experiment=grpo", "train.steps=2", "logger=none", f"data.cache_dir={tmp_path / 'cache'}",
                           *overrides])


def problem_of(cfg) -> str:
    from training.config.validate import validate
    from training.rules.values import ConfigError

    with pytest.raises(ConfigError) as caught:
        validate(cfg)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def rlaif(tmp_path, rows) -> str:
    path = tmp_path / "rlaif.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("overrides,expected", [
    (["grpo.num_generations=1"], "grpo.num_generations=1 must be >= 2"),
    (["train.micro_batch_size=8"], "train.micro_batch_size=8 is not a multiple of grpo.num_generations=6"),
    (["grpo.max_new_tokens=96"], "grpo.max_new_tokens=96 leaves no room for the prompt in train.seq_len=96"),
    (["train.seq_len=512"], "train.seq_len=512 exceeds model.max_position_embeddings=256"),
    (["grpo.loss_type=ppo"], "grpo.loss_type=ppo is not supported; use one of grpo, cispo"),
    (["grpo.rewards=[length]"], "grpo.rewards: unknown reward 'length'; use one of minimind_rules"),
    (["grpo.rewards=[{_target_: no.such.module.fn}]"], "grpo.rewards: cannot import no.such.module.fn"),
    (["train.eval_every=5", "data.val_fraction=0.1"], "train.task=grpo has no held-out loss to evaluate; set "
                                                      "train.eval_every=0"),
    (["data.val_fraction=0.1"], "train.task=grpo holds no prompts out; drop data.val_path and data.val_fraction"),
])
def test_bad_grpo_settings_are_one_line_before_launch(tmp_path, overrides, expected):
    assert expected in problem_of(grpo_config(tmp_path, *overrides))


def test_a_prompt_row_with_no_user_turn_is_named_before_launch(tmp_path):
    good = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    bad = {"conversations": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": ""}]}
    path = rlaif(tmp_path, [good] * 3 + [bad])
    problem = problem_of(grpo_config(tmp_path, "data=jsonl", f"data.path={path}", "data.tokenizer=synthetic"))
    assert f"data.path: {path}:4: no user turn with content (nothing to answer)" in problem


def test_a_reward_model_folder_that_is_not_a_sequence_classifier_is_refused(tmp_path):
    folder = tmp_path / "not-a-classifier"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    problem = problem_of(grpo_config(tmp_path, f"grpo.reward_model={folder}"))
    assert "is not a sequence classifier (architectures ['LlamaForCausalLM'])" in problem
    assert "has no config.json" in problem_of(grpo_config(tmp_path, f"grpo.reward_model={tmp_path}"))


def test_a_reward_model_with_another_tokenizer_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from training.data.tokenizer import train_bpe_tokenizer
    from training.methods.grpo.reward_model import reward_model_problem

    folder = tmp_path / "classifier"
    config = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    train_bpe_tokenizer(["one two three four"] * 20, 300).save_pretrained(folder)
    ours = train_bpe_tokenizer(["five six seven eight nine"] * 20, 300)
    assert "has another tokenizer than the run's" in reward_model_problem(str(folder), ours)
    from training.data.tokenizer import load_tokenizer

    assert reward_model_problem(str(folder), load_tokenizer(folder)) is None


def test_the_reward_model_scores_prompt_and_answer_clipped_to_three(tmp_path):
    """A stock sequence classifier with the run's tokenizer scores the prompt with the answer after `</think>`, its
    score clipped to [-3, 3] as MiniMind clips."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from training.data.tokenizer import train_bpe_tokenizer
    from training.methods.grpo.reward_model import RewardModel

    tokenizer = train_bpe_tokenizer(["the cat sat on the mat and the dog ran"] * 20, 300)
    config = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    classifier = LlamaForSequenceClassification(config)
    folder = tmp_path / "rm"
    classifier.save_pretrained(folder)
    model = RewardModel(str(folder), tokenizer, CPU)

    def raw(text: str) -> float:
        with torch.no_grad():
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
            return float(classifier(input_ids=ids).logits[0, 0])

    prompts, completions = ["the cat ", "the dog "], ["sat on the mat", "thinking</think> ran"]
    assert model(prompts, completions) == pytest.approx([raw("the cat sat on the mat"), raw("the dog ran")])
    with torch.no_grad():
        model.model.score.weight.mul_(1e4)
    assert all(abs(s) == 3.0 for s in model(prompts, completions))


def broken_judge(prompts, completions):
    """A reward by `_target_` that raises (tests)."""
    raise ConnectionError("the judge is down")


def test_a_reward_that_raises_at_run_time_stops_the_step_naming_reward_and_step():
    from parallel.grid import ParallelGrid
    from training.data.tokenizer import train_bpe_tokenizer
    from training.methods.grpo.rewards import RewardError
    from training.methods.grpo.scoring import Scorer

    tokenizer = train_bpe_tokenizer(["what is one plus two? one plus two is three."] * 20, 300)
    scorer = Scorer(["minimind_rules", {"_target_": "tests.test_grpo_inputs.broken_judge"}], None, tokenizer,
                    ParallelGrid.single(CPU))
    ids = torch.tensor([tokenizer("one plus two", add_special_tokens=False).input_ids] * 2)
    mask = torch.ones_like(ids, dtype=torch.bool)
    with pytest.raises(RewardError, match=r"^grpo.rewards: tests.test_grpo_inputs.broken_judge raised ConnectionError "
                                          r"at step 7: the judge is down$"):
        scorer(7, ids, mask, ids, mask)


def test_a_group_of_equal_rewards_is_said_in_the_log(caplog):
    """Zero spread: the advantages are 0 (tests/test_grpo.py), and rank 0 says how many groups taught nothing."""
    import logging
    from types import SimpleNamespace

    from parallel.step import StepResult
    from training.methods.grpo.step import GrpoStep

    step = GrpoStep.__new__(GrpoStep)  # only what after_step reads
    step.grid, step.spec, step.samples = SimpleNamespace(rank=0), SimpleNamespace(num_generations=6), []
    step.rollout_s = step.reference_s = 1.0
    with caplog.at_level(logging.INFO, logger="sluice"):
        record = step.after_step(3, StepResult(0.0, 0.0, 24, metrics={"flat_groups": 2, "completion_len": 5.0}))
    assert "grpo: step 3: 2 of 4 groups had equal rewards (zero spread): their advantages are 0" in caplog.text
    assert record["rollout_tokens_per_s"] == 120.0
