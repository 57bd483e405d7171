"""The serving scheduler on tiny random-weight models: a request's tokens are those
``KVRag.generate`` gives for the same prompt, policy and options, whether it runs alone or in
one batched decode step with others; cancel frees a slot, a failing request fails alone, and
the queue is bounded."""

import asyncio
import json
import threading
import time

import pytest
import torch
from helpers.corpus import DOCS, prompt_for

from kvrag.defaults import DEFAULT_MAX_NEW_TOKENS
from kvrag.engine import KVRag
from kvrag.serve import scheduler as sched_mod
from kvrag.serve.scheduler import (
    GenerationRequest,
    Scheduler,
    SchedulerClosedError,
    SchedulerFullError,
)
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["Where does the red fox live?", "How tall?", "Which river flows east?", "Who founded Brisk?"]


@pytest.fixture
def rag(handle, tmp_path):
    r = KVRag(handle, cache_dir=tmp_path / "kv", policy="cacheblend")
    r.precompute(DOCS)
    return r


def _prompt(i: int) -> str:
    """Prompt ``i``: 1 to 4 cached passages (lengths differ) and a question."""
    return prompt_for(DOCS[: i % 4 + 1], QUESTIONS[i % 4])


def _wait_for(cond, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_one_request_equals_generate(rag):
    prompt = _prompt(2)
    ref = rag.generate(prompt, max_new_tokens=10)
    with Scheduler(rag) as sched:
        fin = sched.submit(GenerationRequest.of(prompt, max_new_tokens=10)).result(timeout=120)
    assert fin.finish_reason == ref.finish_reason == "length"
    assert fin.token_ids == ref.token_ids and fin.text == ref.text
    assert fin.cached_tokens == ref.stats.read_tokens > ref.stats.cached_tokens > 0
    assert fin.prompt_tokens == ref.stats.prompt_tokens and fin.completion_tokens == 10
    assert fin.stats.new_tokens == 10 and fin.error is None
    assert fin.ttft_s is not None and fin.ttft_s > 0


def _calibrated_a2ats(handle, tmp_path) -> dict:
    """A2ATS parameters with a codebook for this model (window 4: top-k retrieval runs)."""
    from kvrag.policies.a2ats.calibrate import calibrate

    _, path = calibrate(
        handle,
        texts=[" ".join(DOCS) * 8],
        n_tokens=300,
        n_codes=16,
        iters=2,
        seq_len=96,
        out=tmp_path / "books.safetensors",
    )
    return {"codebook": str(path), "window": 4, "sink": 2}


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("mistral", {"sliding_window": 8}),  # every layer windowed; decoding reads past the window
        ("gemma3_text", {}),  # local (window 8) and global layers
    ],
)
def test_concurrent_requests_under_every_policy_equal_generate(tmp_path, model_type, overrides, monkeypatch):
    """Eight requests at once, each under another policy (A2ATS decoding on its own stepper,
    the rest in the batched step), prompts of different lengths: each request's greedy tokens
    and text are exactly those of ``KVRag.generate`` alone."""
    h = tiny_llama(seed=0, model_type=model_type, **overrides)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    policies = [
        ("full_prefill", {}),
        ("naive_reuse", {}),
        ("cacheblend", {}),
        ("epic", {}),
        ("a3", {}),
        ("kvlink", {}),
        ("samkv", {}),
        ("a2ats", _calibrated_a2ats(h, tmp_path)),
    ]
    prompts = [_prompt(i) for i in range(len(policies))]
    refs = [rag.generate(p, policy=n, max_new_tokens=10, **kw) for p, (n, kw) in zip(prompts, policies)]
    sizes = []
    real = sched_mod.decode_step

    def spy(arch, caches, tokens, arena=None, compiled=None):
        sizes.append(len(caches))
        return real(arch, caches, tokens, arena, compiled)

    monkeypatch.setattr(sched_mod, "decode_step", spy)
    # Admissions wait until every request is submitted: on a loaded machine the submissions
    # (each renders and tokenizes its prompt) could otherwise trickle in more slowly than the
    # first requests decode their 10 tokens, and never all run at once.
    all_in = threading.Event()
    admit = Scheduler._admit

    def gated(self, job):
        all_in.wait(timeout=60)
        return admit(self, job)

    monkeypatch.setattr(Scheduler, "_admit", gated)
    with Scheduler(rag, max_concurrency=8) as sched:
        tickets = [
            sched.submit(GenerationRequest.of(p, max_new_tokens=10, policy=n, policy_params=kw))
            for p, (n, kw) in zip(prompts, policies)
        ]
        all_in.set()
        fins = [t.result(timeout=300) for t in tickets]
    assert max(sizes) == 7, sizes  # every request but A2ATS' decoded in one step
    for (name, _), ref, fin in zip(policies, refs, fins):
        assert fin.error is None, name
        assert fin.token_ids == ref.token_ids, name
        assert fin.text == ref.text and fin.finish_reason == ref.finish_reason, name
        assert fin.cached_tokens == ref.stats.read_tokens, name


