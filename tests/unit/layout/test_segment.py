"""Segmenter: exact, leftmost-longest, non-overlapping chunk search inside a prompt."""

import random
import string
import threading
import time

import pytest

from kvrag.layout.prompt import render_messages
from kvrag.layout.segment import Segment, Segmenter


def reference_split(texts: dict[str, str], prompt: str) -> list[Segment]:
    """Brute force of the contract: scan left to right, at each offset take the longest
    registered text starting there; the key of a text is the last key registered for it."""
    winner = {}
    for k, t in texts.items():  # dict order = registration order in these tests
        winner[t] = k

    def match_at(pos):
        best = max((t for t in winner if prompt.startswith(t, pos)), key=len, default=None)
        return None if best is None else Segment(best, winner[best])

    return scan_segments(prompt, match_at)


def scan_segments(prompt: str, match_at) -> list[Segment]:
    """Left-to-right scan shared by the brute-force references: ``match_at(pos)`` gives the
    cached Segment taken at ``pos`` (None: that character is plain text)."""
    out, plain, pos = [], [], 0
    while pos < len(prompt):
        seg = match_at(pos)
        if seg is None:
            plain.append(prompt[pos])
            pos += 1
            continue
        if plain:
            out.append(Segment("".join(plain)))
            plain = []
        out.append(seg)
        pos += len(seg.text)
    if plain:
        out.append(Segment("".join(plain)))
    return out


def check_invariants(segs: list[Segment], prompt: str) -> None:
    assert "".join(s.text for s in segs) == prompt
    assert all(s.text for s in segs), "empty segment"
    for a, b in zip(segs, segs[1:]):
        assert a.cached or b.cached, "two adjacent plain segments were not merged"


# ---- basic shapes ----------------------------------------------------------------------
def test_segment_cached_property():
    assert Segment("x").cached is False
    assert Segment("x", "k").cached is True


def test_no_chunk_gives_one_plain_segment():
    seg = Segmenter({"k1": "The capital of France is Paris."})
    prompt = "Question: what is the tallest mountain?\nAnswer:"
    assert seg.split(prompt) == [Segment(prompt)]
    assert Segmenter().split(prompt) == [Segment(prompt)]


def test_empty_prompt_gives_no_segments():
    assert Segmenter({"k": "abc"}).split("") == []


def test_chunks_at_start_middle_end_and_adjacent():
    a, b, c = "Alpha chunk text.", "Bravo chunk text!", "Charlie chunk text?"
    seg = Segmenter({"ka": a, "kb": b, "kc": c})
    prompt = f"{a}\nContext: {b}{c} then the question {a}"
    assert seg.split(prompt) == [
        Segment(a, "ka"),
        Segment("\nContext: "),
        Segment(b, "kb"),
        Segment(c, "kc"),
        Segment(" then the question "),
        Segment(a, "ka"),
    ]
    # The whole prompt is one chunk.
    assert seg.split(b) == [Segment(b, "kb")]


def test_repeated_chunk_back_to_back():
    seg = Segmenter({"k": "repeat me."})
    assert seg.split("repeat me.repeat me.") == [Segment("repeat me.", "k")] * 2


# ---- overlapping candidates ------------------------------------------------------------
def test_longest_at_one_start_wins():
    short, long_ = "the quick brown", "the quick brown fox jumps"
    seg = Segmenter({"short": short, "long": long_})
    assert seg.split(f"> {long_} <") == [Segment("> "), Segment(long_, "long"), Segment(" <")]
    # Where the long one is not complete, the short one still matches.
    assert seg.split(f"> {short} fox sleeps") == [Segment("> "), Segment(short, "short"), Segment(" fox sleeps")]


def test_chunk_containing_another_chunk_wins():
    inner, outer = "needle text", "hay hay needle text hay"
    seg = Segmenter({"inner": inner, "outer": outer})
    assert seg.split(f"[{outer}]") == [Segment("["), Segment(outer, "outer"), Segment("]")]


