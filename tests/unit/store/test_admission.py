"""Admission (``kvrag.store.admission``): the frequency sketch's bounds and aging, the rule, and
``DiskStore(admission="tinylfu")`` keeping a chunk read often through a scan of one-off writes
that evicts it under LRU; ``KVRag(admission=...)`` opening its store with the rule."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helpers.store_entries import FP_A, make_entry, put  # noqa: E402

from kvrag.engine import KVRag  # noqa: E402
from kvrag.store import DiskStore  # noqa: E402
from kvrag.store.admission import FrequencySketch  # noqa: E402
from kvrag.store.factory import open_store  # noqa: E402
from kvrag.testing import tiny_llama  # noqa: E402


# ---- the sketch ------------------------------------------------------------------------------
def test_estimates_never_undercount_and_cap_at_15():
    s = FrequencySketch(capacity=2000)
    truth = {f"k{i}": i % 3 for i in range(40_000)}  # more keys than counters in a row: collisions
    truth["hot"] = 20
    assert len(truth) > s.width and sum(truth.values()) < s.period  # and no aging yet
    for key, n in truth.items():
        for _ in range(n):
            s.add(key)
    for key, n in truth.items():
        assert s.estimate(key) >= min(n, FrequencySketch.CAP)
    assert s.estimate("hot") == FrequencySketch.CAP
    assert s.estimate("never seen") <= FrequencySketch.CAP


def test_counts_are_halved_every_period():
    s = FrequencySketch(capacity=1)
    period = s.period
    assert period == FrequencySketch.PERIOD_PER_ENTRY
    for _ in range(8):
        s.add("hot")
    before = s.estimate("hot")
    assert before == 8
    for i in range(period - 8):  # the period's last addition halves every counter
        s.add(f"once {i}")
    assert s.estimate("hot") == before // 2
    assert s.added == period // 2


def test_growing_keeps_every_estimate_an_upper_bound():
    s = FrequencySketch(capacity=250)  # 4096 counters a row for 3000 keys: collisions
    keys = [f"k{i}" for i in range(3000)]
    assert sum(i % 5 for i in range(3000)) < s.period  # no aging
    for i, key in enumerate(keys):
        for _ in range(i % 5):
            s.add(key)
    before = {k: s.estimate(k) for k in keys}
    width = s.width
    s.fit(10_000)
    assert s.width >= FrequencySketch.WIDTH_PER_ENTRY * 10_000 > width
    assert s.period == FrequencySketch.PERIOD_PER_ENTRY * 10_000
    after = {k: s.estimate(k) for k in keys}
    assert all(after[k] <= before[k] for k in keys)  # a wider row only separates collisions
    assert all(after[k] >= min(i % 5, FrequencySketch.CAP) for i, k in enumerate(keys))


def test_a_candidate_must_beat_every_victim_and_a_tie_keeps_them():
    s = FrequencySketch(capacity=1000)
    for key, n in (("new", 3), ("cold", 2), ("warm", 3)):
        for _ in range(n):
            s.add(key)
    assert s.admits("new", ["cold"])
    assert not s.admits("new", ["warm"])  # a tie: the stored one stays
    assert not s.admits("new", ["cold", "warm"])
    assert s.admits("new", [])


def test_unknown_rule_is_refused(tmp_path):
    with pytest.raises(ValueError, match="admission must be one of lru, tinylfu"):
        DiskStore(tmp_path, admission="lfu")


# ---- the disk store --------------------------------------------------------------------------
BIG = dict(T=64, L=2, H=2, D=64)  # 128 KiB of K/V per entry


def _store(tmp_path, name: str, admission: str, room: int) -> DiskStore:
    """A store with room for ``room`` entries of ``BIG``'s shape, not one more."""
    blob = make_entry(**BIG).nbytes
    base = DiskStore(tmp_path / "probe").stats()["bytes"]  # the empty SQLite file
    return DiskStore(tmp_path / name, size_limit=base + room * blob + blob // 2, admission=admission)


def _scan(tmp_path, admission: str) -> tuple[DiskStore, dict[str, str], list[str]]:
    """Three chunks stored, one of them (``A``) read three times, then six one-off writes."""
    s = _store(tmp_path, admission, admission, room=3)
    keys = {n: put(s, make_entry(seed=i, text=f"chunk {n}", **BIG)) for i, n in enumerate("ABC")}
    for _ in range(3):
        assert s.get(keys["A"], FP_A) is not None
    scan = [put(s, make_entry(seed=10 + i, text=f"one-off {i}", **BIG)) for i in range(6)]
    return s, keys, scan


def test_a_chunk_read_often_survives_a_scan_that_evicts_it_under_lru(tmp_path):
    lru, keys, scan = _scan(tmp_path, "lru")
    assert keys["A"] not in lru and all(k in lru for k in scan[-3:])  # the scan flushed the store
    assert lru.stats()["refused"] == 0
    lru.close()

    s, keys, scan = _scan(tmp_path, "tinylfu")
    assert keys["A"] in s and s.get(keys["A"], FP_A) is not None
    # Each one-off write ties (written once) or loses against what it would evict: none is kept.
    assert not any(k in s for k in scan) and all(k in s for k in keys.values())
    st = s.stats()
    assert st["admission"] == "tinylfu" and st["refused"] == 6 and st["evictions"] == 0
    assert set(s.texts(FP_A)) == set(keys.values())  # a refused write lists nothing either
    s.close()


def test_every_write_is_kept_while_there_is_room(tmp_path):
    s = _store(tmp_path, "s", "tinylfu", room=3)
    keys = [put(s, make_entry(seed=i, text=f"chunk {i}", **BIG)) for i in range(3)]
    assert all(k in s for k in keys) and s.stats()["refused"] == 0
    s.close()


def test_a_chunk_written_again_is_admitted_over_one_written_once(tmp_path):
    """A miss written twice (retrieved twice, missed twice) beats the least recently used entry,
    written once and never read: it is kept, and that entry evicted."""
    s = _store(tmp_path, "s", "tinylfu", room=3)
    keys = [put(s, make_entry(seed=i, text=f"chunk {i}", **BIG)) for i in range(3)]
    wanted = make_entry(seed=9, text="asked for twice", **BIG)
    first = put(s, wanted)
    assert first not in s  # once: a tie with the victim, which stays
    assert put(s, wanted) == first and first in s  # twice: more than the victim
    assert keys[0] not in s and all(k in s for k in keys[1:])
    assert s.stats()["refused"] == 1 and s.stats()["evictions"] == 1
    s.close()


def test_a_stored_key_is_always_replaced(tmp_path):
    s = _store(tmp_path, "s", "tinylfu", room=2)
    e = make_entry(seed=0, text="chunk", **BIG)
    key = put(s, e)
    put(s, make_entry(seed=1, text="other", **BIG))
    put(s, e)  # a rewrite of a stored key: no victim to weigh it against
    assert key in s and s.stats()["refused"] == 0
    s.close()


def test_open_store_passes_the_rule_on(tmp_path):
    with open_store(tmp_path / "s", admission="tinylfu") as s:
        assert s.stats()["admission"] == "tinylfu"
    with open_store(tmp_path / "s") as s:
        assert s.stats()["admission"] == "lru"


def test_kvrag_opens_its_store_with_the_rule_it_is_given(tmp_path):
    h = tiny_llama(seed=0)
    assert KVRag(h, cache_dir=tmp_path / "a", policy="cacheblend").store.stats()["admission"] == "lru"
    rag = KVRag(h, cache_dir=tmp_path / "b", policy="cacheblend", admission="tinylfu")
    assert rag.store.stats()["admission"] == "tinylfu"
    with pytest.raises(ValueError, match="admission must be one of lru, tinylfu"):
        KVRag("/nonexistent/model", cache_dir=tmp_path / "c", admission="lfu")  # before the model load