def test_streams_read_from_threads_and_asyncio_each_as_alone(rag):
    """Six streams of different prompt lengths, read at once from threads and from an event
    loop, with sampling (per-request seeded generators) and a stop string: each gets the text
    and tokens it gets alone."""
    reqs = [
        GenerationRequest.of(_prompt(0), max_new_tokens=12),
        GenerationRequest.of(_prompt(1), max_new_tokens=7, policy="full_prefill"),
        GenerationRequest.of(_prompt(2), max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7),
        GenerationRequest.of(_prompt(3), max_new_tokens=9, policy="epic", temperature=1.3, seed=3),
        GenerationRequest.of(_prompt(4), max_new_tokens=12, policy="naive_reuse"),
        GenerationRequest.of("A prompt with no cached passage", max_new_tokens=12),
    ]
    refs = [rag.generate(r.prompt, policy=r.policy, sampling=r.sampling) for r in reqs]
    # A stop string from inside the first answer: it ends there, as generate's does.
    stop = refs[0].text[len(refs[0].text) // 2 :][:3]
    assert stop.strip()
    reqs[0] = GenerationRequest.of(_prompt(0), max_new_tokens=12, stop=(stop,))
    refs[0] = rag.generate(_prompt(0), max_new_tokens=12, stop=[stop])
    assert refs[0].finish_reason == "stop"
    texts = [None] * len(reqs)
    with Scheduler(rag, max_concurrency=8) as sched:
        tickets = [sched.submit(r) for r in reqs]

        def read(i):
            texts[i] = "".join(tickets[i])

        threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()

        async def read_async():
            async def one(t):
                return "".join([d async for d in t])

            return await asyncio.gather(*(one(t) for t in tickets[3:]))

        texts[3:] = asyncio.run(read_async())
        for t in threads:
            t.join(120)
        fins = [t.result(timeout=120) for t in tickets]
    for i, (ref, fin) in enumerate(zip(refs, fins)):
        assert fin.token_ids == ref.token_ids, i
        assert texts[i] == fin.text == ref.text, i
        assert fin.finish_reason == ref.finish_reason, i


def test_cancel_frees_the_slot_and_a_waiting_cancel_leaves_the_queue(rag):
    ref = rag.generate(_prompt(1), max_new_tokens=5)
    with Scheduler(rag, max_concurrency=1, max_queue=4) as sched:
        long = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=4000))
        _wait_for(lambda: sched.running == 1)
        waiting = sched.submit(GenerationRequest.of(_prompt(2), max_new_tokens=5))
        after = sched.submit(GenerationRequest.of(_prompt(1), max_new_tokens=5))
        assert sched.queue_depth == 2
        waiting.cancel()  # a waiting request leaves the queue at once
        assert sched.queue_depth == 1
        assert waiting.result(timeout=5).finish_reason == "cancelled"
        it = iter(long)
        next(it)  # it is decoding
        long.cancel()
        fin = long.result(timeout=60)
        assert fin.finish_reason == "cancelled" and 0 < fin.completion_tokens < 4000
        assert list(it) is not None  # the stream ends (without an error)
        # The slot is free: the next request runs, with the tokens it gets alone.
        got = after.result(timeout=120)
        assert got.finish_reason == "length" and got.token_ids == ref.token_ids
        _wait_for(lambda: sched.running == 0 and sched.queue_depth == 0)


