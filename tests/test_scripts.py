"""The helper scripts: export a dense .pth to a transformers folder, then generate from it."""

import subprocess
import sys

import torch

from minimind import MiniMindForCausalLM
from tests.conftest import ROOT
from tests.equivalence import compose_run_config
from training.config import model_config
from training.data import synthetic_corpus, train_bpe_tokenizer


def test_export_then_generate(tmp_path):
    cfg = compose_run_config(["model=tiny"], tmp_path / "cache")
    torch.manual_seed(0)
    model = MiniMindForCausalLM(model_config(cfg))
    torch.save(model.state_dict(), tmp_path / "pretrain_64.pth")
    train_bpe_tokenizer(synthetic_corpus(100, seed=0), vocab_size=300).save_pretrained(tmp_path / "tokenizer")
    export = subprocess.run([sys.executable, "scripts/export_hf.py", str(tmp_path / "pretrain_64.pth"),
                             str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "tokenizer"), "model=tiny"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]
    loaded = MiniMindForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    generate = subprocess.run([sys.executable, "scripts/generate.py", str(tmp_path / "hf"), "the cat",
                               "--max-new-tokens", "5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert generate.returncode == 0, generate.stderr[-2000:]
    assert generate.stdout.strip()
