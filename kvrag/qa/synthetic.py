"""A seeded, deterministic synthetic multi-document QA generator.

Every fact is invented (people get a common first name and surname drawn at random; towns,
rivers and companies names built from syllables), so the model cannot answer from memory: the
answer has to come from the passages. Facts open a passage and long distractor passages about
fictional towns, rivers and trades follow them, and questions come in three kinds:

* ``single_hop``: one passage states the fact ("X was born in the city of C.").
* ``two_hop``: one passage says who founded a company, another (not adjacent) where that
  company has its headquarters; the question asks for the headquarters of "the company
  founded by X".
* ``cross_passage``: a passage ends by naming a person; the *next* passage continues "She was
  born in C ..." without naming them again. The subject of the answer passage lives in
  another passage, which is exactly what reuse loses when each passage is encoded alone.

Items have the format of ``../shared/data/musique_dev.json`` (``question``, ``answers``,
``ctxs[title, text]``) plus ``id``, ``type``, ``evidence`` (indices of the passages the answer
needs) and ``subject``. The same ``seed`` (and options) always gives the same items: each item
draws from its own ``random.Random`` seeded by a string (Python hashes string seeds with
SHA-512, not with the per-process ``hash()``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

QUESTION_TYPES = ("single_hop", "two_hop", "cross_passage")
# The smallest item the generator can build: the fact passages plus a distractor, each long
# enough to hold its fact sentence.
MIN_PASSAGES = 3
MIN_PASSAGE_TOKENS = 30

_ONSETS = [
    "b",
    "br",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "qu",
    "r",
    "s",
    "st",
    "t",
    "th",
    "tr",
    "v",
    "w",
    "z",
]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "l", "s", "th", "x", "m", "nd", "rk"]
_CITY_SUFFIXES = ["mouth", "ford", "holm", "wick", "by", "stead", "haven", "dale", "port", "ton"]
_COMPANY_KINDS = [
    "Trading Company",
    "Ironworks",
    "Shipyards",
    "Printing House",
    "Glassworks",
    "Weaving Mills",
    "Salt Company",
    "Rope Works",
]
_OCCUPATIONS = [
    "painter",
    "astronomer",
    "shipwright",
    "botanist",
    "cartographer",
    "violinist",
    "glassblower",
    "architect",
    "beekeeper",
    "clockmaker",
    "sculptor",
    "physician",
]
_GOODS = [
    "dried figs",
    "amber",
    "wool",
    "copper wire",
    "salted fish",
    "indigo",
    "barley",
    "tin cups",
    "lamp oil",
    "walnut wood",
    "honey",
    "river clay",
]
_MATERIALS = ["grey", "red", "speckled", "black", "pale yellow", "blue"]
_ADJS = ["narrow", "crooked", "famous", "quiet", "crowded", "ancient", "windy", "colourful"]
_THINGS = ["bell tower", "covered market", "stone bridge", "lighthouse", "canal", "orchard", "observatory", "granary"]

_FIRST_NAMES = [
    "Anna",
    "Maria",
    "Clara",
    "Helen",
    "Sofia",
    "Laura",
    "Emma",
    "Julia",
    "Nora",
    "Alice",
    "Peter",
    "Thomas",
    "Daniel",
    "Martin",
    "Oscar",
    "Victor",
    "Simon",
    "Hugo",
    "Felix",
    "Leon",
]
_SURNAMES = [
    "Holt",
    "Brandt",
    "Marsh",
    "Keller",
    "Lindqvist",
    "Moreau",
    "Varga",
    "Novak",
    "Fischer",
    "Dumont",
    "Castell",
    "Hale",
    "Rossi",
    "Okafor",
    "Sato",
    "Berg",
    "Quinn",
    "Ivanova",
    "Weber",
    "Costa",
]

# Filler sentences: about places and things only. No other people and no pronoun, so the only
# "she"/"he" of an item is the cross-passage one. (With distractor people in the filler,
# SmolLM2-135M answered ~1 single-hop question in 6 even with full prefill: the generator
# must give the default model questions it can answer, or quality cannot be compared.)
_FILLER = [
    "Every spring the markets of {c1} sell {g1} brought by boat from {c2}.",
    "The old road between {c1} and {c2} was paved with {m1} stone in {y1}.",
    "Local records describe a hard winter in {y1}, when the river {r1} froze for {k} weeks.",
    "The library of {c1} holds {n} maps drawn by hand, most of them of the {a1} coast.",
    "Travellers often mention the {a1} streets of {c1} and the smell of {g1} near the harbour.",
    "A {a1} {t1} was built in {c2} in {y1} and still stands near the main square.",
    "Merchants from {c2} paid their taxes in {g1} until {y1}.",
    "In {y1} the council of {c2} voted to rebuild the {t1} after a fire.",
    "Fishermen on the river {r1} tell of {k} islands that appear only in dry summers.",
    "Trade in {g1} made {c2} wealthy, and its {t1} became a symbol of the town.",
]


class _Namer:
    """Unique invented names within one item (no name, city or company twice)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def _word(self, syllables: int) -> str:
        r = self.rng
        w = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(syllables))
        return w.capitalize()

    def _unique(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            s = make()
            low = s.lower()
            # Also reject names contained in (or containing) one already used, so a string
            # search for an answer never hits a different entity.
            if all(low not in u and u not in low for u in self.used):
                self.used.add(low)
                return s
        raise RuntimeError("could not draw a unique name")  # pragma: no cover - 24*9*12 ** n names

    def person(self) -> str:
        return self._unique(lambda: f"{self.rng.choice(_FIRST_NAMES)} {self.rng.choice(_SURNAMES)}")

    def city(self) -> str:
        return self._unique(lambda: self._word(self.rng.choice((1, 2))) + self.rng.choice(_CITY_SUFFIXES))

    def river(self) -> str:
        return self._unique(lambda: self._word(2))

    def company(self) -> str:
        return self._unique(lambda: f"{self._word(2)} {self.rng.choice(_COMPANY_KINDS)}")


def _a(noun: str) -> str:
    """'an astronomer', 'a painter'."""
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _approx_tokens(text: str) -> int:
    # Invented names split into several BPE tokens: ~1.4 tokens per word is close for SmolLM2.
    return int(len(text.split()) * 1.4) + 1


class _Filler:
    """Draws filler sentences over a fixed pool of distractor entities of one item."""

    def __init__(self, rng: random.Random, namer: _Namer, n_entities: int = 6):
        self.rng = rng
        self.cities = [namer.city() for _ in range(n_entities)]
        self.rivers = [namer.river() for _ in range(max(2, n_entities // 2))]

    def sentence(self) -> str:
        r = self.rng
        c1, c2 = r.sample(self.cities, 2)
        a1 = r.choice(_ADJS)
        return r.choice(_FILLER).format(
            c1=c1,
            c2=c2,
            r1=r.choice(self.rivers),
            g1=r.choice(_GOODS),
            m1=r.choice(_MATERIALS),
            a1=a1,
            t1=r.choice(_THINGS),
            y1=r.randint(1600, 1899),
            n=r.randint(20, 900),
            k=r.randint(2, 9),
        )

    def sentences_for(self, tokens: int, count_tokens: Callable[[str], int]) -> list[str]:
        """Filler sentences adding up to about ``tokens`` tokens (whole sentences)."""
        out: list[str] = []
        while tokens > 0:
            s = self.sentence()
            out.append(s)
            tokens -= count_tokens(" " + s)
        return out


def _passage(fill: _Filler, facts: Sequence[str], target: int, count_tokens, where: str) -> str:
    """Filler around ``facts``: ``where`` is 'start', 'end' or 'middle' (random cut)."""
    budget = max(0, target - sum(count_tokens(" " + f) for f in facts))
    filler = fill.sentences_for(budget, count_tokens)
    if where == "start":
        cut = 0
    elif where == "end":
        cut = len(filler)
    else:
        cut = fill.rng.randint(0, len(filler))
    return " ".join([*filler[:cut], *facts, *filler[cut:]])


def _person(rng: random.Random, namer: _Namer) -> dict:
    return {
        "name": namer.person(),
        "female": rng.random() < 0.5,
        "city": namer.city(),
        "year": rng.randint(1700, 1890),
        "occupation": rng.choice(_OCCUPATIONS),
    }


def make_item(
    kind: str,
    rng: random.Random,
    *,
    n_passages: int = 6,
    passage_tokens: int = 200,
    count_tokens: Callable[[str], int] | None = None,
    item_id: str = "",
) -> dict:
    """One QA item of question type ``kind`` with ``n_passages`` passages of ~``passage_tokens``."""
    if kind not in QUESTION_TYPES:
        raise ValueError(f"unknown question type {kind!r}; choose from {', '.join(QUESTION_TYPES)}")
    if n_passages < MIN_PASSAGES:
        raise ValueError(f"n_passages must be >= {MIN_PASSAGES} (facts + distractors), got {n_passages}")
    if passage_tokens < MIN_PASSAGE_TOKENS:
        raise ValueError(f"passage_tokens must be >= {MIN_PASSAGE_TOKENS}, got {passage_tokens}")
    count = count_tokens or _approx_tokens
    namer = _Namer(rng)
    p = _person(rng, namer)
    fill = _Filler(rng, namer)
    texts: list[str | None] = [None] * n_passages
    if kind == "single_hop":
        i = rng.randrange(n_passages)
        attr = rng.choice(("city", "year", "occupation"))
        fact = {
            "city": f"{p['name']} was born in the city of {p['city']}.",
            "year": f"{p['name']} was born in the year {p['year']}.",
            "occupation": f"{p['name']} worked as {_a(p['occupation'])}.",
        }[attr]
        texts[i] = _passage(fill, [fact], passage_tokens, count, "start")
        question = {
            "city": f"In which city was {p['name']} born?",
            "year": f"In which year was {p['name']} born?",
            "occupation": f"What was the profession of {p['name']}?",
        }[attr]
        answer, evidence = str(p[attr]), [i]
    elif kind == "two_hop":
        company, hq = namer.company(), namer.city()
        # Two passages that are not neighbours, in either order.
        pairs = [(a, b) for a in range(n_passages) for b in range(n_passages) if abs(a - b) > 1]
        i, j = rng.choice(pairs)
        texts[i] = _passage(
            fill, [f"In {p['year'] + 30}, {p['name']} founded the {company}."], passage_tokens, count, "start"
        )
        texts[j] = _passage(
            fill, [f"The {company} has its headquarters in the city of {hq}."], passage_tokens, count, "start"
        )
        question = f"In which city is the headquarters of the company founded by {p['name']}?"
        answer, evidence = hq, [i, j]
    else:  # cross_passage
        i = rng.randrange(n_passages - 1)
        pron, poss = ("She", "her") if p["female"] else ("He", "his")
        intro = f"One of the best known people of that time was the {p['occupation']} {p['name']}."
        texts[i] = _passage(fill, [intro], passage_tokens, count, "end")
        cont = [
            f"{pron} was born in {p['city']} in {p['year']}.",
            f"{pron} spent most of {poss} life travelling between distant towns.",
        ]
        texts[i + 1] = _passage(fill, cont, passage_tokens, count, "start")
        question = f"In which city was {p['name']} born?"
        answer, evidence = p["city"], [i, i + 1]
    for k in range(n_passages):
        if texts[k] is None:
            texts[k] = _passage(fill, [], passage_tokens, count, "middle")
    return {
        "id": item_id,
        "type": kind,
        "question": question,
        "answers": [answer],
        "ctxs": [{"title": "", "text": t} for t in texts],
        "evidence": evidence,
        "subject": p["name"],
    }


def generate(
    n: int,
    seed: int = 0,
    *,
    types: Sequence[str] = QUESTION_TYPES,
    n_passages: int = 6,
    passage_tokens: int = 200,
    count_tokens: Callable[[str], int] | None = None,
) -> list[dict]:
    """``n`` items, question types taken round-robin from ``types``.

    ``count_tokens(text) -> int`` sizes passages in real tokens (pass the model tokenizer's
    length); without it, a words x 1.4 estimate is used. Deterministic for a given seed."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    types = list(types)
    if not types:
        raise ValueError("types is empty")
    for t in types:
        if t not in QUESTION_TYPES:
            raise ValueError(f"unknown question type {t!r}; choose from {', '.join(QUESTION_TYPES)}")
    items = []
    for k in range(n):
        rng = random.Random(f"kvrag-synthetic:{seed}:{k}")
        items.append(
            make_item(
                types[k % len(types)],
                rng,
                n_passages=n_passages,
                passage_tokens=passage_tokens,
                count_tokens=count_tokens,
                item_id=f"syn{seed}-{k}",
            )
        )
    return items


def exact_length_item(
    n_chunks: int,
    chunk_tokens: int,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    seed: int = 0,
) -> dict:
    """A single-hop item whose ``n_chunks`` passages each tokenize (alone) to exactly
    ``chunk_tokens`` tokens — for TTFT scaling at controlled context lengths.

    The fact sits near the start of its passage, so cutting the tail to length never drops it."""
    if n_chunks < 1 or chunk_tokens < 32:
        raise ValueError(f"need n_chunks >= 1 and chunk_tokens >= 32, got {n_chunks} x {chunk_tokens}")
    rng = random.Random(f"kvrag-exact:{seed}:{n_chunks}x{chunk_tokens}")
    namer = _Namer(rng)
    p = _person(rng, namer)
    fill = _Filler(rng, namer)
    target = rng.randrange(n_chunks)
    fact = f"{p['name']} was born in {p['city']} in {p['year']}."
    count = lambda s: len(encode(s))  # noqa: E731
    texts = []
    for k in range(n_chunks):
        lead = [fill.sentence(), fact] if k == target else [fill.sentence()]
        # Whole sentences past the target, then cut at the token level.
        text = " ".join(lead + fill.sentences_for(chunk_tokens + 16 - count(" ".join(lead)), count))
        texts.append(_cut_to_tokens(text, chunk_tokens, encode, decode))
    return {
        "id": f"exact{seed}-{n_chunks}x{chunk_tokens}",
        "type": "single_hop",
        "question": f"In which city was {p['name']} born?",
        "answers": [p["city"]],
        "ctxs": [{"title": "", "text": t} for t in texts],
        "evidence": [target],
        "subject": p["name"],
    }


def _cut_to_tokens(text: str, n: int, encode, decode) -> str:
    """The prefix of ``text`` that tokenizes to exactly ``n`` tokens.

    Decoding the first ``n`` ids and re-encoding usually gives them back; where a cut splits
    a word whose merges change, try a neighbouring cut."""
    ids = encode(text)
    if len(ids) < n:
        raise ValueError(f"text has only {len(ids)} tokens, need {n}")
    best = None
    # Neighbouring cuts first; some tokenizers re-merge across several tokens at a cut.
    for c in [n + d for k in range(17) for d in ((k, -k) if k else (0,))]:
        if not 0 < c <= len(ids):
            continue
        cand = decode(ids[:c]).rstrip()
        m = len(encode(cand)) if cand else 0
        if m == n:
            return cand
        if m and m <= n and (best is None or m > best[0]):
            best = (m, cand)
    if best is not None and best[0] >= n - 4:
        # A few tokens short of the target beats failing a whole benchmark run.
        return best[1]
    raise ValueError(f"could not cut the text to {n} tokens")
