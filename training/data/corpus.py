"""The embedded synthetic corpus: deterministic English-like documents with learnable structure."""

import random

_NOUNS = [  # (singular, plural) subjects: the verb must agree with their number
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"), ("horse", "horses"),
    ("child", "children"), ("man", "men"), ("woman", "women"), ("teacher", "teachers"),
    ("farmer", "farmers"), ("king", "kings"), ("queen", "queens"), ("robot", "robots"),
    ("doctor", "doctors"), ("student", "students"), ("baker", "bakers"), ("sailor", "sailors"),
    ("mouse", "mice"), ("wolf", "wolves"), ("friend", "friends"), ("pilot", "pilots"),
    ("painter", "painters"), ("rabbit", "rabbits"), ("goose", "geese"), ("bear", "bears"),
    ("singer", "singers"), ("driver", "drivers"), ("monkey", "monkeys"), ("lion", "lions"),
    ("nurse", "nurses"),
]
_THINGS = [
    "apple", "ball", "book", "river", "house", "tree", "letter", "song", "door", "car", "boat",
    "map", "key", "lamp", "cake", "box", "garden", "stone", "flower", "window", "bridge", "cup",
    "hat", "chair", "road", "star", "cloud", "coin", "bell", "rope", "shoe", "clock", "bottle",
    "picture", "table", "pencil", "basket", "candle", "ladder", "mirror", "orange", "banana",
    "carrot", "kite", "drum", "ring", "shell", "feather", "wheel", "blanket",
]
_VERBS = [  # transitive: (third person singular, plural)
    ("sees", "see"), ("likes", "like"), ("finds", "find"), ("helps", "help"), ("watches", "watch"),
    ("carries", "carry"), ("opens", "open"), ("paints", "paint"), ("wants", "want"),
    ("takes", "take"), ("holds", "hold"), ("moves", "move"), ("builds", "build"), ("reads", "read"),
    ("cleans", "clean"), ("follows", "follow"), ("drops", "drop"), ("buys", "buy"),
    ("sells", "sell"), ("loves", "love"), ("hides", "hide"), ("brings", "bring"),
]
_INTRANSITIVE = [
    ("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"), ("walks", "walk"),
    ("plays", "play"), ("jumps", "jump"), ("rests", "rest"), ("swims", "swim"), ("dances", "dance"),
    ("laughs", "laugh"), ("works", "work"),
]
_ADJECTIVES = [
    "big", "small", "red", "blue", "green", "old", "young", "happy", "quiet", "bright", "dark",
    "tall", "short", "warm", "cold", "fast", "slow", "kind", "brave", "clever", "yellow", "heavy",
    "light", "soft", "loud", "busy", "tired", "funny", "gentle", "proud",
]
_PLACES = [
    "in the garden", "near the river", "at home", "under the tree", "on the hill", "by the sea",
    "in the city", "at school", "in the forest", "on the bridge", "behind the house", "in the park",
]
_TIMES = ["today", "every day", "at night", "in the morning", "after lunch", "in the winter"]


def _noun_phrase(rng: random.Random, noun: str) -> str:
    """'the [adjective] noun'."""
    return f"the {rng.choice(_ADJECTIVES)} {noun}" if rng.random() < 0.5 else f"the {noun}"


def _grammar_sentence(rng: random.Random) -> str:
    """A templated English sentence whose verb agrees with its subject."""
    plural = rng.random() < 0.5
    subject = _noun_phrase(rng, rng.choice(_NOUNS)[plural])
    kind = rng.randrange(4)
    if kind == 0:
        return f"{subject} {rng.choice(_VERBS)[plural]} {_noun_phrase(rng, rng.choice(_THINGS))}."
    if kind == 1:
        tail = f" {rng.choice(_TIMES)}" if rng.random() < 0.3 else ""
        return f"{subject} {rng.choice(_INTRANSITIVE)[plural]} {rng.choice(_PLACES)}{tail}."
    if kind == 2:
        return f"{subject} {'are' if plural else 'is'} {rng.choice(_ADJECTIVES)}."
    # A pronoun that must agree with the subject of the previous clause.
    pronoun = "they" if plural else "it"
    return (f"{subject} {rng.choice(_INTRANSITIVE)[plural]} {rng.choice(_PLACES)}. "
            f"{pronoun} {rng.choice(_VERBS)[plural]} the {rng.choice(_THINGS)}.")


def _arithmetic_fact(rng: random.Random) -> str:
    """A correct arithmetic fact such as '17 plus 5 is 22.'."""
    op = rng.randrange(3)
    if op == 0:
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        return f"{a} plus {b} is {a + b}."
    if op == 1:
        a = rng.randint(0, 40)
        b = rng.randint(0, a)
        return f"{a} minus {b} is {a - b}."
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a} times {b} is {a * b}."


def _counting(rng: random.Random) -> str:
    """A counting run such as 'counting: 3 4 5 6 7.' (step 1 or 2)."""
    start, step, length = rng.randint(0, 60), rng.choice((1, 1, 2)), rng.randint(3, 10)
    return "counting: " + " ".join(str(start + step * i) for i in range(length)) + "."


MIN_DOCUMENT_WORDS = 20  # every document has at least this many words (the data check counts on it)


def _document(rng: random.Random) -> str:
    """One document of roughly 20-200 words: stated facts, mixed sentences, recalled facts."""
    target_words = rng.randint(MIN_DOCUMENT_WORDS, 200)
    # Key-value facts stated early and repeated verbatim later: in-context recall.
    keys = rng.sample(_THINGS, rng.randint(1, 3)) if rng.random() < 0.5 else []
    facts = [f"the code of {key} is {rng.randint(10, 99)}." for key in keys]
    sentences = list(facts)
    words = sum(len(s.split()) for s in sentences)
    while words < target_words:
        r = rng.random()
        if facts and r < 0.15:
            sentence = rng.choice(facts)
        elif r < 0.6:
            sentence = _grammar_sentence(rng)
        elif r < 0.8:
            sentence = _arithmetic_fact(rng)
        else:
            sentence = _counting(rng)
        sentences.append(sentence)
        words += len(sentence.split())
    return " ".join(sentences)


def synthetic_corpus(num_docs: int, seed: int) -> list[str]:
    """`num_docs` deterministic documents with learnable structure (grammar, arithmetic, counting, recall)."""
    rng = random.Random(seed)
    return [_document(rng) for _ in range(num_docs)]