def test_a_request_failing_in_its_prefill_fails_alone(rag, monkeypatch):
    """A store fault while one request's chunks are read: that request ends with the error
    (its stream raises it), the others run to the end with their own tokens."""
    refs = [rag.generate(_prompt(i), max_new_tokens=6) for i in range(3)]
    real = rag.lookup.pieces

    def faulty(prompt, use_cache=True, tokens=None):
        if QUESTIONS[3] in prompt:
            raise OSError("chunk store unreachable")
        return real(prompt, use_cache, tokens)

    monkeypatch.setattr(rag.lookup, "pieces", faulty)
    with Scheduler(rag, max_concurrency=4) as sched:
        tickets = [sched.submit(GenerationRequest.of(_prompt(i), max_new_tokens=6)) for i in range(4)]
        fins = [t.result(timeout=120) for t in tickets]
        with pytest.raises(OSError, match="unreachable"):
            list(tickets[3])
        # The scheduler keeps serving.
        again = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=6)).result(timeout=120)
    assert fins[3].finish_reason == "error" and isinstance(fins[3].error, OSError)
    assert [f.token_ids for f in fins[:3]] == [r.token_ids for r in refs]
    assert again.token_ids == refs[0].token_ids


def test_a_request_failing_in_the_batched_step_fails_alone(rag, monkeypatch):
    """A fault in one request's part of the shared decode step (its cache) ends that request
    only: the step is retried without it, and the others' tokens are those they get alone."""
    refs = [rag.generate(_prompt(i), max_new_tokens=8) for i in range(4)]
    made = []
    real = sched_mod.DecodeCache.from_stepper
    real_step = sched_mod.decode_step
    steps = []

    def from_stepper(arch, stepper, spare=64):
        cache = real(arch, stepper, spare)
        made.append(cache)
        return cache

    def step(arch, caches, tokens, arena=None, compiled=None):
        # The second request admitted: every step that holds its cache fails from its 3rd on
        # (in the arena's one call per layer or on the per-request path alike).
        bad = made[1] if len(made) > 1 else None
        if any(c is bad for c in caches):
            steps.append(len(caches))
            if len(steps) > 2:
                raise RuntimeError("device fault")
        return real_step(arch, caches, tokens, arena, compiled)

    monkeypatch.setattr(sched_mod.DecodeCache, "from_stepper", staticmethod(from_stepper))
    monkeypatch.setattr(sched_mod, "decode_step", step)
    with Scheduler(rag, max_concurrency=4) as sched:
        tickets = [sched.submit(GenerationRequest.of(_prompt(i), max_new_tokens=8)) for i in range(4)]
        fins = [t.result(timeout=120) for t in tickets]
    assert fins[1].finish_reason == "error" and "device fault" in str(fins[1].error)
    assert fins[1].token_ids == refs[1].token_ids[:3]  # the tokens before the fault were streamed
    for i in (0, 2, 3):
        assert fins[i].finish_reason == "length" and fins[i].token_ids == refs[i].token_ids, i


def test_queue_full_answers_with_a_retry_estimate(rag):
    with Scheduler(rag, max_concurrency=1, max_queue=2) as sched:
        running = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=4000))
        _wait_for(lambda: sched.running == 1)
        queued = [sched.submit(GenerationRequest.of(_prompt(i), max_new_tokens=2)) for i in (1, 2)]
        assert sched.queue_depth == 2
        with pytest.raises(SchedulerFullError) as e:
            sched.submit(GenerationRequest.of(_prompt(3), max_new_tokens=2))
        assert e.value.retry_after_s >= 1
        running.cancel()
        assert [t.result(timeout=120).finish_reason for t in queued] == ["length", "length"]
        # Room again.
        assert (
            sched.submit(GenerationRequest.of(_prompt(3), max_new_tokens=2)).result(timeout=120).completion_tokens == 2
        )


