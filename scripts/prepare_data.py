"""Tokenise a run's data once into the memory-mapped token cache, ahead of training.

    python scripts/prepare_data.py data=jsonl data.path=pretrain.jsonl data.tokenizer=tokenizer_dir
    python scripts/prepare_data.py data=jsonl data.format=chat data.path=sft.jsonl data.tokenizer=... train.seq_len=512

Arguments are the Hydra overrides of train.py. The cache lands in data.cache_dir, keyed by the file, the
tokenizer and the reading rules, so a later `python train.py` with the same data overrides reads it directly
(and every rank memory-maps it instead of tokenising). Bad data: one line, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from training.config import register_schema  # noqa: E402
from training.data import DataError, build_splits, build_tokenizer, geometry, run_data_spec  # noqa: E402
from training.data.build import source_folder  # noqa: E402
from training.data.validate import spec_problem  # noqa: E402

EXIT_DATA_ERROR = 2


def prepare(overrides: list[str]) -> list[str]:
    """Build the tokenizer and the token caches of the composed config; return a summary, one line each."""
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    spec, geo = run_data_spec(cfg), geometry(cfg)
    problem = spec_problem(spec)
    if problem is not None:
        raise DataError(problem)
    tokenizer = build_tokenizer(spec)
    splits = build_splits(spec, geo, tokenizer, verbose=True)
    keys = ["data.path"] + (["data.val_path"] if spec.val_path is not None else [])
    lines = [f"{key}: cache {source_folder(spec, key, tokenizer)}" for key in keys]
    lines.append(f"samples of {geo.seq_len} tokens ({spec.format}): {len(splits.train)} training, "
                 f"{len(splits.val) if splits.val is not None else 0} held out; "
                 f"{splits.skipped_lines} bad lines skipped")
    return lines


def main(argv: list[str]) -> None:
    try:
        lines = prepare(argv)
    except DataError as error:
        print(f"sluice: data error: {error}", file=sys.stderr)
        sys.exit(EXIT_DATA_ERROR)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
