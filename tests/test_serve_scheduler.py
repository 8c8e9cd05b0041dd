"""The serving scheduler over a scripted StepEngine: stop sequences on text, EOS, max_tokens, the queue
limit, cancellation freeing slots, engine failures and shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.runtime.engine_api import RequestParams
from specpilot.serve.scheduler import Detokenizer, RequestError, Scheduler, SchedulerConfig

EOS = 0


def decode(ids: list[int]) -> str:
    """Token i > 0 is the letter chr(ord('a') + i - 1); EOS decodes to nothing."""
    return "".join(chr(ord("a") + i - 1) for i in ids if i != EOS)


class ScriptedEngine:
    """Each request emits its script's tokens, `per_step` at a time, `delay` seconds a step."""

    def __init__(self, script: list[int], per_step: int = 2, max_batch: int = 4, delay: float = 0.0,
                 fail_at: int | None = None) -> None:
        self.script, self.per_step, self.max_batch, self.delay, self.fail_at = script, per_step, max_batch, delay, fail_at
        self.pos: dict[str, int] = {}
        self.released: list[str] = []
        self.steps = 0
        self.lock = threading.Lock()

    def admit(self, rid, prompt_ids, params):
        assert len(self.pos) < self.max_batch
        self.pos[rid] = 0

    def step(self):
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("device lost")
        time.sleep(self.delay)
        out = {}
        for rid, p in self.pos.items():
            out[rid] = self.script[p:p + self.per_step]
            self.pos[rid] = p + self.per_step
        return out

    def release(self, rid):
        self.released.append(rid)
        del self.pos[rid]

    def active(self):
        return list(self.pos)


def run(engine, coro_fn, **cfg):
    async def main():
        scheduler = Scheduler(engine, decode, EOS, SchedulerConfig(**cfg))
        try:
            return await coro_fn(scheduler)
        finally:
            scheduler.close(timeout=5)

    return asyncio.run(main())


async def drain(stream):
    outs = []
    async for out in stream:
        outs.append(out)
    return outs


def params(n=20):
    return RequestParams(max_new_tokens=n)


def test_stop_sequence_across_tokens_ends_the_request_before_it():
    engine = ScriptedEngine([1, 2, 3, 4, 5, 6, 7, 8])  # "abcdefgh", two tokens a step

    async def go(s):
        return await drain(s.submit([5], params(), stop=("def",)))

    outs = run(engine, go)
    assert "".join(o.text for o in outs) == "abc"
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert engine.released == ["req-0"]
    assert all("d" not in o.text for o in outs)  # held back until the stop string was decided


def test_eos_and_max_tokens_finish_reasons_and_usage():
    async def go(s):
        a = await drain(s.submit([5, 6], params(20)))
        b = await drain(s.submit([5], params(3)))
        return a, b

    a, b = run(ScriptedEngine([1, 2, 3, EOS, 4, 5]), go)
    assert "".join(o.text for o in a) == "abc" and a[-1].finish_reason == "stop"
    assert (a[-1].prompt_tokens, a[-1].completion_tokens) == (2, 4)  # EOS counts as generated
    assert "".join(o.text for o in b) == "abc" and b[-1].finish_reason == "length"
    assert b[-1].completion_tokens == 3


@settings(max_examples=40, deadline=None)
@given(script=st.lists(st.integers(1, 4), min_size=1, max_size=12),
       stops=st.lists(st.text("abcd", min_size=1, max_size=3), max_size=2),
       per_step=st.integers(1, 3))
def test_streamed_text_is_the_full_text_cut_at_the_first_stop(script, stops, per_step):
    async def go(s):
        return await drain(s.submit([1], params(len(script)), stop=tuple(stops)))

    outs = run(ScriptedEngine(script, per_step=per_step), go)
    full = decode(script)
    cuts = [full.find(x) for x in stops if full.find(x) >= 0]
    expected = full[:min(cuts)] if cuts else full
    assert "".join(o.text for o in outs) == expected
    assert outs[-1].finish_reason == ("stop" if cuts else "length")


