"""The OpenAI wire format (``kvrag.serve.protocol``): a body mapped onto the generation options
(``generation_options``, the one mapping), the refusals only the wire can make, and the policy
a body names resolved once (``GenerationServing.policy``)."""

import pytest

from kvrag.policies import Policy
from kvrag.query.decode import Sampling
from kvrag.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, generation_options
from kvrag.serve.serving import GenerationServing

MESSAGES = [{"role": "user", "content": "Where does the fox live?"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def test_an_empty_body_takes_openais_defaults():
    s = generation_options(chat())
    # OpenAI samples at temperature 1 unless told; the token limit is left to the server's rule.
    assert s == Sampling(max_new_tokens=None, temperature=1.0, top_p=1.0)


def test_every_option_lands_in_its_sampling_field():
    body = chat(
        max_completion_tokens=12,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,  # vLLM's "every token"
        stop="END",
        seed=3,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        logit_bias={"17": 4.0, " 5": -100},
        min_tokens=2,
        ignore_eos=True,
        response_format={"type": "json_object"},
    )
    s = generation_options(body)
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (12, 0.5, 0.9, 0, 3)
    assert s.stop == ("END",)
    assert (s.presence_penalty, s.frequency_penalty) == (1.5, -0.5)
    assert s.logit_bias == {17: 4.0, 5: -100.0}
    assert (s.min_tokens, s.ignore_eos) == (2, True)
    assert s.json_schema == {"type": "object"}
    # The legacy name of the token limit, and a list of stops, on the completions endpoint.
    s = generation_options(CompletionRequest(prompt="p", max_tokens=7, stop=["a", "b"]))
    assert (s.max_new_tokens, s.stop) == (7, ("a", "b"))


def test_a_schema_or_a_required_call_holds_the_reply():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert generation_options(body).json_schema == schema
    call = {"type": "object", "required": ["name"]}
    assert generation_options(chat(), call).json_schema == call
    with pytest.raises(APIError) as e:
        generation_options(body, call)
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"logit_bias": {"fox": 1.0}}, "logit_bias"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ],
)
def test_what_only_the_wire_can_refuse_names_its_field(fields, param):
    with pytest.raises(APIError) as e:
        generation_options(chat(**fields))
    assert e.value.status == 400 and e.value.param == param


def test_options_sampling_refuses_raise_its_value_error():
    # Ranges pydantic does not know (the sampling rule's own): min_tokens past the named limit.
    with pytest.raises(ValueError, match="min_tokens"):
        generation_options(chat(max_tokens=4, min_tokens=5))


def test_the_policy_is_resolved_once_with_its_parameters():
    pol = GenerationServing.policy(chat(kvrag={"policy": "epic", "k_head": 2}))
    assert isinstance(pol, Policy) and pol.name == "epic" and pol.params.k_head == 2
    # None (and "auto") is the server's own policy, left to the scheduler.
    assert GenerationServing.policy(chat()) is None
    assert GenerationServing.policy(chat(kvrag={"policy": "auto"})) is None
    for bad in ({"policy": "nope"}, {"policy": "epic", "bogus": 1}):
        with pytest.raises(APIError) as e:
            GenerationServing.policy(chat(kvrag=bad))
        assert e.value.param == "kvrag.policy" and e.value.message.startswith("kvrag: ")
    with pytest.raises(APIError) as e:
        GenerationServing.policy(chat(kvrag={"k_head": 2}))
    assert e.value.param == "kvrag"
