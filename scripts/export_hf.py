"""Turn a dense checkpoint (MiniMind .pth, .safetensors or HF folder) into a transformers folder.

Usage: python scripts/export_hf.py CHECKPOINT OUT_DIR [--tokenizer DIR] [Hydra overrides, e.g. model=minimind3]
The folder then loads with `AutoModelForCausalLM.from_pretrained(OUT_DIR)` after `import minimind`.
"""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402

from checkpoint.dense import load_dense_into  # noqa: E402
from minimind import MiniMindForCausalLM  # noqa: E402
from training.cli import CONF_DIR  # noqa: E402
from training.config import model_config, register_schema  # noqa: E402


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit(__doc__)
    checkpoint, out_dir, rest = argv[0], Path(argv[1]), argv[2:]
    tokenizer = None
    if rest[:1] == ["--tokenizer"]:
        tokenizer, rest = rest[1], rest[2:]
    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=rest)
    model = MiniMindForCausalLM(model_config(cfg))
    load_dense_into(model, checkpoint)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tokenizer) / name).exists():
                shutil.copy(Path(tokenizer) / name, out_dir / name)
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
