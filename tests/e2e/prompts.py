"""Deterministic prompts of chosen token lengths, cut from varied English text."""

# The greedy parity prompts (test_generation.py; the KV dtypes' agreement is measured on them too).
PARITY_LENGTHS = [5, 600, 17, 64, 250, 33, 128, 400]
PARITY_NEW_TOKENS = 32

_SENTENCES = [
    "The river winds through the valley, past orchards heavy with apples and pears.",
    "In 1969 two astronauts walked on the Moon while millions watched on grainy television.",
    "A good recipe for bread needs flour, water, salt, yeast and a great deal of patience.",
    "Photosynthesis turns sunlight, carbon dioxide and water into sugar and oxygen.",
    "The library on the corner stays open late on Thursdays for students preparing exams.",
    "Compilers translate source code into machine instructions that a processor can execute.",
    "Whales communicate across hundreds of kilometres using low-frequency songs.",
    "She packed a map, a compass, two sandwiches and a thermos of tea for the long hike.",
    "Prime numbers have exactly two divisors: one and the number itself.",
    "The orchestra tuned their instruments as the audience slowly found their seats.",
    "Volcanic soil is often fertile, which is why farms cluster on the slopes of old volcanoes.",
    "A paged key-value cache stores attention keys and values in fixed-size blocks.",
]


def long_text(n_sentences: int = 120) -> str:
    return " ".join(f"({i}) {_SENTENCES[(i * 7) % len(_SENTENCES)]}" for i in range(n_sentences))


def prompt_ids(tokenizer, lengths: list[int]) -> list[list[int]]:
    """One prompt per length, each starting at a different place in the text."""
    ids = tokenizer.encode(long_text(), add_special_tokens=False)
    assert len(ids) > max(lengths) + 13 * len(lengths), "the text is too short for these lengths"
    return [ids[13 * i : 13 * i + n] for i, n in enumerate(lengths)]
