"""Greedy or sampled text generation from an exported folder (scripts/export_hf.py): model + tokenizer.

Usage: python scripts/generate.py MODEL_DIR "prompt" [--max-new-tokens N] [--temperature T]
Needs only torch and transformers: the folder carries its own modeling code (trust_remote_code).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True,
                                                 trust_remote_code=True).eval()
    ids = tokenizer((tokenizer.bos_token or "") + args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                             temperature=args.temperature or None, pad_token_id=tokenizer.pad_token_id)
    print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