def test_leftmost_beats_longer_later_overlap():
    # "abcd" starts first, so it is taken even though "cdefgh" (overlapping it) is longer.
    seg = Segmenter({"x": "abcd", "y": "cdefgh"})
    assert seg.split("abcdefgh") == [Segment("abcd", "x"), Segment("efgh")]


def test_fallback_to_shorter_pattern_at_end_of_prompt():
    # pyahocorasick's iter_long loses this "b" (it is inside a pending "abb" path at the end).
    seg = Segmenter({"x": "b", "y": "abb", "z": "aa"})
    assert seg.split("cab") == [Segment("ca"), Segment("b", "x")]


# ---- exactness -------------------------------------------------------------------------
def test_near_miss_is_not_matched():
    chunk = "Marie Curie won two Nobel prizes, in physics and chemistry."
    seg = Segmenter({"k": chunk})
    for i in (0, len(chunk) // 2, len(chunk) - 1):
        changed = chunk[:i] + ("X" if chunk[i] != "X" else "Y") + chunk[i + 1 :]
        assert seg.split(f"ctx: {changed}") == [Segment(f"ctx: {changed}")]
    # Case, whitespace and truncation are differences too.
    for variant in (chunk.lower(), chunk.replace(" ", "  ", 1), chunk[:-1]):
        assert all(not s.cached for s in seg.split(variant))
    assert seg.split(chunk) == [Segment(chunk, "k")]


def test_unicode_text():
    chunks = {
        "emoji": "Party 🎉 time 👩‍👩‍👧 family",
        "cjk": "東京は日本の首都です。",
        "accent": "cafe\u0301 au lait",  # e + combining acute
        "crlf": "line one\r\nline two\r\n",
    }
    seg = Segmenter(chunks)
    prompt = "前 " + chunks["cjk"] + "🙂" + chunks["emoji"] + "\r\n" + chunks["accent"] + chunks["crlf"] + "end"
    segs = seg.split(prompt)
    check_invariants(segs, prompt)
    assert [s.key for s in segs if s.cached] == ["cjk", "emoji", "accent", "crlf"]
    # The precomposed "é" is a different string: no match (no normalisation).
    assert all(not s.cached for s in seg.split("caf\u00e9 au lait"))
    # "\n" alone where the chunk has "\r\n" is a different string.
    assert all(not s.cached for s in seg.split("line one\nline two\n"))


# ---- registration ----------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["", " ", "\n\t \r\n", "\u3000\u00a0"])
def test_empty_or_whitespace_chunk_rejected(bad):
    seg = Segmenter()
    with pytest.raises(ValueError, match="empty|whitespace"):
        seg.add("k", bad)
    with pytest.raises(ValueError, match="empty|whitespace"):
        Segmenter({"ok": "fine text", "k": bad})
    assert len(seg) == 0


def test_bad_types_rejected():
    seg = Segmenter()
    with pytest.raises(TypeError, match="str"):
        seg.add("k", b"bytes")
    with pytest.raises(ValueError, match="key"):
        seg.add("", "text")
    with pytest.raises(TypeError, match="prompt"):
        seg.split(None)
    with pytest.raises(TypeError, match="Mapping"):
        seg.update([("k", "text")])


def test_update_is_atomic_on_bad_input():
    seg = Segmenter({"a": "alpha text"})
    with pytest.raises(ValueError):
        seg.update({"b": "bravo text", "c": "   "})
    assert len(seg) == 1
    assert seg.split("alpha text bravo text")[0] == Segment("alpha text", "a")
    assert not seg.split("alpha text bravo text")[-1].cached


def test_remove_and_update():
    seg = Segmenter({"a": "alpha text", "b": "bravo text"})
    prompt = "alpha text | bravo text"
    assert [s.key for s in seg.split(prompt) if s.cached] == ["a", "b"]
    seg.remove("a")
    assert len(seg) == 1
    assert [s.key for s in seg.split(prompt) if s.cached] == ["b"]
    seg.remove("a")  # unknown key: no-op
    seg.update({"b": "bravo text", "c": "| bravo"})
    assert len(seg) == 2
    # "| bravo" starts before "bravo text", so leftmost wins.
    assert seg.split(prompt) == [Segment("alpha text "), Segment("| bravo", "c"), Segment(" text")]
    seg.update({})
    assert len(seg) == 0
    assert seg.split(prompt) == [Segment(prompt)]


def test_readding_a_key_with_new_text_replaces_it():
    seg = Segmenter({"k": "old chunk text"})
    seg.add("k", "new chunk text")
    assert len(seg) == 1
    assert seg.split("old chunk text") == [Segment("old chunk text")]
    assert seg.split("new chunk text") == [Segment("new chunk text", "k")]


def test_same_text_two_keys_later_add_wins_and_remove_falls_back():
    seg = Segmenter()
    seg.add("k1", "shared text")
    seg.add("k2", "shared text")
    assert seg.split("shared text") == [Segment("shared text", "k2")]
    seg.add("k1", "shared text")  # re-adding makes k1 the most recent
    assert seg.split("shared text") == [Segment("shared text", "k1")]
    seg.remove("k1")
    assert seg.split("shared text") == [Segment("shared text", "k2")]
    seg.add("k1", "shared text")
    seg.remove("k2")
    assert seg.split("shared text") == [Segment("shared text", "k1")]
    seg.remove("k1")
    assert seg.split("shared text") == [Segment("shared text")]


def test_update_without_changes_keeps_order_and_index():
    texts = {"k1": "shared text", "k2": "shared text", "k3": "other text"}
    seg = Segmenter(texts)
    seg.split("warm up")
    main, delta = seg._main, seg._delta
    seg.update(dict(texts))
    seg.split("shared text")
    assert seg._main is main and seg._delta is delta, "an unchanged update rebuilt the automaton"
    assert seg.split("shared text") == [Segment("shared text", "k2")]


# ---- randomized property test against the brute-force reference -------------------------
@pytest.mark.parametrize("anchor_chars", [1, 3, 32])
def test_random_prompts_match_reference(anchor_chars):
    rng = random.Random(1234 + anchor_chars)
    alphabet = "ab c\né😀"  # small alphabet: many overlaps, shared prefixes and near misses
    # Low delta thresholds so that the delta/stale/full-rebuild paths all run.
    seg = Segmenter(anchor_chars=anchor_chars)
    seg.DELTA_MIN = 3
    seg.DELTA_FACTOR = 1
    live: dict[str, str] = {}
    for it in range(600):
        op = rng.random()
        if op < 0.45 or not live:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
            if not text.strip():
                continue
            key = f"k{rng.randint(0, 30)}"
            seg.add(key, text)
            live.pop(key, None)  # re-adding moves the key to the end (most recent)
            live[key] = text
        elif op < 0.65:
            key = rng.choice(list(live))
            seg.remove(key)
            del live[key]
        elif op < 0.7:
            keep = {k: live[k] for k in live if rng.random() < 0.8}
            keep.update({f"u{it}": "".join(rng.choice(alphabet) for _ in range(4)) + "z"})
            seg.update(keep)
            live = {k: v for k, v in live.items() if k in keep}
            live.update({k: v for k, v in keep.items() if k not in live})
        prompt = "".join(rng.choice(alphabet + "xz") for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.5 and live:  # plant registered texts
            parts = [prompt]
            for _ in range(rng.randint(1, 3)):
                parts.insert(rng.randint(0, len(parts)), rng.choice(list(live.values())))
            prompt = "".join(parts)
        segs = seg.split(prompt)
        check_invariants(segs, prompt)
        assert segs == reference_split(live, prompt), (prompt, live)
        assert len(seg) == len(live)


def test_concurrent_add_and_split():
    seg = Segmenter({"base": "base chunk text"})
    prompt = "q: base chunk text / " + " / ".join(f"chunk number {i:04d}" for i in range(0, 400, 7))
    stop = threading.Event()
    start = threading.Barrier(4)  # the writer starts once every reader runs
    errors = []
    reads = []

    def writer():
        start.wait(timeout=30)
        for i in range(400):
            seg.add(f"k{i}", f"chunk number {i:04d}")
            time.sleep(0.0002)  # yield: a burst of adds would finish before any reader split
        stop.set()

    def reader():
        try:
            start.wait(timeout=30)
            while not stop.is_set():
                segs = seg.split(prompt)
                check_invariants(segs, prompt)
                assert segs[1] == Segment("base chunk text", "base")
                reads.append(sum(s.cached for s in segs))
        except Exception as e:  # noqa: BLE001 - surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(3)] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(set(reads)) > 1, reads  # splits ran between adds: they saw different chunk sets
    assert [s.key for s in seg.split(prompt) if s.cached] == ["base"] + [f"k{i}" for i in range(0, 400, 7)]


# ---- scale -----------------------------------------------------------------------------
@pytest.mark.parametrize("partial", [False, True])
def test_100k_chunks(partial):
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + " .,"
    texts = {f"key{i}": "".join(rng.choices(alphabet, k=30)) for i in range(100_000)}
    seg = Segmenter(texts, partial=partial)
    assert len(seg) == 100_000
    planted = [f"key{i}" for i in rng.sample(range(100_000), 20)]
    # Filler from characters no chunk contains, so the only matches are the planted ones.

    def filler(n):
        return "".join(rng.choices("#~^|", k=n))

    parts = [filler(rng.randint(0, 1000))]
    for k in planted:
        parts += [texts[k], filler(rng.randint(0, 1000))]
    prompt = "".join(parts)
    prompt += filler(max(0, 20_000 - len(prompt)))
    segs = seg.split(prompt)
    check_invariants(segs, prompt)
    assert [s.key for s in segs if s.cached] == planted
    # A few more chunks after the build go to the delta automaton and are found too.
    seg.add("late", "a chunk added after the build")
    segs = seg.split(prompt + "a chunk added after the build")
    assert [s.key for s in segs if s.cached] == planted + ["late"]


# ---- chat rendering --------------------------------------------------------------------
def _tiny_tokenizer(template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok)
    t.chat_template = template
    return t


ROLE_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Mistral-Instruct style: raises on any role but user/assistant.
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
)


@pytest.mark.parametrize(
    "template,expected",
    [
        (ROLE_TEMPLATE, "<|system|>\n{sys}<|end|>\n<|user|>\n{user}<|end|>\n<|assistant|>\n"),
        # No system role: the instruction goes in front of the first user turn.
        (NO_SYSTEM_TEMPLATE, "[user] {sys}\n\n{user}\n"),
    ],
)
def test_render_messages_then_split(template, expected):
    tok = _tiny_tokenizer(template)
    chunk = "Doc: the Eiffel tower is 330 m tall. 🗼"
    system, user = "Answer from the context.", f"Context:\n{chunk}\nQ: how tall?"
    text = render_messages(tok, [{"role": "system", "content": system}, {"role": "user", "content": user}])
    assert text == expected.format(sys=system, user=user)
    segs = Segmenter({"doc": chunk}).split(text)
    assert [s for s in segs if s.cached] == [Segment(chunk, "doc")]


def test_render_messages_errors():
    with pytest.raises(ValueError, match="no chat template"):
        render_messages(_tiny_tokenizer(None), [{"role": "user", "content": "hi"}])
    tok = _tiny_tokenizer("{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="empty"):
        render_messages(tok, [])
    with pytest.raises(ValueError, match="role"):
        render_messages(tok, [{"content": "hi"}])
    with pytest.raises(TypeError, match="list of dicts"):
        render_messages(tok, "hi")
    # A template refusal that folding the system message cannot fix is named, not swallowed.
    with pytest.raises(ValueError, match="refused.*user/assistant"):
        render_messages(_tiny_tokenizer(NO_SYSTEM_TEMPLATE), [{"role": "tool", "content": "x"}])


# ---- partial mode: cut chunks and trimmed edge whitespace ---------------------------------
def reference_split_partial(texts: dict[str, str], prompt: str, min_partial: int) -> list[Segment]:
    """Brute force of the partial-mode contract (``Segmenter.split`` docstring): at each offset,
    every live text ``t`` at offset 0 and, if it has leading whitespace, at the end of it,
    matched whole or by a prefix of >= min(min_partial, len(t[o:].rstrip())) characters; best =
    longest match not counting trailing whitespace, then offset 0, then whole, then shorter
    text, then smaller text. A cut match is cut short at the first start inside it whose own
    best match ends past it (the next chunk, not the cut chunk's tail)."""
    winner = {}
    for k, t in texts.items():
        winner[t] = k

    def best_at(pos, limit=None):
        best, best_rank = None, None
        for t in winner:
            lead = len(t) - len(t.lstrip())
            for off in (0, lead) if lead else (0,):
                rest = t[off:]
                n = 0
                while n < len(rest) and pos + n < len(prompt) and prompt[pos + n] == rest[n]:
                    n += 1
                whole = n == len(rest)
                if not whole and limit is not None:
                    n = min(n, limit)
                if not whole and n < min(min_partial, len(rest.rstrip())):
                    continue
                if n == 0:
                    continue
                rank = (len(prompt[pos : pos + n].rstrip()), off == 0, whole, -len(t))
                if best is None or rank > best_rank or (rank == best_rank and t < best[0]):
                    best, best_rank = (t, off, n), rank
        return best

    def match_at(pos):
        best = best_at(pos)
        while best is not None and best[2] < len(best[0]) - best[1]:
            end = pos + best[2]
            block = next((s for s in range(pos + 1, end) if (b := best_at(s)) and s + b[2] > end), None)
            if block is None:
                break
            best = best_at(pos, limit=block - pos)
        if best is None:
            return None
        t, off, n = best
        exact = off == 0 and n == len(t)
        return Segment(prompt[pos : pos + n], winner[t], off, not exact)

    return scan_segments(prompt, match_at)


def test_partial_mode_serves_a_cut_chunk_and_a_stripped_one():
    chunk = "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres high."
    padded = "\n\n  The river Lenne flows from the Varn Mountains to the eastern sea.\n"
    seg = Segmenter({"k": chunk, "p": padded}, partial=True)
    # Cut by a framework to fit a window (the first 40 characters are left, below 64: no match).
    cut = chunk[:70]
    assert seg.split(f"ctx: {cut}\nQ") == [Segment("ctx: "), Segment(cut, "k", 0, True), Segment("\nQ")]
    assert all(not s.cached for s in seg.split(f"ctx: {chunk[:40]}\nQ"))
    # strip()ped: found from the end of its leading whitespace on, trailing whitespace missing.
    core = padded.strip()
    assert seg.split(f"ctx: {core}") == [Segment("ctx: "), Segment(core, "p", 4, True)]
    # Whole, as registered: an ordinary match.
    assert seg.split(f"[{padded}]") == [Segment("["), Segment(padded, "p"), Segment("]")]
    # A short chunk is matched partially only for all of its non-whitespace content.
    short = Segmenter({"s": "\tShort chunk text.\n\n"}, partial=True)
    assert short.split("x Short chunk text. y") == [
        Segment("x "),
        Segment("Short chunk text.", "s", 1, True),
        Segment(" y"),
    ]
    assert all(not s.cached for s in short.split("x Short chunk tex y"))
    # Off by default: whole texts only.
    assert all(not s.cached for s in Segmenter({"k": chunk}).split(cut))


def test_partial_mode_prefers_the_bare_text_and_whole_chunks():
    bare = "The red fox lives in the northern forest and hunts small rodents at dawn."
    seg = Segmenter({"padded": "  \n" + bare + "\n\n", "bare": bare}, partial=True)
    # Both match as much non-whitespace text: the one registered bare, at its own offset 0.
    assert seg.split(f"A\n{bare}\n\nB") == [Segment("A\n"), Segment(bare, "bare"), Segment("\n\nB")]
    # A longer chunk cut in the prompt still beats a shorter whole one at the same start.
    long_ = bare + " Its den is dug under the roots of old oaks, and cubs are born in spring."
    seg2 = Segmenter({"bare": bare, "long": long_}, partial=True)
    cut = long_[: len(bare) + 30]
    assert seg2.split(cut) == [Segment(cut, "long", 0, True)]


def test_min_partial_chars_is_checked():
    with pytest.raises(ValueError, match="min_partial_chars"):
        Segmenter(anchor_chars=32, min_partial_chars=10, partial=True)


@pytest.mark.parametrize("anchor_chars", [1, 3, 8])
def test_random_prompts_match_reference_partial(anchor_chars):
    rng = random.Random(99 + anchor_chars)
    alphabet = "ab c\n"
    min_partial = max(anchor_chars, 4)
    seg = Segmenter(anchor_chars=anchor_chars, partial=True, min_partial_chars=min_partial)
    seg.DELTA_MIN = 3
    seg.DELTA_FACTOR = 1
    live: dict[str, str] = {}
    for _ in range(500):
        if rng.random() < 0.4 or not live:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
            if not text.strip():
                continue
            key = f"k{rng.randint(0, 20)}"
            seg.add(key, text)
            live.pop(key, None)
            live[key] = text
        elif rng.random() < 0.3:
            key = rng.choice(list(live))
            seg.remove(key)
            del live[key]
        prompt = "".join(rng.choice(alphabet + "xz") for _ in range(rng.randint(0, 30)))
        if live and rng.random() < 0.7:  # plant registered texts, some cut or stripped
            parts = [prompt]
            for _ in range(rng.randint(1, 3)):
                t = rng.choice(list(live.values()))
                t = rng.choice([t, t.strip(), t.lstrip(), t[: rng.randint(1, len(t))]])
                parts.insert(rng.randint(0, len(parts)), t)
            prompt = "".join(parts)
        segs = seg.split(prompt)
        check_invariants(segs, prompt)
        assert segs == reference_split_partial(live, prompt, min_partial), (prompt, live)


def test_partial_mode_a_cut_chunk_does_not_swallow_the_next_chunk():
    # The framework cut chunk A after its first paragraph; the prompt goes on with its
    # separator and chunk B, whose first word is also the first word of A's second paragraph.
    # A's common prefix with the prompt runs into B ("\n\nThe "): that tail must not take B's
    # beginning, or B -- there whole -- is lost.
    a = "The red fox lives in the northern forest and hunts small rodents at dawn.\n\nThe den is dug under oaks."
    b = "The river Lenne flows from the Varn Mountains to the eastern sea."
    cut = a[: a.index("\n\n")]
    prompt = "ctx:\n" + cut + "\n\n" + b + "\nQ?"
    seg = Segmenter({"a": a, "b": b}, partial=True)
    assert seg.split(prompt) == [
        Segment("ctx:\n"),
        Segment(cut + "\n\n", "a", 0, True),
        Segment(b, "b"),
        Segment("\nQ?"),
    ]
    # A text registered whole is not beaten by a longer one whose cut only runs on into B.
    seg = Segmenter({"cut": cut, "long": cut + "\n\nThe lake is deep.", "b": b}, partial=True)
    assert seg.split(prompt) == [
        Segment("ctx:\n"),
        Segment(cut, "cut"),
        Segment("\n\n"),
        Segment(b, "b"),
        Segment("\nQ?"),
    ]
    # Cut to less than min_partial_chars before B: not taken, B is.
    short = "Foxes hunt at dawn. The river is long and wide and deep."
    seg = Segmenter({"s": short + " More about foxes and rivers here.", "b": b}, partial=True, min_partial_chars=64)
    p2 = short[:20] + b
    assert [s.key for s in seg.split(p2) if s.cached] == ["b"]