def test_max_queue_counts_only_requests_beyond_the_slots(rag):
    """max_queue=0: served while a slot is free, refused at once while none is."""
    with Scheduler(rag, max_concurrency=2, max_queue=0) as sched:
        a = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=4000))
        b = sched.submit(GenerationRequest.of(_prompt(1), max_new_tokens=4000))
        _wait_for(lambda: sched.running == 2)
        with pytest.raises(SchedulerFullError):
            sched.submit(GenerationRequest.of(_prompt(2), max_new_tokens=2))
        a.cancel()
        _wait_for(lambda: sched.running == 1)
        c = sched.submit(GenerationRequest.of(_prompt(2), max_new_tokens=2))
        assert c.result(timeout=120).completion_tokens == 2
        b.cancel()


def test_bad_requests_fail_at_submit_and_a_closed_scheduler_takes_none(rag):
    sched = Scheduler(rag)
    with pytest.raises(SchedulerClosedError):
        sched.submit(GenerationRequest.of("hi"))  # not started
    with sched:
        for req, msg in [
            (dict(prompt="x", temperature=-1), "temperature"),
            (dict(prompt="x", top_p=0), "top_p"),
            (dict(prompt="x", max_new_tokens=-2), "max_new_tokens"),
            (dict(prompt="x", stop=("",)), "stop"),
            (dict(prompt="x", policy="nope"), "nope"),
            (dict(prompt="x", policy="cacheblend", policy_params={"recompute_ratio": 7}), "recompute_ratio"),
            (dict(prompt="word " * 5000), "context"),
            (dict(prompt=b"bytes"), "prompt"),
            (dict(prompt=[{"role": "user"}]), "content"),
        ]:
            with pytest.raises(ValueError, match=msg):
                sched.submit(GenerationRequest.of(**req))
        assert sched.queue_depth == 0
    with pytest.raises(SchedulerClosedError):
        sched.submit(GenerationRequest.of("hi"))


def test_close_ends_running_and_waiting_requests(rag):
    sched = Scheduler(rag, max_concurrency=1)
    sched.start()
    a = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=4000))
    _wait_for(lambda: sched.running == 1)
    b = sched.submit(GenerationRequest.of(_prompt(1), max_new_tokens=4000))
    sched.close()
    assert a.result(timeout=5).finish_reason == "cancelled"
    assert b.result(timeout=5).finish_reason == "cancelled"
    assert sched.running == 0 and sched.queue_depth == 0


def test_max_new_tokens_zero_and_one(rag):
    ref = rag.generate(_prompt(0), max_new_tokens=1)
    with Scheduler(rag) as sched:
        zero = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=0)).result(timeout=60)
        one = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=1)).result(timeout=60)
    assert zero.token_ids == [] and zero.finish_reason == "length" and zero.ttft_s is None
    assert zero.prompt_tokens == ref.stats.prompt_tokens
    assert one.token_ids == ref.token_ids and one.finish_reason == ref.finish_reason


def test_scheduler_runs_on_its_own_thread_only(rag, monkeypatch):
    """One thread owns the model: every decode step runs on the worker."""
    seen = set()
    real = sched_mod.decode_step

    def spy(*a, **kw):
        seen.add(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(sched_mod, "decode_step", spy)
    with Scheduler(rag) as sched:
        sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=4)).result(timeout=60)
    assert seen == {"kvrag-scheduler"}


@pytest.fixture
def eos_is(rag):
    """Make ``tokens`` the model's EOS ids for one test (the tiny model rarely draws its own)."""
    saved = set(rag.eos)

    def make(*tokens):
        rag.eos.clear()
        rag.eos.update(tokens)

    yield make
    rag.eos.clear()
    rag.eos.update(saved)


