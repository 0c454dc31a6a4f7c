"""The embedded preference pairs: deterministic MiniMind DPO rows (`chosen` / `rejected` conversations) built from
the synthetic corpus's words, where the chosen answer is right and the rejected one wrong in a learnable way: a
wrong sum, a verb that disagrees with its subject, a skipped count, a misremembered code. Their right answers alone
are the embedded SFT conversations (`data=synthetic data.format=chat`)."""

import random
from typing import Any

# The synthetic corpus's vocabulary, so the embedded tokenizer (trained on that corpus) encodes the pairs compactly.
from training.data.corpus import _INTRANSITIVE, _NOUNS, _PLACES, _THINGS

Conversation = list[dict[str, str]]


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """(question, right answer, wrong answer): a sum or difference off by a few."""
    a, b = rng.randint(0, 30), rng.randint(0, 30)
    if rng.random() < 0.5:
        right, words = a + b, f"{a} plus {b}"
    else:
        a, b = max(a, b), min(a, b)
        right, words = a - b, f"{a} minus {b}"
    off = rng.choice((-3, -2, -1, 1, 2, 3))
    wrong = right + off if right + off >= 0 else right - off  # never negative, never right
    return f"what is {words}?", f"{words} is {right}.", f"{words} is {wrong}."


def _agreement(rng: random.Random) -> tuple[str, str, str]:
    """A subject and a verb that agree in number, against the same sentence with the verb's other number."""
    plural = rng.random() < 0.5
    noun, verb, place = rng.choice(_NOUNS)[plural], rng.choice(_INTRANSITIVE), rng.choice(_PLACES)
    return (f"where do the {noun} go?" if plural else f"where does the {noun} go?",
            f"the {noun} {verb[plural]} {place}.", f"the {noun} {verb[not plural]} {place}.")


def _counting(rng: random.Random) -> tuple[str, str, str]:
    """A run of numbers, against the same run with one number skipped."""
    start, length = rng.randint(0, 60), rng.randint(4, 7)
    run = [str(start + i) for i in range(length)]
    skipped = run[:]
    del skipped[rng.randrange(1, length - 1)]
    return f"count from {start}.", " ".join(run) + ".", " ".join(skipped) + "."


def _recall(rng: random.Random) -> tuple[str, str, str]:
    """A code stated in the question and repeated in the answer, against another code."""
    thing, code = rng.choice(_THINGS), rng.randint(10, 99)
    other = rng.choice([c for c in range(10, 100) if c != code])
    return (f"the code of {thing} is {code}. what is the code of {thing}?", f"the code of {thing} is {code}.",
            f"the code of {thing} is {other}.")


_KINDS = (_arithmetic, _agreement, _counting, _recall)


def _conversation(question: str, answer: str, system: str | None) -> Conversation:
    turns = [{"role": "system", "content": system}] if system else []
    return turns + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def synthetic_pairs(num_pairs: int, seed: int) -> list[dict[str, Any]]:
    """`num_pairs` deterministic DPO rows: {"chosen": conversation, "rejected": conversation}, the same prompt."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_pairs):
        question, right, wrong = rng.choice(_KINDS)(rng)
        system = "answer in one short sentence." if rng.random() < 0.25 else None
        rows.append({"chosen": _conversation(question, right, system),
                     "rejected": _conversation(question, wrong, system)})
    return rows


def synthetic_conversations(num_docs: int, seed: int) -> list[Conversation]:
    """`num_docs` deterministic SFT rows: the right answers of `synthetic_pairs(num_docs, seed)`, so that SFT then
    DPO on the embedded data teach the same answers (MiniMind's recipe: SFT on good replies, DPO against bad ones)."""
    return [row["chosen"] for row in synthetic_pairs(num_docs, seed)]
