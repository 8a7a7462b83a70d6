"""The RL hooks over HTTP (the behaviour itself: tests/runtime/test_rl_hooks.py).

    POST /update_weights_from_disk {"model_path": P, "weight_version": "v1"} -> {"success": true, ...}
    GET  /get_weight_version                                                 -> {"weight_version": "v1"}
    POST /release_memory_occupation {}   then /generate answers 503
    POST /resume_memory_occupation {}
"""

import requests

from server_harness import wait_idle

GREEDY = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=300)


def test_update_weights_in_place_bumps_the_version(live_server, tiny_model_path):
    before = post(live_server, "/generate", GREEDY).json()
    r = post(live_server, "/update_weights_from_disk", {"model_path": tiny_model_path, "weight_version": "v-http"})
    assert r.status_code == 200 and r.json()["success"] is True
    assert requests.get(live_server + "/get_weight_version", timeout=30).json() == {"weight_version": "v-http"}
    assert requests.get(live_server + "/get_model_info", timeout=30).json()["weight_version"] == "v-http"
    after = post(live_server, "/generate", GREEDY).json()
    assert after["output_ids"] == before["output_ids"]  # the same weights again
    assert after["meta_info"]["weight_version"] == "v-http" and after["meta_info"]["cached_tokens"] == 0


def test_update_errors_are_400_and_keep_the_weights(live_server):
    r = post(live_server, "/update_weights_from_disk", {"model_path": "/no/such/model"})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    r = post(live_server, "/update_weights_from_disk", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    assert post(live_server, "/generate", GREEDY).status_code == 200


def test_release_then_resume(live_server):
    before = post(live_server, "/generate", GREEDY).json()["output_ids"]
    assert post(live_server, "/release_memory_occupation", {}).json()["released"] == ["kv_cache", "weights"]
    r = post(live_server, "/generate", GREEDY)
    assert r.status_code == 503 and "resume_memory_occupation" in r.json()["error"]["message"]
    r = post(live_server, "/release_memory_occupation", {"tags": ["gpu"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags[0]"
    assert post(live_server, "/resume_memory_occupation", {}).json()["released"] == []
    assert post(live_server, "/generate", GREEDY).json()["output_ids"] == before
    assert wait_idle(live_server)["integrity"] == "ok"