def test_min_tokens_bars_eos_and_ignore_eos_decodes_past_it(rag, eos_is):
    ref = rag.generate(_prompt(0), max_new_tokens=6)
    first, third = ref.token_ids[0], ref.token_ids[2]
    eos_is(third)
    with Scheduler(rag) as sched:
        plain = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=6)).result(timeout=60)
        # In one batched step with another request, and alone: the same tokens.
        together = [
            sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=6, ignore_eos=True)),
            sched.submit(GenerationRequest.of(_prompt(1), max_new_tokens=6)),
        ]
        ignored = together[0].result(timeout=60)
        together[1].result(timeout=60)
        barred = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=6, min_tokens=4)).result(timeout=60)
    assert plain.token_ids == ref.token_ids[:3] and plain.finish_reason == "stop"
    assert ignored.token_ids == ref.token_ids and ignored.finish_reason == "length"
    assert barred.token_ids[:2] == ref.token_ids[:2] and third not in barred.token_ids[:4]
    assert barred.completion_tokens >= 4
    # The first token is barred too (it comes from the prefill, not a decode step).
    eos_is(first)
    with Scheduler(rag) as sched:
        fin = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=3, min_tokens=1)).result(timeout=60)
    assert fin.token_ids[0] != first and fin.completion_tokens >= 1


def test_a_named_token_limit_past_the_context_is_refused_an_unnamed_one_is_cut(rag):
    n = rag.count_tokens(_prompt(0))
    room = rag.handle.max_context - n
    with Scheduler(rag) as sched:
        with pytest.raises(ValueError, match=f"{n}.*max_new_tokens={room + 1}.*{room} left"):
            sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=room + 1))
        with pytest.raises(ValueError, match="min_tokens=7 is over"):
            sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=6, min_tokens=7))
        with pytest.raises(ValueError, match="ignore_eos"):
            sched.submit(GenerationRequest.of(_prompt(0), ignore_eos="yes"))
        ok = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=room))
        ok.cancel()
        assert ok.result(timeout=60).finish_reason in ("cancelled", "stop")
        # A prompt that leaves 5 tokens of room, with no limit named, gets those 5 (not the
        # default 256) and is not refused.
        long_prompt = "word " * 4000
        left = rag.handle.max_context - rag.count_tokens(long_prompt)
        assert 0 < left < DEFAULT_MAX_NEW_TOKENS
        fin = sched.submit(GenerationRequest.of(long_prompt, max_new_tokens=None, ignore_eos=True)).result(timeout=120)
        assert fin.completion_tokens == left and fin.finish_reason == "length"


# ---- log-probabilities ----------------------------------------------------------------------
def _reference_logprobs(rag, prompt, tokens):
    """log_softmax [T, V] of the model's own forward over the prompt and ``tokens``: row i is
    the distribution token i was drawn from."""
    ids = torch.cat([p.token_ids for p in rag.pieces(rag.render(prompt), use_cache=False)[0]])
    full = torch.cat([ids, torch.tensor(tokens, dtype=torch.long)])
    with torch.no_grad():
        logits = rag.handle.model(full[None]).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : len(full) - 1], dim=-1)


def test_logprobs_are_the_models_distribution_and_spell_the_reply(handle, tmp_path):
    rag = KVRag(handle, cache_dir=tmp_path / "kv", policy="full_prefill")
    prompt = _prompt(2)
    with Scheduler(rag) as sched:
        ticket = sched.submit(GenerationRequest.of(prompt, max_new_tokens=8, logprobs=3))
        lone = ticket.result(timeout=120)
        # In one batched decode step beside a request that asks for none.
        pair = [
            sched.submit(GenerationRequest.of(prompt, max_new_tokens=8, logprobs=3)),
            sched.submit(GenerationRequest.of(_prompt(1), max_new_tokens=8)),
        ]
        together, other = (t.result(timeout=120) for t in pair)
    assert lone.finish_reason == "length" and len(lone.logprobs) == lone.completion_tokens == 8
    ref = _reference_logprobs(rag, prompt, lone.token_ids)
    for i, (e, tok) in enumerate(zip(lone.logprobs, lone.token_ids)):
        assert e.logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        assert [lp for _, lp in e.top] == pytest.approx(torch.topk(ref[i], 3).values.tolist(), abs=1e-4)
        assert e.top[0][0] == e.token and e.logprob == pytest.approx(e.top[0][1])  # greedy: the argmax
    assert "".join(e.token for e in lone.logprobs) == lone.text
    # Streamed: each delta carries its own tokens' entries, in order, all of them.
    assert [e for d in ticket.deltas() for e in d.logprobs] == lone.logprobs
    assert "".join(d.text for d in ticket.deltas()) == lone.text
    assert together.token_ids == lone.token_ids
    for a, b in zip(together.logprobs, lone.logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert other.logprobs is None


def test_logprobs_report_the_raw_distribution_and_leave_out_the_closing_eos(rag, eos_is):
    ref = rag.generate(_prompt(0), max_new_tokens=6)
    second, third = ref.token_ids[1], ref.token_ids[2]
    stop = rag.tokenizer.decode([second]).strip()
    assert stop, "the test needs a second token with visible text"
    eos_is(third)
    with Scheduler(rag) as sched:
        ended = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=6, logprobs=2)).result(timeout=60)
        barred = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=6, logprobs=2, min_tokens=4))
        barred = barred.result(timeout=60)
        # A stop string: its tokens are reported, though the reply is cut before it.
        cut = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=6, logprobs=0, stop=(stop,)))
        cut = cut.result(timeout=60)
    assert ended.token_ids == ref.token_ids[:3] and ended.finish_reason == "stop"
    assert len(ended.logprobs) == 2  # the EOS that ended it has no entry
    # min_tokens bars EOS from the draw, not from the figures: EOS stays the most likely.
    assert third not in barred.token_ids[:4]
    eos_text = rag.tokenizer.decode([third], skip_special_tokens=False)
    assert barred.logprobs[2].top[0][0] == eos_text and barred.logprobs[2].top[0][1] > barred.logprobs[2].logprob
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert len(cut.logprobs) == cut.completion_tokens == 2 and all(e.top == () for e in cut.logprobs)


