"""The accuracy yardstick: cross-passage QA items a small model answers from its full prefill,
so what a reuse policy keeps of that accuracy can be read (SmolLM2-135M answers none of the
held-out MuSiQue or cloze items; Gemma 3 270M answers most of these).

Every item needs two adjacent passages read together: passage ``i`` ends by naming a subject
(a person, a ship), passage ``i + 1`` gives the answer about it without naming it
again ("She was born in ...", "Its home port was ..."). Encoded alone, passage ``i + 1`` does
not know whose fact it states -- exactly what chunk reuse loses. The filler around them is full
of other invented places, so a guess copied from the wrong sentence is wrong. (Distractor
facts of the same relation about other named subjects, ``--distractors``, make the set too hard
for Gemma 3 270M's own full prefill: 1 of 5 answered in a first try; a "workshop moved to a
town" relation, 0 of 4, was dropped for a ship's captain.)

Held out by construction: every name (people's surnames, places, ships, horses) is invented
from its own syllable tables, and the templates, filler and subjects are this script's own,
not those of ``kvrag.qa.synthetic`` (whose generator the KVLink adapter trains on), so no
training set or tuning of kvrag has seen these passages. The same ``--seed`` always gives the
same items: each item draws from ``random.Random`` seeded by a string (hashed with SHA-512,
not with the per-process ``hash()``).

    python benchmarks/yardstick_set.py OUT.json [--n 120] [--passages 4] [--passage-words 90] [--seed 38]

Items have the format of ``../shared/data/musique_dev.json`` (``question``, ``answers``,
``ctxs[title, text]``) plus ``id``, ``type``, ``evidence`` (the two passages the answer needs).
"""

from __future__ import annotations

import argparse
import json
import random

_ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "bl", "cr", "gl", "pr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "oa"]
_CODAS = ["", "", "n", "l", "r", "s", "t", "m", "rn", "sk"]
_PLACE_ENDS = ["vik", "moor", "gate", "well", "burg", "cliff", "ham", "field", "bridge", "more"]
_FIRST_F = ["Maria", "Elena", "Sofia", "Anna", "Clara", "Helena", "Rosa", "Ida", "Vera", "Nora", "Lena", "Alma"]
_FIRST_M = ["Tomas", "Pavel", "Oskar", "Henrik", "Milan", "Anton", "Karl", "Emil", "Viktor", "Jonas", "Felix", "Ivo"]
_TRADES = ["clockmaker", "engraver", "mapmaker", "organ builder", "bookbinder", "lens grinder", "bell founder"]
_VESSELS = ["schooner", "brig", "steamer", "barque", "ketch"]
_GOODS = ["wool", "salt", "timber", "copper", "barley", "hides", "flax", "amber", "tallow", "slate"]
_WEATHER = ["a wet spring", "a long drought", "an early frost", "a mild winter", "a stormy autumn"]

# Filler about invented places (never about an item's subjects); {p}/{q} places, {r} a river.
_FILLER = [
    "The market of {p} sold {g} every second week, and traders came down the {r} to buy it.",
    "In {y} the road from {p} to {q} was paved with stones carried from the hills.",
    "Farmers near {p} remember {w} that ruined most of the harvest.",
    "A wooden bridge crossed the {r} just below {p}, and a toll was taken there until {y}.",
    "The town council of {q} met in a hall above the old granary.",
    "Ferries on the {r} carried {g} and {h} between {p} and {q}.",
    "Most houses in {q} had steep roofs of {m} against the heavy snow.",
    "Every summer {p} held a fair where {g} and horses changed hands.",
    "The mill at {q} ground grain for {n} families.",
    "Fishermen from {p} seldom sailed past the mouth of the {r} in winter.",
    "A chronicle from {y} calls {q} a quiet place of gardens and orchards.",
    "The {r} flooded the lower streets of {p} after {w}.",
]
_MATERIALS = ["slate", "thatch", "red tile", "larch shingles"]


