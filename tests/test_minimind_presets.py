"""MiniMind's vocabulary (issue 48 item 4): `experiment=minimind_*` and `optim=minimind` hold the defaults of MiniMind's
trainer scripts, `train.epochs` derives the steps from the data, and MiniMind's `--epochs 2` names `train.epochs=2`."""

import pytest

from training.config import ConfigError
from training.config.validate import validate
from training.config.minimind_args import MINIMIND_ARGS, minimind_flag_problem
from training.config.run_length import epoch_steps, length_problem
from training.config.schema import compose_config
from training.launch.cli import HYDRA_FLAGS, explain_compose_error

# MiniMind's argparse defaults (trainer/train_*.py at jingyaogong/minimind HEAD): stage -> (epochs, batch_size,
# accumulation_steps, learning_rate, max_seq_len); the batch of DPO counts pairs, of GRPO prompts.
MINIMIND = {"pretrain": (2, 32, 8, 5e-4, 340), "sft": (2, 16, 1, 1e-5, 768), "lora": (10, 32, 1, 1e-4, 340),
            "dpo": (1, 4, 1, 4e-8, 1024), "distill": (6, 32, 1, 5e-6, 340), "grpo": (1, 2, 1, 3e-7, 768)}
SEQUENCES_PER_ROW = {"dpo": 2, "grpo": 6}  # a pair is two sequences; a prompt, num_generations completions
# Every argument of MiniMind's trainer scripts (train_pretrain, full_sft, lora, dpo, distillation, grpo, agent, ppo).
ARGUMENTS = """accumulation_steps alpha batch_size beta clip_epsilon cliprange_value critic_learning_rate data_path
debug_interval debug_log_ratio debug_mode device dtype early_stop_kl epochs epsilon epsilon_high from_resume
from_student_weight from_teacher_weight from_weight gamma grad_clip hidden_size kl_coef lam learning_rate log_interval
lora_name loss_type max_gen_len max_seq_len max_total_len mini_batch_size num_generations num_hidden_layers
num_workers ppo_update_iters reward_model_path rollout_engine save_dir save_interval save_weight sglang_base_url
sglang_model_path sglang_shared_path student_hidden_size student_num_layers student_use_moe teacher_hidden_size
teacher_num_layers teacher_use_moe temperature thinking_ratio use_compile use_moe use_wandb vf_coef wandb_project
warmup_steps""".split()


@pytest.mark.parametrize("stage", sorted(MINIMIND))
def test_each_minimind_preset_holds_its_trainer_scripts_defaults(stage):
    cfg = compose_config([f"experiment=minimind_{stage}"])
    epochs, batch, accumulation, lr, seq_len = MINIMIND[stage]
    assert (cfg.train.epochs, cfg.train.micro_batch_size, cfg.schedule.n_microbatches, cfg.optim.lr,
            cfg.train.seq_len) == (epochs, batch * SEQUENCES_PER_ROW.get(stage, 1), accumulation, lr, seq_len)
    assert (list(cfg.optim.betas), cfg.optim.warmup_steps, cfg.optim.min_lr_ratio, cfg.optim.weight_decay) == \
        ([0.9, 0.999], 0, 0.1, 0.01)  # torch's AdamW defaults; get_lr: cosine from lr to lr/10, no warm-up
    assert (cfg.model.name, cfg.data.name, cfg.train.grad_clip) == ("minimind3", "jsonl", 1.0)
    assert cfg.train.task == {"lora": "sft"}.get(stage, stage) and (cfg.lora.rank == 16) == (stage == "lora")
    assert cfg.checkpoint.export_pth == (stage != "lora")  # LoRA's adapters are saved with the run's checkpoints
    if stage == "dpo":
        assert cfg.dpo.beta == 0.15
    if stage == "distill":
        assert (cfg.distill.alpha, cfg.distill.temperature) == (0.5, 1.5)
    if stage == "grpo":
        g = cfg.grpo
        assert (g.num_generations, g.max_new_tokens, g.beta, g.loss_type, g.epsilon, g.epsilon_high,
                g.thinking_ratio) == (6, 1024, 0.1, "cispo", 0.2, 5.0, 0.9)
    assert compose_config([f"experiment=minimind_{stage}", "model=minimind3-moe"]).model.use_moe


def test_every_minimind_argument_has_an_answer():
    assert sorted(set(ARGUMENTS) - {"warmup_steps"} - set(MINIMIND_ARGS)) == []
    assert minimind_flag_problem(["--epochs", "2"], HYDRA_FLAGS) == (
        "--epochs 2 is MiniMind's argument; train.py takes key=value overrides: train.epochs=2 (the steps are derived "
        "from the data: epochs x training samples / samples per step, printed in the run header) "
        "(docs/configuration.md#from-minimind lists them all)")


def test_epochs_become_steps_and_the_command_line_sets_one_length():
    assert [epoch_steps(2, 1000, 32), epoch_steps(0.1, 30, 1), epoch_steps(1, 64, 32), epoch_steps(1e-9, 5, 4)] == \
        [63, 3, 2, 1]  # 62.5 steps round up; 0.1 x 30 is 3.0000000000000004 in floats, still 3 steps
    cfg = compose_config(["train.epochs=2"])
    assert length_problem(["train.epochs=2", "train.steps=10"], cfg) == (
        "train.steps=10 and train.epochs=2 both set the run's length; keep one (train.epochs=null to count in steps)")
    preset = compose_config(["experiment=minimind_sft"])
    assert length_problem(["experiment=minimind_sft", "train.steps=10"], preset) == (
        "train.steps=10 and train.epochs=2 (set by experiment=minimind_sft) both set the run's length; keep one "
        "(train.epochs=null to count in steps)")
    assert length_problem(["experiment=minimind_sft", "train.steps=10", "train.epochs=null"],
                          compose_config(["experiment=minimind_sft", "train.epochs=null"])) is None
    with pytest.raises(ConfigError, match=r"^train.epochs=0.0 must be positive"):
        validate(compose_config(["model=tiny", "train.epochs=0"]))
    with pytest.raises(Exception) as error:
        compose_config(["train.epochs=two"])
    assert explain_compose_error(error.value, ["train.epochs=two"]).startswith("train.epochs: Value 'two' ")
