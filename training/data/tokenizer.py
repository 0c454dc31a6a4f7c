"""The tokenizer: MiniMind-style byte-level BPE trained on the synthetic corpus (cached), or a local folder."""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from training.data.corpus import synthetic_corpus
from training.data.spec import DataError, DataSpec
from checkpoint.confine import files_inside

# MiniMind's special tokens, in id order: 0 = pad/unk, 1 = bos, 2 = eos.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
# ChatML, as MiniMind renders conversations: <|im_start|>role\ncontent<|im_end|>\n per message.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Bump when `synthetic_corpus` or the embedded tokenizer changes, so cached tokenizers are rebuilt.
CORPUS_VERSION = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The files AutoTokenizer may read from a weights folder (config.json when tokenizer_config names no class).
WEIGHTS_FOLDER_READS = (*TOKENIZER_FILES, "added_tokens.json", "chat_template.jinja", "chat_template.json",
                        "vocab.json", "merges.txt", "tokenizer.model", "config.json")


def synthetic_tokenizer_dir(spec: DataSpec) -> Path:
    """Cache folder of the tokenizer trained on the synthetic corpus of `spec`."""
    name = f"tokenizer-synthetic-v{CORPUS_VERSION}-seed{spec.seed}-docs{spec.num_docs}-vocab{spec.vocab_size}"
    return Path(spec.cache_dir) / name


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A MiniMind-style byte-level BPE tokenizer (specials 0/1/2, a ChatML template) trained on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,  # listed first: ids 0, 1, 2
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unk
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, unk_token=PAD_TOKEN)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def save_atomically(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save into a temporary sibling folder and rename it into place; a concurrent winner is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)  # atomic; fails if another process already put a full folder there
    except OSError:
        if not (target / "tokenizer.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_json_files(folder: Path) -> None:
    """A truncated or corrupt JSON file of the folder -> one line naming it (before transformers' traceback)."""
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            try:
                json.loads(path.read_bytes())
            except (ValueError, UnicodeDecodeError) as error:
                first = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise DataError(f"tokenizer file '{path}' is corrupt ({first}); restore or regenerate it") from None


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """A local tokenizer folder (never the network, never a write), with MiniMind's specials where it has none."""
    folder = Path(folder)
    _check_json_files(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers/tokenizers raise many types for unreadable folders
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise DataError(f"tokenizer folder '{folder}' cannot be loaded ({first}); check its tokenizer.json") from None
    missing = {
        attr: token
        for attr, token in (("bos_token", BOS_TOKEN), ("eos_token", EOS_TOKEN), ("pad_token", PAD_TOKEN))
        if getattr(tokenizer, attr) is None
    }
    if missing:
        tokenizer.add_special_tokens(missing)  # reuses the ids when the tokens are in the vocab
    return tokenizer


# data.tokenizer=synthetic: the embedded tokenizer (trained on the synthetic corpus, data.vocab_size tokens, with the
# chat template) for JSONL data too, when no tokenizer folder is at hand.
EMBEDDED_TOKENIZER = "synthetic"


def build_tokenizer(spec: DataSpec) -> PreTrainedTokenizerBase:
    """The tokenizer of `spec`: loaded for "jsonl"; for "synthetic" (or data.tokenizer=synthetic) trained by the first
    rank to take a lock file beside the cache folder and loaded by the others (the OS releases a dead holder's lock)."""
    if spec.name == "jsonl" and spec.tokenizer != EMBEDDED_TOKENIZER:
        if spec.tokenizer is None:
            raise DataError("data.tokenizer: not set; pass data.tokenizer=<folder with tokenizer.json>, or "
                            f"{EMBEDDED_TOKENIZER} for the embedded one")
        return load_tokenizer(spec.tokenizer)
    folder = synthetic_tokenizer_dir(spec)
    if not (folder / "tokenizer.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.parent / f".{folder.name}.lock")):
            if not (folder / "tokenizer.json").exists():
                corpus = synthetic_corpus(spec.num_docs, spec.seed)
                save_atomically(train_bpe_tokenizer(corpus, spec.vocab_size), folder)
    return load_tokenizer(folder)


def weights_tokenizer_problem(weights: str | Path | None, spec: DataSpec) -> str | None:
    """One line when the weights folder (checkpoint.load_dense) holds a tokenizer whose ids mean other tokens than
    the tokenizer of `spec`: the model would train on text it reads as other words, and answer in them, without any
    error. The vocabularies are compared, not the `fingerprint`: a chat template of its own changes no token id."""
    folder = Path(weights) if weights else None
    if folder is not None and folder.is_dir():  # what transformers may open there: inside it, regular (a FIFO blocks)
        files_inside(folder, WEIGHTS_FOLDER_READS, "checkpoint.load_dense", DataError)
    if folder is None or not (folder / "tokenizer.json").is_file():
        return None  # a single weights file or a MiniMind .pth: nothing to compare with
    theirs, ours = load_tokenizer(folder).get_vocab(), build_tokenizer(spec).get_vocab()
    if theirs == ours:
        return None
    differ = sum(theirs.get(token) != i for token, i in ours.items())
    if spec.name == "synthetic" or spec.tokenizer == EMBEDDED_TOKENIZER:
        mine = f"the embedded tokenizer of data.num_docs={spec.num_docs}, data.seed={spec.seed}"
        fix = "set data.num_docs and data.seed to those of the run that trained the weights"
    else:
        mine, fix = f"data.tokenizer={spec.tokenizer}", f"set data.tokenizer={folder}"
    return (f"checkpoint.load_dense={folder} was trained with another tokenizer than this run's ({mine}): "
            f"{differ} of this run's {len(ours)} tokens have other ids there; {fix}")


def tokenizer_vocab_size(spec: DataSpec) -> int:
    """Token ids the tokenizer of `spec` can produce, without training anything (synthetic: data.vocab_size)."""
    if spec.name == "synthetic" or spec.tokenizer == EMBEDDED_TOKENIZER:
        return int(spec.vocab_size)  # BPE training stops at or below this size
    return len(build_tokenizer(spec))


def fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of everything that decides token ids (vocab, merges, specials, chat template)."""
    parts = [tokenizer.backend_tokenizer.to_str(), str(tokenizer.chat_template),
             str((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
