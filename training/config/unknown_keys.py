"""Strict keys: every key outside the schema is refused, `+` or not, with the nearest valid key suggested."""

from difflib import SequenceMatcher

from omegaconf import DictConfig

from training.config.schema import schema_defaults, schema_sections


# Names other trainers (Megatron-LM, HF Trainer, torchtitan) use for a schema key: spelling is no guide there.
KNOWN_ALIASES = {
    "activation_checkpointing": "train.recompute", "gradient_checkpointing": "train.recompute",
    "learning_rate": "optim.lr", "max_steps": "train.steps", "train_iters": "train.steps",
    "batch_size": "train.micro_batch_size", "seq_length": "train.seq_len", "max_seq_len": "train.seq_len",
    "tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
    # MiniMind's trainer arguments (trainer/train_*.py)
    "data_path": "data.path", "epochs": "train.epochs", "accumulation_steps": "schedule.n_microbatches",
    "grad_clip": "train.grad_clip", "log_interval": "train.log_every", "save_interval": "checkpoint.every",
    "save_dir": "checkpoint.dir", "from_weight": "checkpoint.load_dense", "from_resume": "checkpoint.resume",
    "use_wandb": "logger", "hidden_size": "model.hidden_size", "num_hidden_layers": "model.num_hidden_layers",
    "use_moe": "model.use_moe",
}
# Keys renamed so that a word keeps one meaning (docs/concepts.md#names): old key -> new key.
RENAMED_KEYS = {"parallel.plan": "parallel.layout"}


def nearest_key(key: str) -> str:
    """The schema key closest to `key`: a known alias, else within its section, else by full or leaf name."""
    keys, sections = list(schema_defaults()), schema_sections()
    if key.rpartition(".")[2] in KNOWN_ALIASES:
        return KNOWN_ALIASES[key.rpartition(".")[2]]
    section, _, leaf = key.rpartition(".")
    if section in sections:
        pool = [k for k in keys if k.startswith(f"{section}.")]
        return max(pool, key=lambda k: SequenceMatcher(None, leaf, k.rpartition(".")[2]).ratio())

    def score(candidate: str) -> float:
        return max(SequenceMatcher(None, key, candidate).ratio(),
                   SequenceMatcher(None, key.rpartition(".")[2], candidate.rpartition(".")[2]).ratio())
    return max([*keys, *sections], key=score)


def unknown_key(key: str) -> str:
    """The one-line refusal of a key outside the schema (never suggesting `+`: no key may be added)."""
    if key in RENAMED_KEYS:
        return f"{key}: renamed to {RENAMED_KEYS[key]} (e.g. {RENAMED_KEYS[key]}=auto)"
    return f"{key}: unknown config key; did you mean {nearest_key(key)}? (`python train.py --cfg job` prints every key)"


def override_key_problem(keys: list[str], groups: set[str]) -> str | None:
    """The first override key (already stripped of `+`/`~`) that is neither a schema key nor a config group."""
    known, sections = set(schema_defaults()), set(schema_sections())
    for key in keys:
        if key in known or key in sections or key in groups or key.split(".")[0].split("/")[0] == "hydra":
            continue
        return unknown_key(key)
    return None


def unknown_key_problem(cfg: DictConfig) -> str | None:
    """The first key of a composed config that the schema does not declare (one added with `+`, say)."""
    known, sections = set(schema_defaults()), set(schema_sections())
    for section in cfg.keys():
        if section == "hydra":
            continue
        if section not in sections:
            return unknown_key(str(section))
        node = cfg._get_node(section)
        if isinstance(node, DictConfig):
            for leaf in node.keys():
                if f"{section}.{leaf}" not in known:
                    return unknown_key(f"{section}.{leaf}")
    return None
