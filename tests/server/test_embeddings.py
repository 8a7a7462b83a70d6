"""Embeddings: OpenAI's `/v1/embeddings` (with the official client) and SGLang's `/encode`.

    client.embeddings.create(model=m, input=["a", "b"])             # float vectors, L2-normalized
    client.embeddings.create(model=m, input="a", encoding_format="base64")
    POST /encode {"text": "a"} -> {"embedding": [...], "meta_info": {...}}

A vector is the model's final hidden state of the last token (`--embedding-pooling last`,
the default; `mean` averages over tokens), normalized. Checked here against transformers
running the same tiny checkpoint.
"""

import base64
import math
import struct

import openai
import pytest
import requests
import torch

TEXTS = ["The capital of France is Paris.", "Two plus two is four."]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """text -> the normalized last-token hidden state, from transformers."""
    from transformers import AutoTokenizer, LlamaModel

    model = LlamaModel.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)

    def embed(text):
        with torch.no_grad():
            hidden = model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=0).tolist()

    return embed


def test_embeddings_match_the_reference_model(client, reference, live_server):
    r = client.embeddings.create(model="any", input=TEXTS)
    assert [d.index for d in r.data] == [0, 1]
    for d, text in zip(r.data, TEXTS):
        assert len(d.embedding) == 64  # the tiny model's hidden size
        assert math.isclose(sum(x * x for x in d.embedding), 1.0, rel_tol=1e-4)
        assert torch.allclose(torch.tensor(d.embedding), torch.tensor(reference(text)), atol=1e-4)
    tokens = sum(len(requests.post(live_server + "/tokenize", json={"prompt": t}, timeout=30).json()["tokens"])
                 for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens


def test_base64_is_the_same_vector(client):
    floats = client.embeddings.create(model="any", input=TEXTS[0]).data[0].embedding
    raw = client.embeddings.with_raw_response.create(model="any", input=TEXTS[0], encoding_format="base64")
    packed = base64.b64decode(raw.http_response.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(floats)}f", packed)) == pytest.approx(floats, abs=1e-7)


def test_token_inputs_and_errors(client, live_server):
    ids = requests.post(live_server + "/tokenize", json={"prompt": TEXTS[0]}, timeout=30).json()["tokens"]
    by_ids = client.embeddings.create(model="any", input=[ids]).data[0].embedding
    by_text = client.embeddings.create(model="any", input=TEXTS[0]).data[0].embedding
    assert by_ids == pytest.approx(by_text, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="any", input=TEXTS[0], dimensions=8)
    assert e.value.body["param"] == "dimensions"
    r = requests.post(live_server + "/v1/embeddings", json={"input": [[]]}, timeout=30)
    assert r.status_code == 400


def test_native_encode(live_server, client):
    one = requests.post(live_server + "/encode", json={"text": TEXTS[0]}, timeout=30).json()
    assert one["embedding"] == pytest.approx(client.embeddings.create(model="any", input=TEXTS[0]).data[0].embedding,
                                             abs=1e-6)
    assert one["meta_info"]["prompt_tokens"] > 0
    batch = requests.post(live_server + "/encode", json={"text": TEXTS}, timeout=30).json()
    assert len(batch) == 2 and batch[0]["embedding"] == pytest.approx(one["embedding"], abs=1e-6)


def test_engine_encode(tiny_engine):
    single = tiny_engine.encode(TEXTS[0])
    both = tiny_engine.encode(TEXTS)
    assert len(single["embedding"]) == 64 and both[0]["embedding"] == pytest.approx(single["embedding"], abs=1e-6)
