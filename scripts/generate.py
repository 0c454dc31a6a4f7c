"""Greedy or sampled text generation from an exported folder (scripts/export_hf.py), a MiniMind `.pth` or a training
checkpoint, one prompt or a multi-turn chat.

Usage: python scripts/generate.py MODEL "prompt" [--chat] [--interactive] [--max-new-tokens N] [--temperature T]
                                  [--top-p P] [--seed S] [--tokenizer DIR] [--trust-remote-code]
                                  [--layout parallel.tp=2 parallel.pp=2 ...]
MODEL is an exported folder (config.json, weights, tokenizer: transformers' `generate` runs it), a MiniMind `.pth`
(MiniMind's `out/full_sft_768.pth`, or the `<run>/out/*.pth` of `checkpoint.export_pth=true`: its config read from
the shapes, its tokenizer `--tokenizer DIR` or the run's that wrote it), or a training checkpoint, a checkpoints
folder or a run directory (its newest checkpoint and the tokenizer saved with it: Sluice's own engine runs it, by
the generation schedule, in one process or in the layout `--layout` names, whose workers this script launches;
every layout prints the same text for the same seed).
`--chat` sends the prompt as a user turn rendered with the folder's chat template, as SFT and DPO trained on it.
`--interactive` chats: after the prompt (optional) each line read from stdin is the next user turn, the whole
conversation rendered with the chat template each time (an exported folder or a `.pth`); an empty line or EOF ends it.
Code shipped in a folder (its config.json's auto_map: `--format minimind` exports, other projects' folders) runs only
with `--trust-remote-code`; pass it only for folders you trust (docs/checkpoints.md). Bad input (config values, a
failing chat template, custom code not trusted) is one line and exit 2.
"""

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint.dense import CheckpointError, check_dense_files, read_dense_state_dict  # noqa: E402
from checkpoint.manager import TOKENIZER, find_checkpoint, read_meta  # noqa: E402
from models.config_values import config_values_problem  # noqa: E402
from models.model_size import host_memory, size_problem  # noqa: E402
from parallel.generation import Sampling  # noqa: E402
from training.launch.generation_run import generate_in_workers, layout_problem, parse_layout  # noqa: E402


class InputError(ValueError):
    """A bad argument, said in one line."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("prompt", nargs="?", default="")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--chat", action="store_true", help="the prompt is a user turn of a conversation")
    parser.add_argument("--interactive", action="store_true",
                        help="a multi-turn chat: each stdin line is the next user turn (implies --chat)")
    parser.add_argument("--tokenizer", default=None, help="a .pth's tokenizer folder (default: its run's)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the modeling code the folder ships (its config.json's auto_map)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (a training checkpoint)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (a training checkpoint)")
    parser.add_argument("--layout", nargs="+", default=[], metavar="KEY=VALUE",
                        help="a training checkpoint's layout: parallel.dp/tp/pp/ep/vpp/emulate, schedule")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    if not args.temperature >= 0:  # also refuses nan
        raise InputError(f"--temperature={args.temperature} must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise InputError(f"--top-p={args.top_p} must be in (0, 1]")
    folder = Path(args.model_dir)
    args.chat = args.chat or args.interactive
    if not args.prompt and not args.interactive:
        raise InputError("give a prompt, or --interactive to read the turns from stdin")
    args.pth = folder.suffix == ".pth" and folder.is_file()
    args.checkpoint = None if (folder / "config.json").is_file() or args.pth else find_checkpoint(folder)
    if args.interactive and args.checkpoint is not None:
        raise InputError("--interactive chats with an exported folder or a .pth; export the checkpoint "
                         "(scripts/export_hf.py) or pass its run's out/*.pth (checkpoint.export_pth=true)")
    if not (folder / "config.json").is_file() and not args.pth and args.checkpoint is None:
        raise InputError(f"{folder} is not an exported model folder (no config.json) nor a training checkpoint; make "
                         "one with scripts/export_hf.py or pass a run directory")
    if args.layout and args.checkpoint is None:
        raise InputError("--layout runs a training checkpoint; an exported folder generates in one process")
    try:
        args.layout = parse_layout(args.layout)
    except ValueError as error:
        raise InputError(str(error)) from None
    return args


def check_config_values(folder: str) -> dict:
    """The folder's config.json holds values a model can be built from (sizes, activation, rope type)."""
    try:
        data = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: arrays nested past Python's stack
        raise InputError(f"{folder}: its config.json is not readable JSON ({error})") from None
    if not isinstance(data, dict):
        raise InputError(f"{folder}: its config.json holds {type(data).__name__}, not an object of fields")
    if problem := config_values_problem(data, f"{folder}: its config.json's") or \
            size_problem(data, f"{folder}: its config.json's", host_memory()):  # the model is built whole here
        raise InputError(problem)
    return data


