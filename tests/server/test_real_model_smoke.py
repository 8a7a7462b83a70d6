"""Tool calling and embeddings on the real embedded model (SmolLM2-135M-Instruct), where the
answers mean something: `pytest -m slow tests/server/test_real_model_smoke.py`."""

import json
import signal

import openai
import pytest

from server_harness import LiveServer

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = LiveServer("default", tmp_path_factory.mktemp("smollm2"), ["--tool-call-parser", "json"]).start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert server.stop(signal.SIGTERM) == 0


def test_smollm2_calls_the_tool_with_the_city(client):
    r = client.chat.completions.create(model="any", tools=[WEATHER], tool_choice="required", max_tokens=60,
                                       temperature=0,
                                       messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()


def test_smollm2_embeddings_put_similar_sentences_closer(client):
    texts = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock markets fell sharply today."]
    vectors = [d.embedding for d in client.embeddings.create(model="any", input=texts).data]

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))  # the vectors are normalized

    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2])
