"""LangChain's own standard chat-model test suite (``langchain-tests``) against ``ChatKVRag``,
on the tiny random model saved as an HF directory (a model with a path, so serialization
round-trips). What kvrag does not do -- tool calling, image / audio / video / PDF input -- is
declared unsupported through the suite's properties, so those tests are skipped by the suite
itself, for that stated reason. So are structured output and JSON mode, which ChatKVRag does:
the suite's schemas have free strings, which a random model does not close within the suite's
8-token answers; ``tests/integration_tests/test_chat_models.py`` tests them instead."""

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import Field

from kvrag.engine import KVRag
from kvrag.testing import tiny_llama
from langchain_kvrag import ChatKVRag

_DIR = {}
# The suite's async tests are plain ``async def``: run them with anyio's pytest plugin (asyncio).
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module", autouse=True)
def tiny_model_dir(tmp_path_factory):
    handle = tiny_llama(seed=0)
    d = tmp_path_factory.mktemp("tiny-chat-model")
    handle.model.save_pretrained(d)
    handle.tokenizer.save_pretrained(d)
    # One loaded KVRag for every model the suite builds (each test builds its own chat model);
    # a serialization round trip still loads the model again from the directory.
    _DIR["rag"] = KVRag(str(d), cache_dir=tmp_path_factory.mktemp("kv"))
    yield


class _KVRagSuite:
    @property
    def chat_model_class(self):
        return ChatKVRag

    @property
    def chat_model_params(self) -> dict:
        return {"rag": _DIR["rag"]}

    @property
    def standard_chat_model_params(self) -> dict:
        # The suite's standard keywords, less timeout / max_retries / api_key: a hosted API's
        # settings a local model does not have (ChatKVRag refuses unknown keywords rather than
        # ignoring them).
        return {"temperature": 0, "max_tokens": 8, "stop": []}

    returns_usage_metadata = property(lambda self: True)


# What kvrag does not support (it answers from text): the suite skips those tests.
for _feature in (
    "has_tool_calling",
    "has_tool_choice",
    "has_structured_output",
    "supports_json_mode",
    "supports_image_inputs",
    "supports_image_urls",
    "supports_pdf_inputs",
    "supports_audio_inputs",
    "supports_video_inputs",
    "supports_image_tool_message",
    "supports_pdf_tool_message",
    "supports_anthropic_inputs",
):
    setattr(_KVRagSuite, _feature, property(lambda self: False))


class TestChatKVRagUnit(_KVRagSuite, ChatModelUnitTests):
    @pytest.mark.xfail(
        reason="the suite compares with a stored snapshot (this record holds the machine's model "
        "path) and loads with allowed_objects='all', which admits only the partner classes "
        "langchain-core lists; test_serdes_round_trip runs the same round trip"
    )
    def test_serdes(self, model, snapshot) -> None:
        super().test_serdes(model, snapshot)

    def test_serdes_round_trip(self, model) -> None:
        from langchain_core.load import dumpd, load

        ser = dumpd(model)
        assert ser["id"] == ["langchain_kvrag", "chat_models", "ChatKVRag"]
        assert ser["kwargs"]["model"] == model.model and "rag" not in ser["kwargs"]
        again = load(ser, valid_namespaces=model.get_lc_namespace()[:1], allowed_objects=[ChatKVRag])
        assert again.dict() == model.dict() and again.rag is not model.rag


class _ShortChatKVRag(ChatKVRag):
    """ChatKVRag answering in 8 tokens by default: the suite builds some models from
    ``chat_model_params`` alone (test_stop_sequence), and 256 tokens of a random model take
    half a minute on a small CPU."""

    max_new_tokens: int = Field(default=8, gt=0)


class TestChatKVRagIntegration(_KVRagSuite, ChatModelIntegrationTests):
    @property
    def chat_model_class(self):
        return _ShortChatKVRag
