"""Embeddings from the served model: OpenAI's `/v1/embeddings` and SGLang's native `/encode`.

    POST /v1/embeddings {"input": str | [str] | [int] | [[int]], "model", "encoding_format": "float"|"base64"}
        -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}
    POST /encode {"text": str | [str]} or {"input_ids": [int] | [[int]]}
        -> {"embedding": [...], "meta_info": {"id", "prompt_tokens"}} (a list of them for a batch)

Each vector is the final hidden state pooled by `--embedding-pooling` (last token or mean)
and L2-normalized (model_executor/embedding.py). `base64` is the float32 little-endian bytes
of the vector, base64-encoded, as OpenAI sends it (no numpy here: this process is torch- and
numpy-free).
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import List

from aiohttp import web

from lmprog_runtime.messages import EmbedReq
from lmprog_runtime.server.http import RUNTIME, control, off_loop, read_request
from lmprog_runtime.server.limits import check_prompt_size
from lmprog_runtime.generate_request import RequestError

EMBED_TIMEOUT_S = 300.0


async def embeddings(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    body = await read_request(request, "/v1/embeddings")
    prompts = await _prompts(rt, body["input"], "input")
    vectors = await _embed(rt, prompts)
    as_base64 = body.get("encoding_format") == "base64"
    data = [{"object": "embedding", "index": i, "embedding": _b64(v) if as_base64 else v}
            for i, v in enumerate(vectors)]
    used = sum(len(p) for p in prompts)
    return web.json_response({"object": "list", "data": data,
                              "model": body.get("model") or rt.model_info["served_model_name"],
                              "usage": {"prompt_tokens": used, "total_tokens": used}})


async def encode(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    body = await read_request(request, "/encode")
    value, field = (body["input_ids"], "input_ids") if body.get("input_ids") is not None else (body.get("text"), "text")
    if value is None:
        raise RequestError("Either text or input_ids should be provided.")
    prompts = await _prompts(rt, value, field)
    vectors = await _embed(rt, prompts)
    results = [{"embedding": v, "meta_info": {"id": uuid.uuid4().hex, "prompt_tokens": len(p),
                                              "weight_version": rt.tm.weight_version}}
               for v, p in zip(vectors, prompts)]
    batch = isinstance(value, list) and value and not isinstance(value[0], int)
    return web.json_response(results if batch else results[0])


async def _prompts(rt, value, field: str) -> List[List[int]]:
    """Token ids of each input (one string / id list, or a list of them)."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], str)):
        check_prompt_size(rt, value, field)
        texts = [value] if isinstance(value, str) else value
        prompts = await off_loop(rt, lambda: [rt.tokenizer.encode(t) for t in texts])
    else:
        prompts = [value] if value and isinstance(value[0], int) else value
    for i, ids in enumerate(prompts):
        where = field if len(prompts) == 1 else f"{field}[{i}]"
        if not ids:
            raise RequestError(f"{where}: the input is empty.")
        if len(ids) >= rt.tm.context_len:
            raise RequestError(f"{where}: the input ({len(ids)} tokens) is longer than the model's context "
                               f"length ({rt.tm.context_len} tokens).")
    return prompts


async def _embed(rt, prompts: List[List[int]]) -> List[List[float]]:
    msg = EmbedReq(prompts, rt.args.embedding_pooling)
    reply = await control(rt, msg.kind, EMBED_TIMEOUT_S, msg)
    if not reply.success:
        raise RequestError(f"Embedding failed: {reply.message}", 503 if "released" in reply.message else 500)
    return reply.data["embeddings"]


def _b64(vector: List[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


EMBEDDING_ROUTES = [("POST", "/v1/embeddings", embeddings), ("POST", "/encode", encode)]
