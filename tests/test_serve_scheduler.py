"""The serving scheduler on tiny random-weight models: a request's tokens are those
``KVRag.generate`` gives for the same prompt and policy, alone or among concurrent requests;
cancel, failure isolation, backpressure."""

import asyncio
import threading

import pytest
from corpus_helpers import DOCS, prompt_for

from kvrag.engine import KVRag
from kvrag.serve.scheduler import (
    GenerationRequest,
    Scheduler,
    SchedulerClosedError,
    SchedulerFullError,
)
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def handle():
    return tiny_llama(seed=0)


@pytest.fixture
def rag(handle, tmp_path):
    r = KVRag(handle, cache_dir=tmp_path / "kv", policy="cacheblend")
    r.precompute(DOCS)
    return r


def test_one_request_equals_generate(rag):
    prompt = prompt_for(DOCS[:3])
    ref = rag.generate(prompt, max_new_tokens=10)
    with Scheduler(rag) as sched:
        fin = sched.submit(GenerationRequest(prompt, max_new_tokens=10)).result(timeout=120)
    assert fin.finish_reason == ref.finish_reason
    assert fin.token_ids == ref.token_ids and fin.text == ref.text
    assert fin.cached_tokens == ref.stats.cached_tokens > 0
    assert fin.prompt_tokens == ref.stats.prompt_tokens and fin.completion_tokens == 10
    assert fin.ttft_s is not None and fin.ttft_s > 0


def test_concurrent_requests_each_as_alone(rag):
    prompts = [prompt_for(DOCS[: i + 1], q) for i, q in enumerate(["Who?", "Where is it?", "When", "Why not?"])]
    refs = [
        rag.generate(p, policy=pol, max_new_tokens=8) for p, pol in zip(prompts, ["cacheblend", "full_prefill"] * 2)
    ]
    with Scheduler(rag, max_concurrency=4) as sched:
        tickets = [
            sched.submit(GenerationRequest(p, max_new_tokens=8, policy=pol))
            for p, pol in zip(prompts, ["cacheblend", "full_prefill"] * 2)
        ]
        texts = [None] * 4

        def read(i):
            texts[i] = "".join(tickets[i])

        threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        fins = [t.result(timeout=120) for t in tickets]
    for ref, fin, text in zip(refs, fins, texts):
        assert fin.token_ids == ref.token_ids
        assert text == fin.text == ref.text


def test_async_iteration(rag):
    prompt = prompt_for(DOCS[:2])
    ref = rag.generate(prompt, max_new_tokens=6)

    async def main(sched):
        t = sched.submit(GenerationRequest(prompt, max_new_tokens=6))
        return "".join([d async for d in t])

    with Scheduler(rag) as sched:
        assert asyncio.run(main(sched)) == ref.text


def test_queue_full_and_closed(rag):
    sched = Scheduler(rag, max_concurrency=1, max_queue=1)
    with pytest.raises(SchedulerClosedError):
        sched.submit(GenerationRequest("hi"))
    # Not started: nothing is taken from the queue, so the limit binds deterministically.
    sched._thread = threading.current_thread()
    sched.submit(GenerationRequest("hello", max_new_tokens=1))
    with pytest.raises(SchedulerFullError) as e:
        sched.submit(GenerationRequest("hello again", max_new_tokens=1))
    assert e.value.retry_after_s > 0
    sched._thread = None
    sched.close()


def test_bad_requests_fail_at_submit(rag):
    with Scheduler(rag) as sched:
        with pytest.raises(ValueError, match="temperature"):
            sched.submit(GenerationRequest("x", temperature=-1))
        with pytest.raises(Exception, match="nope"):
            sched.submit(GenerationRequest("x", policy="nope"))
        with pytest.raises(ValueError, match="context"):
            sched.submit(GenerationRequest("word " * 5000))