def test_detokenizer_holds_back_an_unfinished_character():
    detok = Detokenizer(lambda ids: "ab\ufffd" if len(ids) == 1 else "abé", ())
    assert detok.settle([1], final=False) == ("ab", False)
    assert detok.settle([1, 2], final=False) == ("abé", False)


def test_full_queue_is_refused_with_429_and_the_rest_are_served():
    engine = ScriptedEngine(list(range(1, 9)), per_step=1, max_batch=1, delay=0.01)

    async def go(s):
        first = s.submit([1], params(8))
        await asyncio.sleep(0.05)  # admitted: running, not waiting
        second = s.submit([1], params(8))
        with pytest.raises(RequestError) as e:
            s.submit([1], params(8))
        return e.value, await drain(first), await drain(second)

    err, a, b = run(engine, go, max_batch=1, max_queue=1)
    assert err.status == 429 and err.code == "queue_full"
    assert a[-1].completion_tokens == b[-1].completion_tokens == 8


def test_closing_a_stream_aborts_the_request_and_frees_its_slot():
    engine = ScriptedEngine(list(range(1, 27)) * 40, per_step=1, max_batch=1, delay=0.005)

    async def go(s):
        stream = s.submit([1], params(1000))
        await stream.__anext__()
        await stream.aclose()  # the client went away
        other = await asyncio.wait_for(drain(s.submit([1], params(3))), timeout=10)
        return other

    other = run(engine, go, max_batch=1)
    assert engine.released[0] == "req-0"  # the abandoned request was released, then the next one ran
    assert "".join(o.text for o in other) == "abc"


def test_prompt_longer_than_the_context_is_refused():
    async def go(s):
        with pytest.raises(RequestError) as e:
            s.submit(list(range(60)), params(10))
        return e.value

    err = run(ScriptedEngine([1]), go, context=64, verify_tokens=9)
    assert err.status == 400 and err.code == "context_length_exceeded" and "55 tokens" in err.message


def test_an_engine_failure_ends_running_requests_with_an_error_and_the_loop_goes_on():
    engine = ScriptedEngine([1, 2, 3, 4], per_step=1, fail_at=2)

    async def go(s):
        failed = await drain(s.submit([1], params(4)))
        engine.fail_at = None
        return failed, await drain(s.submit([1], params(4)))

    failed, ok = run(engine, go)
    assert failed[-1].finish_reason == "error" and "device lost" in failed[-1].error
    assert "".join(o.text for o in ok) == "abcd"


def test_close_lets_running_and_waiting_requests_finish_then_refuses_new_ones():
    engine = ScriptedEngine(list(range(1, 11)), per_step=1, max_batch=1, delay=0.005)

    async def go(s):
        streams = [s.submit([1], params(10)) for _ in range(3)]
        results = asyncio.gather(*(drain(x) for x in streams))
        await asyncio.to_thread(s.close, 10)
        with pytest.raises(RequestError) as e:
            s.submit([1], params(1))
        return await results, e.value

    results, err = run(engine, go, max_batch=1)
    assert [r[-1].finish_reason for r in results] == ["length"] * 3
    assert err.status == 503


def test_chat_template_renders_messages_and_refuses_what_it_raises_on(tmp_path):
    """The plain template without a tokenizer_config.json; else its template with bos_token and
    raise_exception, as transformers renders it."""
    from specpilot.runtime.tokenizer import load_chat_template

    assert load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}'
        '{% if m.role == \'system\' %}{{ raise_exception(\'no system\') }}{% endif %}[{{ m.role }}]{{ m.content }}'
        '{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}')
    template = load_chat_template(tmp_path)
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"
    from jinja2 import TemplateError
    with pytest.raises(TemplateError, match="no system"):
        template.render([{"role": "system", "content": "x"}])