class Names:
    """Invented names of one item, each used once (no name contains another)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def _word(self, syllables: int) -> str:
        r = self.rng
        w = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(syllables))
        return w.capitalize()

    def unique(self, make) -> str:
        for _ in range(1000):
            s = make()
            low = s.lower()
            if all(low not in u and u not in low for u in self.used):
                self.used.add(low)
                return s
        raise RuntimeError("could not draw a unique name")  # pragma: no cover

    def place(self) -> str:
        return self.unique(lambda: self._word(self.rng.choice((1, 2))) + self.rng.choice(_PLACE_ENDS))

    def person(self, female: bool) -> str:
        first = self.rng.choice(_FIRST_F if female else _FIRST_M)
        return self.unique(lambda: f"{first} {self._word(2)}")

    def word(self) -> str:
        return self.unique(lambda: self._word(2))


def _filler(rng: random.Random, places: list[str], rivers: list[str], words: int) -> list[str]:
    out: list[str] = []
    while words > 0:
        p, q = rng.sample(places, 2)
        s = rng.choice(_FILLER).format(
            p=p,
            q=q,
            r=rng.choice(rivers),
            g=rng.choice(_GOODS),
            h=rng.choice(_GOODS),
            m=rng.choice(_MATERIALS),
            w=rng.choice(_WEATHER),
            y=rng.randint(1500, 1899),
            n=rng.randint(12, 400),
        )
        out.append(s)
        words -= len(s.split())
    return out


def _passage(rng, places, rivers, words: int, head=(), tail=()) -> str:
    """Filler of about ``words`` words with ``head`` sentences first and ``tail`` last."""
    budget = max(10, words - sum(len(s.split()) for s in (*head, *tail)))
    return " ".join([*head, *_filler(rng, places, rivers, budget), *tail])


def _subject(kind: str, rng: random.Random, names: Names) -> dict:
    """One subject of ``kind`` with its intro (naming it), its anaphoric fact (not naming it),
    a named fact of the same relation (for distractor subjects), the question and answer."""
    if kind == "birthplace":
        female = rng.random() < 0.5
        name, trade, city = names.person(female), rng.choice(_TRADES), names.place()
        pron = "She" if female else "He"
        return {
            "intro": f"Among the craftsmen of that age, the most admired was the {trade} {name}.",
            "fact": f"{pron} was born in {city}, and {pron.lower()} learned the trade there as a child.",
            "named": f"The {trade} {name} was born in {city}.",
            "question": f"In which town was {name} born?",
            "answer": city,
        }
    if kind == "home_port":
        vessel, ship, port = rng.choice(_VESSELS), names.word(), names.place()
        return {
            "intro": f"The finest vessel on that coast was a {vessel} called the {ship}.",
            "fact": f"Its home port was {port}, where it returned every autumn.",
            "named": f"The {vessel} {ship} had its home port at {port}.",
            "question": f"What was the home port of the {vessel} {ship}?",
            "answer": port,
        }
    if kind == "horse":
        female = rng.random() < 0.5
        name, horse = names.person(female), names.word()
        poss = "her" if female else "his"
        return {
            "intro": f"The best rider in the valley was {name}.",
            "fact": f"The horse that carried {poss} saddle in every race was named {horse}.",
            "named": f"{name} rode a horse named {horse}.",
            "question": f"What was the name of the horse of {name}?",
            "answer": horse,
        }
    # ship -> its captain (a person's name)
    female = rng.random() < 0.5
    vessel, ship, captain = rng.choice(_VESSELS), names.word(), names.person(female)
    return {
        "intro": f"The fastest ship that ever left the harbour was a {vessel} called the {ship}.",
        "fact": f"For twenty years its captain was {captain}, who never lost a sailor.",
        "named": f"The {vessel} {ship} was commanded by {captain}.",
        "question": f"Who was the captain of the {vessel} {ship}?",
        "answer": captain,
    }


KINDS = ("birthplace", "home_port", "horse", "captain")


def make_item(index: int, seed: int, n_passages: int, words: int, distractors: float = 0.0) -> dict:
    """Item ``index`` of the set drawn with ``seed``: ``n_passages`` passages of ~``words``
    words; the kinds take turns; each other passage opens with a named fact of the same
    relation about another subject with probability ``distractors``."""
    if n_passages < 3:
        raise ValueError(f"n_passages must be >= 3 (the linked pair + a distractor), got {n_passages}")
    rng = random.Random(f"kvrag-yardstick/{seed}/{index}")
    names = Names(rng)
    kind = KINDS[index % len(KINDS)]
    target = _subject(kind, rng, names)
    places = [names.place() for _ in range(6)]
    rivers = [names.word() for _ in range(3)]
    i = rng.randrange(n_passages - 1)
    texts: list[str | None] = [None] * n_passages
    texts[i] = _passage(rng, places, rivers, words, tail=[target["intro"]])
    texts[i + 1] = _passage(rng, places, rivers, words, head=[target["fact"]])
    # Distractor subjects of the same kind, named where their fact is stated, elsewhere.
    others = [k for k in range(n_passages) if texts[k] is None]
    for k in others:
        fact = [_subject(kind, rng, names)["named"]] if rng.random() < distractors else []
        texts[k] = _passage(rng, places, rivers, words, head=fact)
    return {
        "id": f"yardstick-{seed}-{index}",
        "type": f"cross_passage/{kind}",
        "question": target["question"],
        "answers": [target["answer"]],
        "ctxs": [{"title": f"Passage {k + 1}", "text": t} for k, t in enumerate(texts)],
        "evidence": [i, i + 1],
    }


def generate(n: int, seed: int, n_passages: int = 4, words: int = 90, distractors: float = 0.0) -> list[dict]:
    return [make_item(i, seed, n_passages, words, distractors) for i in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--n", type=int, default=120, help="items (default 120)")
    p.add_argument("--passages", type=int, default=4, help="passages per item (default 4)")
    p.add_argument("--passage-words", type=int, default=90, help="words per passage (default 90)")
    p.add_argument(
        "--distractors",
        type=float,
        default=0.0,
        help="chance that another passage states the relation of another subject",
    )
    p.add_argument("--seed", type=int, default=38)
    a = p.parse_args()
    items = generate(a.n, a.seed, a.passages, a.passage_words, a.distractors)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(items, f, indent=1)
    print(
        f"{len(items)} cross-passage items (seed {a.seed}, {a.passages} passages"
        f" of ~{a.passage_words} words) -> {a.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