def test_bad_logprobs_fail_at_submit(rag):
    with Scheduler(rag) as sched:
        for bad in (-1, 21, True, 2.5):
            with pytest.raises(ValueError, match="logprobs"):
                sched.submit(GenerationRequest.of("x", logprobs=bad))


# ---- sampling adjustments -------------------------------------------------------------------
def test_penalties_bias_and_top_k_equal_generate_alone_and_batched(rag):
    prompt = _prompt(1)
    fox = rag.tokenizer.encode(" fox", add_special_tokens=False)[0]
    first = rag.prefill(prompt).logits.float()
    narrow = float(first.max() - first[fox]) + 1.0  # wins the first draw by 1
    options = [
        dict(logit_bias={fox: 100.0}),
        dict(logit_bias={fox: narrow}, frequency_penalty=2.0, presence_penalty=2.0),
        dict(logit_bias={fox: narrow}, frequency_penalty=-2.0),
        dict(temperature=0.8, top_k=5, seed=3, frequency_penalty=1.0, logit_bias={fox: 3.0}),
    ]
    want = [rag.generate(prompt, max_new_tokens=6, **o).token_ids for o in options]
    assert want[0] == [fox] * 6 and want[1][0] == want[2][0] == fox
    assert want[1].count(fox) < want[2].count(fox)  # penalised repeats give way, rewarded ones go on
    with Scheduler(rag) as sched:
        alone = [sched.submit(GenerationRequest.of(prompt, max_new_tokens=6, **o)).result(timeout=60) for o in options]
        tickets = [sched.submit(GenerationRequest.of(prompt, max_new_tokens=6, **o)) for o in options]
        together = [t.result(timeout=60) for t in tickets]
        with pytest.raises(ValueError, match="vocabulary"):
            sched.submit(GenerationRequest.of(prompt, logit_bias={10**9: 1.0}))
        with pytest.raises(ValueError, match="presence_penalty"):
            sched.submit(GenerationRequest.of(prompt, presence_penalty=3.0))
    assert [f.token_ids for f in alone] == want
    assert [f.token_ids for f in together] == want


