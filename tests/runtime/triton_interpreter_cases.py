"""The Triton kernels on the CPU, in Triton's interpreter, against `torch_native`.

Shapes stay tiny (the interpreter runs every program in Python) but cover: ragged
batches of several requests, cached prefix + extend, mixed extend/decode, GQA and MHA,
a head_dim that is not a power of two, page sizes 1 and 16 with scattered pages, split-K
decode with empty splits, fp32/fp16/bf16; and the grammar-bitmask kernel.

Not collected by the default suite: `test_triton_attention.py` runs this file in its own
pytest process with TRITON_INTERPRET=1 (the interpreter must be on before triton is
imported, and must not be on for the rest of the suite).
"""

import os

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_attention.py (needs TRITON_INTERPRET=1 before triton loads)",
                allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.0')")

from lmprog_runtime.attention import create_attention_backend  # noqa: E402
from lmprog_runtime.attention.triton import TritonTuning  # noqa: E402
from lmprog_runtime.cache.kv_pool import TokenToKVPool  # noqa: E402
from paged_attention_cases import compare_to_torch_native  # noqa: E402

# tiny tiles so small shapes still take several query blocks, KV blocks and splits
TINY = TritonTuning(block_m=16, block_n=16, max_kv_splits=4, min_split_len=16)
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def run_both(prefix_lens, extend_lens, heads, kv_heads, head_dim, dtype, page_size, seed=0, min_splits=1):
    def check(backend):
        if backend.decode:
            assert backend.num_splits >= min_splits, backend.num_splits

    return compare_to_torch_native("triton", prefix_lens, extend_lens, heads, kv_heads, head_dim, dtype,
                                   page_size, seed, check=check, tuning=TINY)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_prefix_ragged_gqa(page_size):
    # fresh prefill, short append to a prefix, long append spanning 2 query / 3 KV blocks
    diff = run_both([0, 7, 20], [5, 3, 17], heads=4, kv_heads=2, head_dim=16,
                    dtype=torch.float32, page_size=page_size)
    assert diff < TOL[torch.float32]


