"""MiniMind's trainer arguments (trainer/train_*.py: `--batch_size 32`) and the Sluice keys that mean the same: the
answer to a `--flag value` on train.py's command line, and the table of docs/configuration.md (one home for both)."""

import re

# MiniMind's argument -> the Sluice override(s) that do what it does; `{value}` is the value the user gave.
MINIMIND_ARGS: dict[str, str] = {
    "epochs": "train.epochs={value} (the steps are derived from the data: epochs x training samples / samples per "
              "step, printed in the run header)",
    "batch_size": "train.micro_batch_size={value}",
    "accumulation_steps": "schedule.n_microbatches={value} (the micro-batches of one optimizer step)",
    "learning_rate": "optim.lr={value}",
    "dtype": "train.dtype=bf16 (or fp32; auto picks bf16 on CUDA)",
    "grad_clip": "train.grad_clip={value}",
    "log_interval": "train.log_every={value}",
    "save_interval": "checkpoint.every={value}",
    "save_dir": "hydra.run.dir={value} (checkpoints go to its checkpoints/)",
    "save_weight": "checkpoint.export_pth=true (writes MiniMind's <run dir>/out/<stage>_<hidden>.pth at each save: "
                   "pretrain, full_sft, dpo, grpo, full_dist by train.task)",
    "hidden_size": "model.hidden_size={value}",
    "num_hidden_layers": "model.num_hidden_layers={value}",
    "max_seq_len": "train.seq_len={value}",
    "use_moe": "model=minimind3-moe (or model.use_moe=true on another preset)",
    "data_path": "data=jsonl data.path={value}",
    "from_weight": "checkpoint.load_dense=<the weights file or folder, e.g. {value}_768.pth>",
    "from_resume": "checkpoint.resume=auto with the interrupted run's hydra.run.dir (a fresh directory whose "
                   "overrides match an earlier run's is refused, naming that run)",
    "device": "nothing: parallel.backend=auto takes NCCL and the GPUs where there are any",
    "num_workers": "nothing: the data is tokenised once and read from data.cache_dir",
    "use_wandb": "logger=wandb",
    "wandb_project": "logger.project={value}",
    "use_compile": "train.compile=true",
    "lora_name": "lora=minimind (the adapter is saved with the run's checkpoints)",
    "beta": "dpo.beta={value} (train.task=dpo) or grpo.beta={value} (train.task=grpo)",
    "alpha": "distill.alpha={value}",
    "temperature": "distill.temperature={value} (train.task=distill) or grpo.temperature={value} (train.task=grpo)",
    "from_teacher_weight": "distill.teacher=<the teacher's run directory, folder or weights file>",
    "from_student_weight": "checkpoint.load_dense=<the student's weights file or folder>",
    "student_hidden_size": "model.hidden_size={value}",
    "student_num_layers": "model.num_hidden_layers={value}",
    "student_use_moe": "model.use_moe=true",
    "teacher_hidden_size": "nothing: the teacher's size comes with distill.teacher",
    "teacher_num_layers": "nothing: the teacher's size comes with distill.teacher",
    "teacher_use_moe": "nothing: the teacher's config comes with distill.teacher",
    "max_gen_len": "grpo.max_new_tokens={value}",
    "num_generations": "grpo.num_generations={value}",
    "loss_type": "grpo.loss_type={value}",
    "epsilon": "grpo.epsilon={value}",
    "epsilon_high": "grpo.epsilon_high={value}",
    "reward_model_path": "grpo.reward_model={value}",
    "debug_mode": "grpo.sample_every=<steps> (samples go to <run dir>/rollouts.jsonl)",
    "debug_interval": "grpo.sample_every={value}",
    "thinking_ratio": "grpo.thinking_ratio={value}",
    "rollout_engine": "nothing: rollouts are generated in the training layout, where the weights are",
    "sglang_base_url": "nothing: no SGLang server; rollouts are generated in the training layout",
    "sglang_model_path": "nothing: no SGLang server; rollouts are generated in the training layout",
    "sglang_shared_path": "nothing: no SGLang server; rollouts are generated in the training layout",
    "max_total_len": "train.seq_len={value} (train_agent.py's multi-turn tool RL has no counterpart; "
                     "train.task=grpo is single-turn)",
}
# train_ppo.py's own arguments: Sluice's RL is GRPO / CISPO (train.task=grpo), which has no critic or value loss.
PPO_ONLY = ("critic_learning_rate", "clip_epsilon", "vf_coef", "kl_coef", "gamma", "lam", "cliprange_value",
            "ppo_update_iters", "early_stop_kl", "mini_batch_size", "debug_log_ratio")
MINIMIND_ARGS.update({name: "nothing: PPO (train_ppo.py) is not implemented; train.task=grpo is Sluice's RL "
                            "(grpo.epsilon, grpo.beta, grpo.loss_type)" for name in PPO_ONLY})
FLAG = re.compile(r"--?([A-Za-z][\w-]*)(?:=(.*))?")


def minimind_flag_problem(argv: list[str], known: set[str]) -> str | None:
    """One line for the first `--flag [value]` of `argv` that Hydra does not know (`known`): MiniMind's arguments
    name the Sluice key that means the same, others say that train.py takes key=value overrides."""
    for i, word in enumerate(argv):
        match = FLAG.fullmatch(word)
        if not match or word.split("=")[0] in known:
            continue
        name, value = match.group(1).replace("-", "_"), match.group(2)
        if value is None and i + 1 < len(argv) and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]:
            value = argv[i + 1]
        given = f"{word} {value}" if value is not None and "=" not in word else word
        if name in MINIMIND_ARGS:
            return (f"{given} is MiniMind's argument; train.py takes key=value overrides: "
                    f"{MINIMIND_ARGS[name].format(value=value if value is not None else '<value>')} "
                    "(docs/configuration.md#from-minimind lists them all)")
        return (f"{given}: train.py has no option {word.split('=')[0]}; it takes key=value overrides "
                "(python train.py --help lists every key) and Hydra's flags (python train.py --hydra-help)")
    return None


def minimind_table() -> str:
    """The markdown table of docs/configuration.md: each MiniMind argument and the Sluice override it maps to."""
    rows = ["| MiniMind argument | Sluice |", "|---|---|"]
    rows += [f"| `--{name}` | {meaning.format(value='<value>').replace('<', '&lt;').replace('>', '&gt;')} |"
             for name, meaning in MINIMIND_ARGS.items()]
    return "\n".join(rows)
