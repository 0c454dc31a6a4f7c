"""The token-id count of a tokenizer folder, read without side effects (nothing trained, cached or written)."""

import json
from pathlib import Path
from typing import Any

from training.rules import ConfigError


def _read_json(path: Path) -> Any:
    """A JSON file, or ConfigError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = getattr(error, "msg", None) or type(error).__name__
        raise ConfigError(f"data.tokenizer: {path} is not readable JSON ({reason}); "
                          "point data.tokenizer at a folder with a valid tokenizer.json") from None


def _token_content(token: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def tokenizer_vocab_size(folder: str, defaults: dict[str, str]) -> int:
    """Ids the loaded tokenizer will produce: its vocabulary, added tokens, and the specials the loader adds.

    `defaults` maps "bos_token"/"eos_token"/"pad_token" to the token the data loader adds when the folder
    declares none; a token missing from the vocabulary gets a new id there, so it counts here too."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return _vocab_size_by_loading(folder)
    spec = _read_json(path)
    model = spec.get("model") if isinstance(spec, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, (dict, list)):
        raise ConfigError(f"data.tokenizer: {path} has no model.vocab; point data.tokenizer at a complete tokenizer")
    tokens = dict(vocab) if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}
    tokens.update({t["content"]: t["id"] for t in spec.get("added_tokens") or [] if isinstance(t, dict)})
    size = max(tokens.values(), default=-1) + 1
    config_path = Path(folder) / "tokenizer_config.json"
    declared = _read_json(config_path) if config_path.is_file() else {}
    specials = {_token_content(declared.get(attr)) or token for attr, token in defaults.items()}
    return size + len(specials - tokens.keys())


def _vocab_size_by_loading(folder: str) -> int:
    """A folder without tokenizer.json (sentencepiece, vocab files): load it read-only and count."""
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    except Exception as error:  # any loader failure is a bad folder: report it in one line
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"data.tokenizer: cannot load the tokenizer in {folder} ({reason}); "
                          "point data.tokenizer at a folder with tokenizer.json") from None