def check_weights(folder: str) -> None:
    """The weights the folder loads are regular files inside it: a link that leaves it is refused, never read."""
    try:
        check_dense_files(folder)
    except CheckpointError as error:
        raise InputError(str(error).replace("checkpoint.load_dense=", "")) from None


def check_trust(folder: str, data: dict, trusted: bool) -> None:
    """Code the folder ships runs only when asked: without --trust-remote-code such a folder is one line, exit 2."""
    if "auto_map" in data and not trusted:
        raise InputError(f"{folder} ships its own modeling code (auto_map in its config.json); pass "
                         "--trust-remote-code to run it if you trust the folder, or export with --format hf (stock "
                         "transformers classes)")


def loading(what: str, folder: str, load):
    """`load(folder)`, or one line saying why the folder does not load."""
    try:
        return load(folder)
    except (OSError, ValueError, TypeError, KeyError, ZeroDivisionError, RuntimeError) as error:
        # what a config or weights that passed check_config_values can still raise while building or loading
        raise InputError(f"{folder}: its {what} does not load: {str(error).strip().splitlines()[0]}") from None


def prompt_ids(tokenizer, prompt: str, chat: bool, folder: str, history: list[dict] | None = None) -> torch.Tensor:
    """The prompt's ids: after BOS as plain text, or as a user turn (after the conversation's `history`) with the
    chat template's assistant opening (encoded without added specials, as the chat data was for training)."""
    if not chat:
        return tokenizer((tokenizer.bos_token or "") + prompt, return_tensors="pt").input_ids
    if not tokenizer.chat_template:
        raise InputError(f"{folder}: its tokenizer has no chat template; drop --chat or export with a chat tokenizer")
    try:
        text = tokenizer.apply_chat_template([*(history or []), {"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as error:  # a Jinja syntax error, or the template's own raise_exception(...)
        raise InputError(f"{folder}: its chat template fails on a user turn ({type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else 'no message'}); fix "
                         "chat_template in the folder or drop --chat") from None
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def check_context(prompt_tokens: int, max_new_tokens: int, context: int | None) -> None:
    """The prompt and the tokens to generate fit the model's context (its rotary tables end there)."""
    if context is None or prompt_tokens + max_new_tokens <= context:
        return
    if prompt_tokens >= context:
        raise InputError(f"the prompt alone is {prompt_tokens} tokens, over the model's context of {context}; "
                         "shorten it")
    raise InputError(f"the prompt is {prompt_tokens} tokens and --max-new-tokens={max_new_tokens}: together over the "
                     f"model's context of {context} tokens; use --max-new-tokens {context - prompt_tokens} or fewer")


def from_checkpoint(args: argparse.Namespace) -> int:
    """A training checkpoint through Sluice's engine, in one process or the `--layout` it names."""
    try:
        meta = read_meta(args.checkpoint)
        folder = args.checkpoint / TOKENIZER
        if not folder.is_dir():
            raise InputError(f"{args.checkpoint} holds no tokenizer (the run had none to save); export the weights "
                             "with scripts/export_hf.py --tokenizer DIR and generate from that folder")
        tokenizer = loading("tokenizer", str(folder), lambda f: AutoTokenizer.from_pretrained(f, local_files_only=True))
        ids = prompt_ids(tokenizer, args.prompt, args.chat, str(folder))
        check_context(ids.shape[1], args.max_new_tokens, meta["model"].get("max_position_embeddings"))
        if problem := layout_problem(meta, args.layout):
            raise InputError(problem)
    except (InputError, CheckpointError, ValueError) as error:
        print(f"generate: {error}", file=sys.stderr)
        return 2
    sampling = Sampling(args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0, seed=args.seed)
    mask = torch.ones_like(ids, dtype=torch.bool)
    rollout = generate_in_workers(args.checkpoint, args.layout, ids, mask, sampling)
    completion = rollout.tokens[0, ids.shape[1]:][rollout.completion_mask[0]]
    print(tokenizer.decode(completion, skip_special_tokens=True))
    return 0


def pth_tokenizer_folder(pth: Path, given: str | None) -> Path:
    """The tokenizer of a `.pth`: `--tokenizer`, else the one its run saved (`<run>/out/x.pth` -> the run's newest
    checkpoint's)."""
    if given is not None:
        return Path(given)
    saved = find_checkpoint(pth.resolve().parent.parent)
    if saved is None or not (saved / TOKENIZER).is_dir():
        raise InputError(f"{pth} has no tokenizer beside it; pass --tokenizer <folder> (MiniMind's model/ folder, or "
                         "the run's checkpoints/step_N/tokenizer)")
    return saved / TOKENIZER


def load_pth(args: argparse.Namespace):
    """(model loader, tokenizer, context) of a MiniMind `.pth`: its config from the tensors' shapes."""
    from checkpoint.pth_config import pth_config
    from models import build_model

    folder = str(pth_tokenizer_folder(Path(args.model_dir), args.tokenizer))
    tokenizer = loading("tokenizer", folder, lambda f: AutoTokenizer.from_pretrained(f, local_files_only=True))
    try:
        state = read_dense_state_dict(args.model_dir)
        config = pth_config(state, args.model_dir)
    except CheckpointError as error:
        raise InputError(str(error).replace("checkpoint.load_dense=", "")) from None
    def model():
        built = build_model(config, "cpu")
        built.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)  # a tied head stored once
        return built.eval()
    return model, tokenizer, config.max_position_embeddings


def load_folder(args: argparse.Namespace):
    """(model loader, tokenizer, context) of an exported folder, through transformers' own classes; the model is
    loaded once the prompt is known to fit."""
    trust = args.trust_remote_code
    check_trust(args.model_dir, check_config_values(args.model_dir), trust)
    check_weights(args.model_dir)
    config = loading("config", args.model_dir,
                     lambda f: AutoConfig.from_pretrained(f, local_files_only=True, trust_remote_code=trust))
    tokenizer = loading("tokenizer", args.model_dir,
                        lambda f: AutoTokenizer.from_pretrained(f, local_files_only=True, trust_remote_code=trust))
    def model():
        return loading("model", args.model_dir, lambda f: AutoModelForCausalLM.from_pretrained(
            f, local_files_only=True, trust_remote_code=trust).eval())
    return model, tokenizer, getattr(config, "max_position_embeddings", None)


def reply(model, tokenizer, ids: torch.Tensor, args: argparse.Namespace) -> str:
    """The model's continuation of `ids` by transformers' `generate`, decoded."""
    sampled = args.temperature > 0
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=sampled, temperature=args.temperature if sampled else None,
                             top_p=args.top_p if sampled else None,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def turns(first: str) -> Iterator[str]:
    """The user turns of a chat: the prompt (if any), then each stdin line until an empty one or EOF."""
    if first:
        yield first
    while line := (input("> ") if sys.stdin.isatty() else sys.stdin.readline()).strip():
        yield line


def chat(model, tokenizer, context: int | None, args: argparse.Namespace) -> None:
    """A multi-turn conversation: every turn sees the ones before it, as MiniMind's eval_llm.py keeps its history."""
    history: list[dict] = []
    for turn in turns(args.prompt):
        ids = prompt_ids(tokenizer, turn, True, args.model_dir, history)
        check_context(ids.shape[1], args.max_new_tokens, context)
        answer = reply(model, tokenizer, ids, args)
        print(answer, flush=True)
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
        if args.checkpoint is not None:
            return from_checkpoint(args)
        if args.seed is not None:
            torch.manual_seed(args.seed)
        load_model, tokenizer, context = load_pth(args) if args.pth else load_folder(args)
        if args.interactive:
            chat(load_model(), tokenizer, context, args)
            return 0
        ids = prompt_ids(tokenizer, args.prompt, args.chat, args.model_dir)
        check_context(ids.shape[1], args.max_new_tokens, context)
        model = load_model()
    except InputError as error:
        print(f"generate: {error}", file=sys.stderr)
        return 2
    print(reply(model, tokenizer, ids, args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
