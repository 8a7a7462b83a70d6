"""Sessions (SGLang's): continue a request without resending what came before.

    sid = POST /open_session {"capacity_of_str_len": 1000}               -> "<session id>"
    POST /generate {"text": "Turn 1", "session_params": {"id": sid}, "rid": "t1", ...}
    POST /generate {"text": " Turn 2", "session_params": {"id": sid, "rid": "t1"}, ...}
        # the prompt is turn 1's prompt + turn 1's output + " Turn 2"; the KV of the
        # first part is already cached, so only the new tokens are prefilled
    POST /close_session {"session_id": sid}

`offset` cuts the continued sequence to its first tokens, `drop_previous_output` keeps
only the parent's prompt, `replace` forgets what continued the parent before.
"""

import requests

from server_harness import wait_idle

GREEDY = {"temperature": 0, "max_new_tokens": 6}


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=60)


def tokens(url, text):
    return post(url, "/tokenize", {"prompt": text}).json()["tokens"]


def generate(url, **body):
    r = post(url, "/generate", {"sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_continued_request_reuses_the_sessions_kv(live_server):
    sid = post(live_server, "/open_session", {"capacity_of_str_len": 1000}).json()
    first = generate(live_server, text="Once upon a time", rid="s-turn-1", session_params={"id": sid})
    second = generate(live_server, text=" and then", rid="s-turn-2", session_params={"id": sid, "rid": "s-turn-1"})
    # the same as sending the whole sequence ...
    whole = tokens(live_server, "Once upon a time") + first["output_ids"] + tokens(live_server, " and then")
    assert second["meta_info"]["prompt_tokens"] == len(whole)
    assert generate(live_server, input_ids=whole)["output_ids"] == second["output_ids"]
    # ... but its prefix was not recomputed: all of turn 1 but its last token (never fed) was cached
    assert second["meta_info"]["cached_tokens"] >= len(whole) - len(tokens(live_server, " and then")) - 1
    assert post(live_server, "/close_session", {"session_id": sid}).status_code == 200
    wait_idle(live_server)


def test_offset_drop_previous_output_and_replace(live_server):
    sid = post(live_server, "/open_session", {"session_id": "s-options"}).json()
    assert sid == "s-options"
    generate(live_server, text="Hello there", rid="o-1", session_params={"id": sid})
    hello = tokens(live_server, "Hello there")
    dropped = generate(live_server, text="!", rid="o-2",
                       session_params={"id": sid, "rid": "o-1", "drop_previous_output": True})
    assert dropped["meta_info"]["prompt_tokens"] == len(hello) + len(tokens(live_server, "!"))
    cut = generate(live_server, text="!", rid="o-3", session_params={"id": sid, "rid": "o-1", "offset": 1})
    assert cut["meta_info"]["prompt_tokens"] == 1 + len(tokens(live_server, "!"))
    # replace: o-1's continuations are forgotten, so o-2 can no longer be continued
    generate(live_server, text="?", rid="o-4", session_params={"id": sid, "rid": "o-1", "replace": True})
    r = post(live_server, "/generate", {"text": "x", "session_params": {"id": sid, "rid": "o-2"}})
    assert r.status_code == 400 and "o-2" in r.json()["error"]["message"]
    post(live_server, "/close_session", {"session_id": sid})


def test_session_errors_name_what_is_wrong(live_server):
    r = post(live_server, "/generate", {"text": "x", "session_params": {"id": "no-such-session"}})
    assert r.status_code == 400 and "session_params.id" in r.json()["error"]["message"]
    r = post(live_server, "/generate", {"text": "x", "session_params": {"id": "s", "bogus": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_params.bogus"
    sid = post(live_server, "/open_session", {}).json()
    r = post(live_server, "/generate", {"text": ["a", "b"], "session_params": {"id": sid}})
    assert r.status_code == 400 and "not a batch" in r.json()["error"]["message"]
    r = post(live_server, "/open_session", {"session_id": sid})
    assert r.status_code == 400 and "already open" in r.json()["error"]["message"]
    for field, value in (("timeout", 30), ("streaming", True)):  # not supported yet: refused, not ignored
        r = post(live_server, "/open_session", {field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert post(live_server, "/close_session", {"session_id": sid}).status_code == 200
    r = post(live_server, "/close_session", {"session_id": sid})
    assert r.status_code == 400 and "no open session" in r.json()["error"]["message"]
