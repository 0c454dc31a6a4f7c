"""`grpo.reward_model`: a local transformers sequence-classification model that scores each prompt with its answer,
forward only, clipped to [-3, 3] as MiniMind's LMForRewardModel clips its scores (trainer/trainer_utils.py,
jingyaogong/minimind). As there, the answer is the completion after its `</think>` block where it has one.

The folder is a stock family (no `auto_map`: no code of its own runs) whose tokenizer gives every token the id the
run's tokenizer gives it, so the policy's text means the same to it."""

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from training.methods.grpo.rewards import THINK_END
from training.data.tokenizer import load_tokenizer

SCORE_CLIP = 3.0


def reward_model_problem(folder: str | None, tokenizer: PreTrainedTokenizerBase | None) -> str | None:
    """One line when `folder` cannot score this run's completions: missing, no config.json, not a
    sequence classifier, custom code, or another tokenizer (checked when `tokenizer` is given); else None."""
    if folder is None:
        return None
    path = Path(folder)
    key = f"grpo.reward_model={folder}"
    if not (path / "config.json").is_file():
        return f"{key} has no config.json; give a folder written by save_pretrained of a sequence-classification model"
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # transformers raises many types for an unreadable config
        return f"{key}: its config.json does not load ({(str(error).strip().splitlines() or ['?'])[0]})"
    if getattr(config, "auto_map", None):
        return f"{key} names code of its own (auto_map); Sluice runs stock transformers families only"
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return (f"{key} is not a sequence classifier (architectures {architectures or 'unset'}); give a "
                "*ForSequenceClassification model's folder")
    if tokenizer is not None:
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            return f"{key} holds no tokenizer; save the run's tokenizer beside the model (tokenizer.save_pretrained)"

        theirs, ours = load_tokenizer(path).get_vocab(), tokenizer.get_vocab()
        if theirs != ours:
            differ = sum(theirs.get(token) != i for token, i in ours.items())
            return (f"{key} has another tokenizer than the run's: {differ} of the run's {len(ours)} tokens have "
                    "other ids there; a reward model must read the policy's tokens as the policy writes them")
    return None


class RewardModel:
    """The classifier, loaded whole on the CPU or the device, in eval mode; a reward callable (prompts, completions
    -> one float per completion)."""

    def __init__(self, folder: str, tokenizer: PreTrainedTokenizerBase, device: torch.device):
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).to(device)
        self.model.eval().requires_grad_(False)
        self.tokenizer, self.device = tokenizer, device

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        scores = []
        for prompt, completion in zip(prompts, completions):  # one at a time, as MiniMind: no padding to get wrong
            answer = completion.split(THINK_END, 1)[1].strip() if THINK_END in completion else completion
            ids = self.tokenizer(prompt + answer, add_special_tokens=False, return_tensors="pt").input_ids
            score = float(self.model(input_ids=ids.to(self.device)).logits[0, 0])
            scores.append(max(min(score, SCORE_CLIP), -SCORE_CLIP))
        return scores
