"""Every GPU attention backend against `torch_native` on the same GPU, kernel by kernel, and the
grammar-bitmask kernel and GPU sampler against the CPU path. Skipped without CUDA."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from paged_attention_cases import compare_to_torch_native  # noqa: E402

TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (prefix_lens, extend_lens): ragged prefills, appends over long prefixes, mixed, short and long decodes
CASES = {
    "prefill": ([0, 0, 0], [1, 37, 300]),
    "prefix_extend": ([16, 100, 1000], [5, 64, 129]),
    "mixed": ([0, 50, 700, 2], [40, 1, 1, 1]),
    "decode_short": ([0, 5, 31, 64], [1, 1, 1, 1]),
    "decode_long": ([4000, 1500, 8191, 17], [1, 1, 1, 1]),
}
HEADS = {"llama_gqa4_d128": (32, 8, 128), "mha_d64": (8, 8, 64), "qwen_gqa7_d64": (14, 2, 64),
         "gqa4_d96": (4, 1, 96)}


def needs(backend):
    pytest.importorskip(backend, reason=f"{backend} is not installed")


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_torch_native(backend, dtype, page_size, case):
    needs(backend)
    heads, kv_heads, head_dim = HEADS["llama_gqa4_d128"]
    diff = compare_to_torch_native(backend, *CASES[case], heads, kv_heads, head_dim, dtype, page_size,
                                   device="cuda")
    assert diff < TOL[dtype]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("heads", ["mha_d64", "qwen_gqa7_d64", "gqa4_d96"])
@pytest.mark.parametrize("case", ["mixed", "decode_long"])
def test_head_layouts(backend, heads, case):
    needs(backend)
    if backend == "flashinfer" and heads == "gqa4_d96":
        pytest.skip("flashinfer builds head_dim 64/128/256 only")
    diff = compare_to_torch_native(backend, *CASES[case], *HEADS[heads], torch.bfloat16, 16, device="cuda")
    assert diff < TOL[torch.bfloat16]


@pytest.mark.parametrize("case", ["prefix_extend", "mixed", "decode_long"])
def test_triton_fp32(case):
    needs("triton")
    diff = compare_to_torch_native("triton", *CASES[case], 32, 8, 128, torch.float32, 1, device="cuda")
    assert diff < TOL[torch.float32]


def test_triton_split_k_is_used_for_long_decodes():
    needs("triton")

    def check(backend):
        assert backend.num_splits > 1, backend.num_splits

    diff = compare_to_torch_native("triton", [8000], [1], 32, 8, 128, torch.bfloat16, 16, device="cuda",
                                   check=check)
    assert diff < TOL[torch.bfloat16]


@pytest.mark.parametrize("vocab", [49152, 151936 + 5])
def test_grammar_bitmask_kernel_matches_masked_fill(vocab):
    needs("triton")
    from lmprog_runtime.constrained.bitmask_kernel import apply_token_bitmask_, pack_token_bitmask

    g = torch.Generator().manual_seed(0)
    mask = torch.rand(7, vocab, generator=g) < 0.1
    mask[0] = True
    logits = torch.randn(7, vocab, generator=g)
    expected = logits.clone().masked_fill_(~mask, float("-inf"))
    got = apply_token_bitmask_(logits.cuda(), pack_token_bitmask(mask).cuda())
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(pack_token_bitmask(mask.cuda()).cpu(), pack_token_bitmask(mask))


@pytest.mark.parametrize("vocab", [49152, 151936 + 5])
def test_sampler_applies_maskbuilders_bitmask_on_cuda_as_on_the_cpu(vocab):
    """MaskBuilder's int32 bitmask goes to the kernel as it is (no bool rows): the logits the
    CPU path leaves, words past the logits' width ignored and missing ones banned."""
    needs("triton")
    import numpy as np

    from lmprog_runtime.model_executor.sampler import Sampler

    g = torch.Generator().manual_seed(1)
    mask = torch.rand(5, vocab, generator=g) < 0.2
    logits = torch.randn(5, vocab, generator=g)
    for width in (vocab, vocab - 70, vocab + 70):
        bits = np.zeros((5, -(-width // 32) * 32), dtype=np.bool_)
        bits[:, :min(width, vocab)] = mask[:, :width].numpy()
        words = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())
        cpu, gpu = logits.clone(), logits.cuda()
        Sampler._apply_grammar_mask(cpu, words)
        Sampler._apply_grammar_mask(gpu, words)
        assert torch.equal(gpu.cpu(), cpu)
        assert torch.isinf(cpu[:, min(width, vocab):]).all()


def test_gpu_sampler_matches_cpu_sampler():
    """Same logits on CPU and CUDA: the same tokens (greedy and seeded sampling), grammar mask,
    penalties, top-k/top-p/min-p included."""
    from types import SimpleNamespace

    from lmprog_runtime.model_executor.sampler import Sampler
    from lmprog_runtime.sampling_params import SamplingParams

    vocab = 49152
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, frequency_penalty=0.5),
              SamplingParams(temperature=1.0, presence_penalty=1.0)]
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(len(params), vocab, generator=g)
    mask = torch.rand(len(params), vocab, generator=g) < 0.5
    outputs = {}
    for device in ("cpu", "cuda"):
        reqs = [SimpleNamespace(sampling=p, output_ids=[5, 9, 9, 100], generator=torch.Generator().manual_seed(i))
                for i, p in enumerate(params)]
        sampler = Sampler(vocab, eos_token_ids=[2], seed=0)
        outputs[device] = sampler(logits.clone().to(device), reqs, mask, need_logprobs=True)
    assert outputs["cpu"].token_ids == outputs["cuda"].token_ids
    assert all(mask[i, t] for i, t in enumerate(outputs["cuda"].token_ids))
    lp_cpu, lp_gpu = outputs["cpu"].logprobs, outputs["cuda"].logprobs.cpu()
    finite = torch.isfinite(lp_cpu)
    assert torch.equal(finite, torch.isfinite(lp_gpu))
    assert (lp_cpu[finite] - lp_gpu[finite]).abs().max() < 1e-4