# ---- several choices -----------------------------------------------------------------------
@pytest.mark.parametrize("own_decoder", [False, True])
def test_choices_share_one_prefill_and_each_equals_its_own_request(handle, tmp_path, monkeypatch, own_decoder):
    """Choice i of a request of n draws what the same request of one choice draws with seed
    + i; a policy whose decode step is the batched one prefills once, one that decodes on its
    own (A2ATS) once per choice."""
    rag = KVRag(handle, cache_dir=tmp_path / "kv", policy="cacheblend")
    rag.precompute(DOCS)
    policy, params = ("a2ats", _calibrated_a2ats(handle, tmp_path)) if own_decoder else (None, {})
    req = dict(max_new_tokens=6, temperature=0.9, seed=7, policy=policy, policy_params=params, logprobs=1)
    prefills = []
    real = rag.prefill
    monkeypatch.setattr(rag, "prefill", lambda *a, **k: prefills.append(1) or real(*a, **k))
    with Scheduler(rag) as sched:
        tickets = sched.submit_choices(GenerationRequest.of(_prompt(2), n=3, **req))
        fins = [t.result(timeout=120) for t in tickets]
        assert len(prefills) == (3 if own_decoder else 1)
        alone = [
            sched.submit(GenerationRequest.of(_prompt(2), **{**req, "seed": 7 + i})).result(timeout=120)
            for i in range(3)
        ]
        greedy = sched.submit_choices(GenerationRequest.of(_prompt(2), n=2, max_new_tokens=6))
        greedy = [t.result(timeout=120) for t in greedy]
    assert [t.index for t in tickets] == [0, 1, 2]
    assert [f.token_ids for f in fins] == [f.token_ids for f in alone]
    assert len({tuple(f.token_ids) for f in fins}) > 1  # sampled: the choices differ
    for f, a in zip(fins, alone):
        assert f.text == a.text and f.prompt_tokens == a.prompt_tokens and f.cached_tokens == a.cached_tokens
        assert [e.token for e in f.logprobs] == [e.token for e in a.logprobs]
    assert greedy[0].token_ids == greedy[1].token_ids == rag.generate(_prompt(2), max_new_tokens=6).token_ids


def test_choices_take_a_slot_each_and_cancel_one_by_one(rag):
    with Scheduler(rag, max_concurrency=2) as sched:
        with pytest.raises(ValueError, match="decode slots"):
            sched.submit_choices(GenerationRequest.of(_prompt(0), n=3))
        with pytest.raises(ValueError, match="submit_choices"):
            sched.submit(GenerationRequest.of(_prompt(0), n=2))
        with pytest.raises(ValueError, match="n must be"):
            sched.submit_choices(GenerationRequest.of(_prompt(0), n=0))
        first = sched.submit(GenerationRequest.of(_prompt(0), max_new_tokens=4000))
        _wait_for(lambda: sched.running == 1)
        # Two choices need both slots: they wait until the first request ends.
        pair = sched.submit_choices(GenerationRequest.of(_prompt(1), n=2, max_new_tokens=4000))
        time.sleep(0.3)
        assert sched.running == 1 and sched.queue_depth == 1
        pair[1].cancel()  # one choice of a waiting request: the other still waits, for one slot
        assert pair[1].result(timeout=5).finish_reason == "cancelled"
        _wait_for(lambda: sched.running == 2)
        assert sched.queue_depth == 0 and not pair[0].done
        first.cancel()
        pair[0].cancel()
        assert first.result(timeout=60).finish_reason == pair[0].result(timeout=60).finish_reason == "cancelled"
        _wait_for(lambda: sched.running == 0)


def test_a_reply_held_to_a_json_schema_equals_generate_alone_and_batched(rag):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    want = rag.generate(_prompt(1), max_new_tokens=30, json_schema=schema)
    assert want.finish_reason == "stop" and isinstance(json.loads(want.text)["ok"], bool)
    with Scheduler(rag) as sched:
        alone = sched.submit(GenerationRequest.of(_prompt(1), max_new_tokens=30, json_schema=schema)).result(timeout=60)
        pair = [
            sched.submit(GenerationRequest.of(_prompt(1), max_new_tokens=30, json_schema=schema)),
            sched.submit(GenerationRequest.of(_prompt(2), max_new_tokens=30)),
        ]
        together = pair[0].result(timeout=60)
        pair[1].result(timeout=60)
        with pytest.raises(ValueError, match="JSON schema"):
            sched.submit(GenerationRequest.of(_prompt(1), json_schema={"type": "nonsense"}))
    for fin in (alone, together):
        assert fin.token_ids == want.token_ids and fin.text == want.text and fin.finish_reason == "stop"
