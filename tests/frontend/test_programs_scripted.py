"""The shared program library against the scripted backend (no model, no server)."""

import pytest

import lmprog as sgl
from programs import EXPRESSION_REGEX, IPV4_REGEX, LIBRARY
from scripted_backend import ScriptedBackend, default_responder


def responder(prompt, params):
    regex = params.get("regex")
    if regex == IPV4_REGEX:
        return "8.8.8.8"
    if regex == EXPRESSION_REGEX:
        return "257 * 983"
    return default_responder(prompt, params)


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_program(name):
    backend = ScriptedBackend(responder=responder, choice_scores={"Finish": -0.1, "False": -0.2})
    LIBRARY[name](backend)


@pytest.mark.parametrize("method", [sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized])
def test_select_methods(method):
    backend = ScriptedBackend(choice_scores={"False": -0.1})
    state = LIBRARY["select"](backend, choices_method=method)
    assert state["answer"] == " False"
