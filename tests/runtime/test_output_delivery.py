"""TokenizerManager.handle_output: one bad output in a BatchOutput fails its own request;
the others in the same batch are still delivered (none waits forever)."""

import asyncio

from lmprog_runtime.messages import AbortReq, BatchOutput, FinishReason, ReqOutput, TokenizedGenerateReq
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.tokenizer_manager import ReqState, TokenizerManager


def test_one_bad_output_fails_only_its_request():
    sent = []
    tm = TokenizerManager(tokenizer=None, vocab_size=100, context_len=64, send=sent.append)

    async def go():
        for rid, lp in (("bad", True), ("good", False)):
            msg = TokenizedGenerateReq(rid=rid, input_ids=[1, 2], sampling_params=SamplingParams(),
                                       return_logprob=lp)
            tm.states[rid] = ReqState(msg)
        bad = ReqOutput(rid="bad", output_offset=0, output_ids=[5], finished_reason=None,
                        prompt_tokens=2, completion_tokens=1, cached_tokens=0,
                        output_token_logprobs=None)  # folding this raises TypeError
        good = ReqOutput(rid="good", output_offset=0, output_ids=[6, 7],
                         finished_reason=FinishReason.length(2), prompt_tokens=2,
                         completion_tokens=2, cached_tokens=0)
        states = dict(tm.states)
        tm.handle_output(BatchOutput([bad, good]))
        return states

    states = asyncio.run(go())
    assert states["good"].output_ids == [6, 7] and states["good"].finished_reason == FinishReason.length(2)
    failed = states["bad"].finished_reason
    assert failed.is_error and failed.status_code == 500 and "TypeError" in failed.message
    assert states["bad"].event.is_set() and not tm.states
    assert sent == [AbortReq(rid="bad")]  # the scheduler stops generating for it
