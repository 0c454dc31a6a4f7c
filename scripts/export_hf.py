"""Export a trained model: a self-contained Hugging Face folder (default) or a MiniMind .pth.

Usage:
  python scripts/export_hf.py RUN_DIR_OR_CHECKPOINT OUT [--format hf|minimind|pth] [--adapters-only] [--force]
                          [--pth-dtype fp16|bf16|fp32]
  python scripts/export_hf.py DENSE.pth|DENSE.safetensors|HF_DIR OUT [--format hf|minimind|pth] [--tokenizer DIR] \
[model=...]

A training checkpoint (a run directory, its checkpoints/ folder or one step_<N>/) carries its model config and
tokenizer. A dense file does not: give the model with Hydra overrides (e.g. model=tiny) and --tokenizer; an HF folder's
own config.json gives it (model.hf_config=HF_DIR, unless model overrides are given).
--format hf (default) writes the stock transformers family that computes the model: a MiniMind model as Qwen3 or
Qwen3-MoE (checked on the weights: same keys, same logits), so `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load it without custom code; --format minimind writes MiniMind's own classes
(load with trust_remote_code=True); --format pth a MiniMind state_dict (fp16 as MiniMind's; --pth-dtype fp32 keeps
every trained bit) named as MiniMind names the run's stage (pretrain_<hidden>.pth, full_sft_<hidden>.pth, dpo_...,
grpo_..., full_dist_...; a dense source: pretrain_...).
A LoRA run's checkpoint exports its adapters merged into the weights; --adapters-only writes them alone: a PEFT
folder (adapter_config.json, adapter_model.safetensors) for `PeftModel.from_pretrained(base, OUT)`, or with
--format pth MiniMind's LoRA .pth for its `apply_lora(model)` then `load_lora(model, OUT)`.
OUT must be new (or an empty folder): --force replaces an existing one as a whole. Every file is written under a
temporary name and renamed into place (a folder: built beside OUT, then renamed), never through a link; OUT may not
be a link, nor the source or a folder holding it. A failed export leaves OUT as it was.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402

from checkpoint.dense import CheckpointError, load_dense_into  # noqa: E402
from checkpoint.disk import disk_cause  # noqa: E402
from models import ModelError  # noqa: E402
from checkpoint.export import FORMATS, PTH_DTYPES, export_checkpoint, save_hf_folder, save_pth  # noqa: E402
from checkpoint.manager import find_checkpoint, read_meta  # noqa: E402


def export_dense(source: str, out: str, fmt: str, tokenizer: str | None, overrides: list[str],
                 pth_dtype: torch.dtype = torch.float16) -> Path:
    """A dense checkpoint needs the model config from Hydra overrides."""
    from hydra import compose, initialize_config_dir

    from models import build_model
    from training.launch.cli import CONF_DIR
    from training.config import model_config, register_schema

    register_schema()
    if (Path(source) / "config.json").is_file() and not any(o.lstrip("+").startswith("model") for o in overrides):
        overrides = [f"model.hf_config={Path(source).resolve()}", *overrides]  # an HF folder says what model it is
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name="config", overrides=overrides)
        except Exception as error:  # Hydra's composition errors: one line
            raise CheckpointError(f"overrides {' '.join(overrides)}: {str(error).strip().splitlines()[0]}") from None
    model = build_model(model_config(cfg), "cpu")
    load_dense_into(model, source)
    return save_pth(model, out, dtype=pth_dtype) if fmt == "pth" else save_hf_folder(model, out, tokenizer, fmt=fmt)


def written(out: Path, adapters_only: bool) -> str:
    """What the export wrote and how it loads, in one line."""
    config = out / "config.json"
    if out.suffix == ".pth":
        how = "MiniMind's LoRA: apply_lora(model) then load_lora(model, path)" if adapters_only else \
            "a MiniMind state_dict: model.load_state_dict(torch.load(path))"
        return f"wrote {out} ({how})"
    if not config.is_file():
        return f"wrote {out} (a PEFT folder: PeftModel.from_pretrained(base, folder))"
    architecture = (json.loads(config.read_text()).get("architectures") or ["?"])[0]
    custom = "auto_map" in json.loads(config.read_text())
    how = "its own code: load with trust_remote_code=True" if custom else "loads without trust_remote_code"
    return f"wrote {out} ({architecture}; {how})"


def check_paths(source: Path, out: Path, fmt: str, force: bool) -> None:
    """The source exists; OUT can be written and holds nothing an export would silently mix with."""
    from training.config.output_paths import output_dir_problem, output_file_problem

    if not source.exists():
        raise CheckpointError(f"SOURCE={source} does not exist; give a run directory, a checkpoint or dense weights")
    if out.is_symlink():
        raise CheckpointError(f"OUT={out} is a symbolic link; refusing to write through it (it may lead anywhere): "
                              "give a real path")
    real_out, real_source = os.path.realpath(out), os.path.realpath(source)
    if os.path.commonpath([real_out, real_source]) == real_out:
        raise CheckpointError(f"OUT={out} is the source or holds it ({source}); an export would replace what it "
                              "reads: choose another OUT")
    if fmt == "pth":
        problem = output_file_problem(out, "OUT")
        if problem is None and out.exists() and not force:
            problem = f"OUT={out} exists; choose a new file or pass --force to replace it"
    else:
        problem = output_dir_problem(out, "OUT")
        if problem is None and out.is_dir() and any(out.iterdir()) and not force:
            problem = (f"OUT={out} is a folder that already holds files; choose a new one or pass --force to "
                       "replace it")
    if problem:
        raise CheckpointError(problem)


def main(argv: list[str]) -> int:
    usage = __doc__.split("Usage:\n", 1)[1].split("\n\n")[0].strip()  # the two forms, as the docstring gives them
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=usage,
                                     epilog=__doc__.split("\n\n", 2)[2].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--format", choices=FORMATS, default="hf")
    parser.add_argument("--tokenizer", help="tokenizer folder (dense sources only)")
    parser.add_argument("--pth-dtype", choices=PTH_DTYPES, default="fp16",
                        help="--format pth: the weights' precision (fp16, as MiniMind saves its .pth; fp32 keeps every "
                        "trained bit)")
    parser.add_argument("--force", action="store_true", help="replace an existing, non-empty OUT as a whole")
    parser.add_argument("--adapters-only", action="store_true",
                        help="a LoRA checkpoint's adapters alone: a PEFT folder, or MiniMind's LoRA .pth with "
                        "--format pth (training checkpoints only)")
    args, overrides = parser.parse_known_args(argv)
    try:
        check_paths(Path(args.source), Path(args.out), args.format, args.force)
        if (checkpoint := find_checkpoint(Path(args.source))) is not None:
            if overrides or args.tokenizer:
                parser.error("a training checkpoint carries its model and tokenizer: drop the overrides")
            out = export_checkpoint(checkpoint, args.out, args.format, args.adapters_only, PTH_DTYPES[args.pth_dtype])
            print(f"exported step {read_meta(checkpoint)['step']} ({checkpoint})")
        elif args.adapters_only:
            parser.error("--adapters-only exports a LoRA run's training checkpoint; dense weights hold no adapters")
        else:
            out = export_dense(args.source, args.out, args.format, args.tokenizer, overrides,
                               PTH_DTYPES[args.pth_dtype])
    except (CheckpointError, ModelError) as error:
        print(f"export_hf: {error}", file=sys.stderr)
        return 2
    except (OSError, SafetensorError) as error:  # the disk said no mid-write: the partial output is already gone
        cause = disk_cause(error) or disk_cause(getattr(error, "__context__", None)) or \
            (str(error).strip().splitlines() or [type(error).__name__])[0]
        print(f"export_hf: writing {args.out} failed: {cause}; nothing was written: free space or choose another "
              "OUT", file=sys.stderr)
        return 1
    print(written(Path(out), args.adapters_only))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