def test_mixed_extend_and_decode_mha_odd_head_dim():
    diff = run_both([0, 9, 30], [6, 1, 1], heads=2, kv_heads=2, head_dim=24,
                    dtype=torch.float32, page_size=1, seed=1)
    assert diff < TOL[torch.float32]


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_split_k_gqa(page_size):
    # group 4; 2 splits: lengths 1 (split 1 empty), 5, 33 and 70 (two of 35)
    diff = run_both([0, 4, 32, 69], [1, 1, 1, 1], heads=8, kv_heads=2, head_dim=16,
                    dtype=torch.float32, page_size=page_size, seed=2, min_splits=2)
    assert diff < TOL[torch.float32]


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_verify_batch(page_size):
    """A verify step's shapes: each request adds its last token + k drafts (2..12 tokens)
    over a cached prefix, beside plain one-token decodes."""
    diff = run_both([5, 30, 17, 40, 9], [12, 1, 4, 2, 1], heads=4, kv_heads=2, head_dim=16,
                    dtype=torch.float32, page_size=page_size, seed=6)
    assert diff < TOL[torch.float32]


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_tree_verify_batch(page_size):
    """Draft trees: requests whose new tokens attend through a tree mask (the verified token,
    then drafts that see only their ancestors), beside a causal chain verify and a decode."""
    from lmprog_runtime.speculative.tree import extend_mask
    trees = [extend_mask([-1, -1, 0, 0, 2, 1, 5, -1, 3, 8, 4], lead=1), None,
             extend_mask([-1, 0, -1], lead=1), None]
    diff = compare_to_torch_native("triton", [5, 30, 17, 40], [12, 3, 4, 1], heads=4, kv_heads=2,
                                   head_dim=16, dtype=torch.float32, page_size=page_size, seed=7,
                                   tuning=TINY, tree_masks=trees)
    assert diff < TOL[torch.float32]


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_engine_through_triton(tiny_model_path, tree):
    """NGRAM speculation (chains, and trees) on the triton backend gives torch_native's plain
    greedy tokens."""
    from lmprog_runtime import Engine

    prompts = ["1 2 3 4 1 2 3 4 1 2", "The cat sat on the mat. The cat sat on the"]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outs = {}
    spec = dict(attention_backend="triton", speculative_algorithm="NGRAM", speculative_disable_cost_rule=True)
    if tree:
        spec.update(speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    for name, kw in (("plain", dict(attention_backend="torch_native")), ("spec", spec)):
        eng = Engine(model_path=tiny_model_path, dtype="float32", max_total_tokens=1024, **kw)
        try:
            outs[name] = [o["output_ids"] for o in eng.generate(prompts, params)]
            if name == "spec":
                assert eng.get_internal_state()["spec_num_verify"] > 0
            eng.check_integrity()
        finally:
            eng.shutdown()
    assert outs["spec"] == outs["plain"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    d_ext = run_both([3, 0], [9, 4], heads=4, kv_heads=1, head_dim=16, dtype=dtype, page_size=16, seed=3)
    d_dec = run_both([40, 8], [1, 1], heads=4, kv_heads=1, head_dim=16, dtype=dtype, page_size=1, seed=4)
    assert max(d_ext, d_dec) < TOL[dtype]


def test_split_count_policy():
    pool = TokenToKVPool(64, 1, 2, 16, torch.float32)
    tri = create_attention_backend("triton", token_to_kv_pool=pool, num_heads=4, num_kv_heads=2, head_dim=16)
    assert tri._num_kv_splits(batch=1, max_len=100) == 1  # short context: no split
    assert tri._num_kv_splits(batch=1, max_len=8192) == 8  # 2 x 8 "SMs" / (1 x 2 kv heads)
    assert tri._num_kv_splits(batch=64, max_len=8192) == 1  # the batch fills the GPU already


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("lmprog_runtime.attention.triton.TRITON_INTERPRET", False)  # config reads it at import
    pool = TokenToKVPool(16, 1, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA device.*torch_native"):
        create_attention_backend("triton", token_to_kv_pool=pool, num_heads=1, num_kv_heads=1, head_dim=16)


def test_grammar_bitmask_kernel_matches_masked_fill():
    from lmprog_runtime.constrained.bitmask_kernel import apply_token_bitmask_, pack_token_bitmask

    g = torch.Generator().manual_seed(5)
    vocab = 1000 + 37  # two blocks, a partial last word
    logits = torch.randn(3, vocab + 8, generator=g)[:, :vocab]  # a strided view, as in the sampler
    mask = torch.rand(3, vocab, generator=g) < 0.3
    mask[1] = True
    mask[2, :] = False
    mask[2, [0, 31, 32, 1036]] = True  # word edges, incl. bit 31 (the int32 sign bit)
    expected = logits.clone().masked_fill_(~mask, float("-inf"))
    bitmask = pack_token_bitmask(mask)
    assert bitmask.shape == (3, 33) and bitmask.dtype == torch.int32
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="int32 bitmask of shape"):
        apply_token_bitmask_(logits, bitmask[:, :5])


def test_maskbuilders_bitmask_through_the_kernel_is_the_bool_mask():
    """MaskBuilder's rows (np.packbits little-endian, viewed as int32: the layout the grammars
    write) are pack_token_bitmask's; fitted to the logits' width (fit_words: the sampler's
    CUDA path) the kernel bans exactly what a bool mask of that width bans (columns past it
    too)."""
    import numpy as np

    from lmprog_runtime.constrained.bitmask import fit_words
    from lmprog_runtime.constrained.bitmask_kernel import apply_token_bitmask_, pack_token_bitmask

    g = torch.Generator().manual_seed(6)
    vocab = 1000 + 37
    for width in (vocab, vocab - 70, vocab + 70):
        mask = torch.rand(3, width, generator=g) < 0.3
        mask[0, [0, 31, 32, width - 1]] = True
        bits = np.zeros((3, -(-width // 32) * 32), dtype=np.bool_)
        bits[:, :width] = mask.numpy()
        words = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())
        assert torch.equal(words, pack_token_bitmask(mask))
        logits = torch.randn(3, vocab + 8, generator=g)[:, :vocab]
        allowed = torch.zeros(3, vocab, dtype=torch.bool)
        allowed[:, :min(width, vocab)] = mask[:, :vocab]
        expected = logits.clone().masked_fill_(~allowed, float("-inf"))
        apply_token_bitmask_(logits, fit_words(words, vocab))
        assert torch.equal(logits, expected)


def test_tiny_model_through_triton_matches_transformers(tiny_model_path):
    """The whole model with the triton backend (default tiles): prefills, a cached-prefix extend
    mixed with decodes, and decodes, every logits row against transformers."""
    from test_model import check_ragged_batches, tiny_runner
    from transformers import LlamaForCausalLM

    runner = tiny_runner(tiny_model_path, attention_backend="triton")
    assert type(runner.attn_backend).__name__ == "TritonAttnBackend"
    hf = LlamaForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    check_ragged_batches(runner, hf, runner.model_config.vocab_size)


def test_default_attention_backend_per_device():
    from lmprog_runtime.model_executor.runner import default_attention_backend

    assert default_attention_backend(torch.device("cpu")) == "torch_native"
    assert default_attention_backend(torch.device("cuda")) == "triton"
