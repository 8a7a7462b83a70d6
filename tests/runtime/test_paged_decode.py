"""The CPU paged decode kernel (attention/paged_decode.c) against torch_native's gather path."""

from __future__ import annotations

import pytest
import torch

import lmprog_runtime.attention.paged_decode as pd
import lmprog_runtime.attention.torch_native as tn
from lmprog_runtime.cache.kv_pool import TokenToKVPool
from lmprog_runtime.model_executor.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(not pd.available(), reason="no C compiler for the paged decode kernel")


def _reference(q, k, v, table, rows, seq_lens, scale):
    outs = []
    for b in range(q.shape[0]):
        slots = table[rows[b], :seq_lens[b]]
        keys, values = k[slots].transpose(0, 1), v[slots].transpose(0, 1)  # [KV, S, D]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None], keys, values, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_sdpa_on_ragged_long_contexts(threads):
    torch.manual_seed(0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        B, H, KV, D, slots = 4, 9, 3, 64, 4000
        k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
        table = torch.randint(1, slots, (6, 1600))  # scattered slots: pages in any order
        rows, seq_lens = torch.tensor([5, 1, 3, 2]), torch.tensor([1, 1537, 512, 700])  # 1..4 chunks
        q = torch.randn(B, H, D)
        got = pd.paged_decode(q, k, v, table, rows, seq_lens, D ** -0.5)
        torch.testing.assert_close(got, _reference(q, k, v, table, rows, seq_lens, D ** -0.5),
                                   rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(old)


def _decode_batch(pool_slots, seq_lens, table):
    B = len(seq_lens)
    rows = torch.arange(1, B + 1)
    return ForwardBatch(
        input_ids=torch.zeros(B, dtype=torch.int64), positions=torch.tensor(seq_lens) - 1,
        out_cache_loc=table[rows, torch.tensor(seq_lens) - 1], req_pool_indices=rows,
        seq_lens=torch.tensor(seq_lens), extend_lens=torch.ones(B, dtype=torch.int64), req_to_token=table,
        seq_lens_cpu=list(seq_lens), extend_lens_cpu=[1] * B)


def _scattered_pool(slots: int, rows: int, L: int, KV: int, D: int, dtype=torch.float32):
    """A pool of random K/V and a table whose rows 1.. hold scattered slots (row 0 unused)."""
    pool = TokenToKVPool(slots, L, KV, D, dtype)
    pool.k.normal_(), pool.v.normal_()
    table = torch.zeros(rows, 1024, dtype=torch.int64)
    table[1:] = torch.randperm(slots - 1)[:(rows - 1) * 1024].view(rows - 1, 1024) + 1
    return pool, table


def _kernel_then_gather(backend, fb, q, k, v, check):
    """Layer 1's attention with the kernel allowed, then without (the gather path);
    `check(backend, use_kernel)` after each init_forward_metadata."""
    outs = []
    for use_kernel in (True, False):
        pd.enabled = use_kernel
        try:
            backend.init_forward_metadata(fb)
            check(backend, use_kernel)
            outs.append(backend.forward(q, k, v, 1, fb))
        finally:
            pd.enabled = True
    return outs


def test_backend_decode_equals_the_gather_path():
    torch.manual_seed(1)
    H, KV, D, L = 4, 2, 16, 3
    pool, table = _scattered_pool(8000, 8, L, KV, D)
    fb = _decode_batch(8000, [3, 700, 64, 1000, 1], table)
    q, k, v = torch.randn(5, H, D), torch.randn(5, KV, D), torch.randn(5, KV, D)
    backend = tn.TorchNativeAttnBackend(token_to_kv_pool=pool, num_heads=H, num_kv_heads=KV, head_dim=D)

    def check(backend, use_kernel):
        assert (backend.paged is not None) == use_kernel

    outs = _kernel_then_gather(backend, fb, q, k, v, check)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefix_len", [300, 1100])  # two and five 256-key prefix chunks
def test_kernel_with_shared_prefix_matches_sdpa(threads, prefix_len):
    """Cascade: the first `prefix_len` keys of every request come from one shared slot list."""
    torch.manual_seed(2)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        B, H, KV, D, slots = 5, 9, 3, 64, 6000
        k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
        table = torch.randint(1, slots, (7, 2400))
        prefix = torch.randint(1, slots, (prefix_len,))
        rows = torch.tensor([6, 1, 3, 2, 4])
        table[rows, :prefix_len] = prefix  # the shared prefix, as the radix cache lays it out
        seq_lens = torch.tensor([1, 600, 1, 1030, 300]) + prefix_len  # own tails of 1..2 chunks
        q = torch.randn(B, H, D)
        got = pd.paged_decode(q, k, v, table, rows, seq_lens, D ** -0.5, prefix=prefix)
        torch.testing.assert_close(got, _reference(q, k, v, table, rows, seq_lens, D ** -0.5),
                                   rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [4, 8])
@pytest.mark.parametrize("prefix_len,seq_len", [(0, 256), (300, 310)])
def test_kernel_split_by_kv_head_gives_the_same_bits(threads, prefix_len, seq_len):
    """Fewer chunks than threads: a task per (kv head, chunk), reading its own values only,
    instead of one per chunk for every kv head; the parts see the same tiles in the same order,
    so the output is bitwise the one-thread call's (every kv head in one task)."""
    torch.manual_seed(9)
    H, KV, D, slots = 9, 3, 128, 2000  # D 128: parallel work from 256 keys on
    k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
    table, rows = torch.randint(1, slots, (2, 400)), torch.tensor([1])
    prefix = table[1, :prefix_len].clone() if prefix_len else None
    lens, q = torch.tensor([seq_len]), torch.randn(1, H, D)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pd.paged_decode(q, k, v, table, rows, lens, D ** -0.5, prefix=prefix)
        torch.set_num_threads(threads)
        split = pd.paged_decode(q, k, v, table, rows, lens, D ** -0.5, prefix=prefix)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(split, one)
    torch.testing.assert_close(one, _reference(q, k, v, table, rows, lens, D ** -0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("B", [3, 90])
@pytest.mark.parametrize("prefix_len", [0, 40])
def test_parts_merge_to_the_one_thread_calls_bits(B, prefix_len):
    """Contexts over several chunks (and a shared prefix's parts), many requests: the parts the
    threads' tasks write merge to the bits of the one-thread call."""
    torch.manual_seed(B + prefix_len)
    H, KV, D, slots = 9, 3, 64, 4096
    k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
    table, rows = torch.randint(1, slots, (B + 1, 2 * pd.CHUNK + 60)), torch.arange(1, B + 1)
    if prefix_len:
        table[2:, :prefix_len] = table[1, :prefix_len]
    prefix = table[1, :prefix_len].clone() if prefix_len else None
    lens = torch.randint(prefix_len + 1, 2 * pd.CHUNK + 60, (B,))
    lens[0] = 2 * pd.CHUNK + 50  # three chunks
    q = torch.randn(B, H, D)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pd.paged_decode(q, k, v, table, rows, lens, D ** -0.5, prefix=prefix)
        torch.set_num_threads(2)
        two = pd.paged_decode(q, k, v, table, rows, lens, D ** -0.5, prefix=prefix)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(two, one)
    torch.testing.assert_close(one, _reference(q, k, v, table, rows, lens, D ** -0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_requests_rows_share_one_pass_whatever_the_batch(kv_dtype):
    """Query rows go three at a time (each key and value row read once for the three): with 3
    heads a kv head (SmolLM2) a request's rows are one pass under a shared prefix whatever its
    batch-mates, so each request gets the bits of its call alone. (With 2 heads a kv head a
    request's rows can straddle two passes, and the build's -fassociative-math lets the compiler
    round a 2-row pass and a 3-row pass differently in the last bits.)"""
    torch.manual_seed(10)
    B, H, KV, D, slots, P = 3, 9, 3, 64, 3000, 200
    k, v = torch.randn(slots, KV, D).to(kv_dtype), torch.randn(slots, KV, D).to(kv_dtype)
    table = torch.randint(1, slots, (B, 600))
    prefix = table[0, :P].clone()
    table[:, :P] = prefix
    lens, q = torch.tensor([P + 37, P + 301, P + 1]), torch.randn(B, H, D)
    rows = torch.arange(B)
    together = pd.paged_decode(q, k, v, table, rows, lens, D ** -0.5, prefix=prefix)
    for b in range(B):
        alone = pd.paged_decode(q[b:b + 1], k, v, table, rows[b:b + 1], lens[b:b + 1], D ** -0.5, prefix=prefix)
        assert torch.equal(together[b:b + 1], alone), b


def test_backend_cascade_decode_uses_the_kernel_and_equals_the_gather_path():
    torch.manual_seed(3)
    H, KV, D, L, shared = 4, 2, 16, 3, 700
    pool, table = _scattered_pool(8000, 8, L, KV, D)
    table[2:7, :shared] = table[1, :shared]  # requests 1..6 share a 700-slot prefix
    fb = _decode_batch(8000, [701, 900, 760, 1000, 705, 720], table)
    q, k, v = torch.randn(6, H, D), torch.randn(6, KV, D), torch.randn(6, KV, D)
    backend = tn.TorchNativeAttnBackend(token_to_kv_pool=pool, num_heads=H, num_kv_heads=KV, head_dim=D)

    def check(backend, use_kernel):
        assert backend.shared == shared and (backend.paged is not None) == use_kernel

    outs = _kernel_then_gather(backend, fb, q, k, v, check)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


def _verify_batch(seq_lens, extend_lens, table, trees=None):
    B = len(seq_lens)
    rows = torch.arange(1, B + 1)
    pos = torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, extend_lens)])
    owner = torch.cat([torch.full((e,), r, dtype=torch.int64) for r, e in zip(rows.tolist(), extend_lens)])
    return ForwardBatch(
        input_ids=torch.zeros(len(pos), dtype=torch.int64), positions=pos, out_cache_loc=table[owner, pos],
        req_pool_indices=rows, seq_lens=torch.tensor(seq_lens), extend_lens=torch.tensor(extend_lens),
        req_to_token=table, seq_lens_cpu=list(seq_lens), extend_lens_cpu=list(extend_lens), tree_masks=trees)


@pytest.mark.parametrize("seq_lens,extend_lens", [
    ([900], [8]),  # batch 1: the cached context is the prefix the chain's rows share
    ([1], [1]),
    ([5, 700, 64, 1000], [5, 8, 1, 3]),  # ragged chains beside a one-token decode
    ([720, 730, 740, 750, 760], [4, 4, 2, 6, 8]),  # a shared 700-slot document (cascade)
])
def test_backend_draft_chains_use_the_kernel_and_equal_the_gather_path(seq_lens, extend_lens):
    """Verify steps of chain drafts (speculative decoding, topk 1): every drafted token is a
    kernel row whose context ends at its own position, the same attention as the masked gather."""
    torch.manual_seed(4)
    H, KV, D, L = 4, 2, 16, 3
    pool, table = _scattered_pool(8000, 8, L, KV, D)
    if len(seq_lens) == 5:
        table[2:6, :700] = table[1, :700]
    fb = _verify_batch(seq_lens, extend_lens, table)
    T = sum(extend_lens)
    q, k, v = torch.randn(T, H, D), torch.randn(T, KV, D), torch.randn(T, KV, D)
    backend = tn.TorchNativeAttnBackend(token_to_kv_pool=pool, num_heads=H, num_kv_heads=KV, head_dim=D)

    def check(backend, use_kernel):
        assert (backend.decode_only or backend.paged is not None) == use_kernel
        if use_kernel and not backend.decode_only:
            # one plan takes every row in order, one-token decodes beside chains included, so
            # the fused layer path (decode_attend) runs the whole step
            assert backend.ones is None and backend.all_short
            assert backend.decode_attend(q.float().contiguous(), torch.empty(T, H, D)) is not None

    outs = _kernel_then_gather(backend, fb, q, k, v, check)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("s", [1300, pd.CHUNK + 4, 40])
def test_chain_verify_rows_are_bitwise_the_decodes_at_their_positions(threads, s):
    """A verify row computes what a one-token decode at its position computes, bit for bit (the
    same chunks of the same context): speculative greedy outputs stay token-identical even where
    int8 activations turn rounding differences into whole steps. s = CHUNK + 4: the rows' contexts
    end on both sides of the first chunk boundary (one part, normalized in place, against two,
    merged); 40: a context within one tile. The fused layer's one call per layer
    (`decode_attend`, every request a chain) gives the same rows as `forward`."""
    torch.manual_seed(6)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        H, KV, D, L, e = 9, 3, 64, 2, 8
        assert s != pd.CHUNK + 4 or pd.CHUNK in range(s - e + 1, s), "the chain crosses a chunk boundary"
        pool = TokenToKVPool(4000, L, KV, D, torch.float32)
        pool.k.normal_(), pool.v.normal_()
        table = torch.zeros(2, 2048, dtype=torch.int64)
        table[1] = torch.randperm(3999)[:2048] + 1
        q = torch.randn(e, H, D)
        backend = tn.TorchNativeAttnBackend(token_to_kv_pool=pool, num_heads=H, num_kv_heads=KV, head_dim=D)
        backend.init_forward_metadata(_verify_batch([s], [e], table))
        assert backend.paged is not None
        chain = backend.forward(q, None, None, 1, _verify_batch([s], [e], table), save_kv_cache=False)
        out = torch.empty(e, H, D)
        backend.decode_attend(q, out)(1)
        assert torch.equal(out.view(e, H * D), chain)
        for j in range(e):
            fb = _decode_batch(4000, [s - e + 1 + j], table)
            backend.init_forward_metadata(fb)
            assert backend.decode_only
            one = backend.forward(q[j:j + 1], None, None, 1, fb, save_kv_cache=False)
            assert torch.equal(chain[j:j + 1], one), j
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_chain_groups_are_bitwise_each_row_alone(threads):
    """Rows of a verify chain (one table row, contexts ending at consecutive positions) are
    attended in groups that read each tile once for all of them (long chains cut into several
    groups where the threads would have too few tasks); every row gets the bits it gets as a
    one-row call, beside other chains and one-token decodes, and past 64 rows (the groups'
    array allocated)."""
    torch.manual_seed(11)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        H, KV, D = 9, 3, 64
        k, v = torch.randn(6000, KV, D), torch.randn(6000, KV, D)
        table = torch.stack([torch.randperm(5999)[:3000] + 1 for _ in range(4)])
        # (table row, chain length, last context length): chains crossing chunk boundaries
        chains = [(0, 8, pd.CHUNK + 3), (1, 1, 700), (2, 5, 40), (3, 70, 2 * pd.CHUNK + 30), (0, 3, 1500)]
        rows, lens = [], []
        for r, e, s in chains:
            rows += [r] * e
            lens += range(s - e + 1, s + 1)
        rows, lens = torch.tensor(rows), torch.tensor(lens)
        q = torch.randn(len(rows), H, D)
        out = pd.paged_decode(q, k, v, table, rows, lens, D ** -0.5)
        for i in range(len(rows)):
            one = pd.paged_decode(q[i:i + 1], k, v, table, rows[i:i + 1], lens[i:i + 1], D ** -0.5)
            assert torch.equal(out[i:i + 1], one), i
    finally:
        torch.set_num_threads(old)


def test_backend_draft_trees_keep_the_gather_path():
    torch.manual_seed(5)
    H, KV, D, L = 4, 2, 16, 2
    pool, table = _scattered_pool(4000, 4, L, KV, D)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two siblings
    fb = _verify_batch([300, 200], [3, 3], table, trees=[tree, None])
    backend = tn.TorchNativeAttnBackend(token_to_kv_pool=pool, num_heads=H, num_kv_heads=KV, head_dim=D)
    backend.init_forward_metadata(fb)
    assert backend.paged is None


def test_kernel_reads_bfloat16_kv_exactly_widened():
    """bf16 K/V: the same answer as the float32 kernel on the same values widened."""
    torch.manual_seed(4)
    B, H, KV, D, slots = 3, 9, 3, 64, 3000
    k, v = torch.randn(slots, KV, D).bfloat16(), torch.randn(slots, KV, D).bfloat16()
    table = torch.randint(1, slots, (4, 1200))
    rows, seq_lens, q = torch.tensor([3, 1, 2]), torch.tensor([1, 1100, 513]), torch.randn(B, H, D)
    got = pd.paged_decode(q, k, v, table, rows, seq_lens, D ** -0.5)
    assert torch.equal(got, pd.paged_decode(q, k.float(), v.float(), table, rows, seq_lens, D ** -0.5))
    torch.testing.assert_close(got, _reference(q, k.float(), v.float(), table, rows, seq_lens, D ** -0.5),
                               rtol=1e-4, atol=1e-5)


def test_backend_bfloat16_decode_uses_the_kernel_close_to_the_gather_path():
    torch.manual_seed(5)
    H, KV, D, L = 4, 2, 16, 3
    pool, table = _scattered_pool(8000, 8, L, KV, D, torch.bfloat16)
    fb = _decode_batch(8000, [3, 700, 64, 1000, 1], table)
    q, k, v = (torch.randn(5, n, D).bfloat16() for n in (H, KV, KV))
    backend = tn.TorchNativeAttnBackend(token_to_kv_pool=pool, num_heads=H, num_kv_heads=KV, head_dim=D)

    def check(backend, use_kernel):
        assert (backend.paged is not None) == use_kernel

    outs = [o.float() for o in _kernel_then_gather(backend, fb, q, k, v, check)]
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)  # the gather path's SDPA runs in bf16


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("D", [16, 20, 40, 64, 96, 128])  # every inner-loop width: 64-, 32-, 8-float vectors, scalar
@pytest.mark.parametrize("B,seq_lens", [
    (1, [7]),  # tiny: one task, one thread, no merge pass
    (3, [1, 5, 130]),  # small: under SERIAL_WORK, one part per (request, head)
    (8, [512, 300, 1, 77, 511, 4, 260, 420]),  # above SERIAL_WORK, still one part each: parallel, no merge
    (2, [513, 1030]),  # several parts: the merge pass
    (1, [256]),  # one chunk, parallel at D 128 (work 3072): fewer chunks than threads, a task per kv head
])
def test_kernel_paths_match_sdpa_for_every_head_size(threads, D, B, seq_lens):
    """The one-thread path for small work, the final-part path (no merge), the parallel region,
    and the q.k / p.v loops for head sizes that take each vector width (and none)."""
    torch.manual_seed(D * 31 + B)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        H, KV, slots = 6, 2, 5000
        k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
        table = torch.randint(1, slots, (B + 1, 1100))
        rows, lens, q = torch.randperm(B + 1)[:B], torch.tensor(seq_lens), torch.randn(B, H, D) * 2
        got = pd.paged_decode(q, k, v, table, rows, lens, D ** -0.5)
        torch.testing.assert_close(got, _reference(q, k, v, table, rows, lens, D ** -0.5), rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_small_cascade_on_one_thread_matches_sdpa(threads):
    """A short shared prefix over a few requests (under SERIAL_WORK: no parallel region) still
    reads the prefix once and merges exactly."""
    torch.manual_seed(6)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        B, H, KV, D, slots, P = 3, 9, 3, 64, 600, 20
        k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
        table = torch.randint(1, slots, (4, 64))
        prefix, rows = torch.randint(1, slots, (P,)), torch.tensor([3, 0, 2])
        table[rows, :P] = prefix
        seq_lens = torch.tensor([1, 9, 40]) + P
        q = torch.randn(B, H, D)
        got = pd.paged_decode(q, k, v, table, rows, seq_lens, D ** -0.5, prefix=prefix)
        torch.testing.assert_close(got, _reference(q, k, v, table, rows, seq_lens, D ** -0.5), rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_concurrent_callers_share_the_worker_pool_and_agree_bitwise():
    """Calls from several threads at once (one holds the kernel's worker pool, the others run on
    their own thread) give what one thread gives, bit for bit (each part and the merge order are
    fixed whoever runs them), and none hangs."""
    import threading

    torch.manual_seed(7)
    B, H, KV, D, slots, P = 8, 9, 3, 64, 9000, 700
    k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
    table = torch.randint(1, slots, (9, 1400))
    prefix, rows = torch.randint(1, slots, (P,)), torch.arange(1, 9)
    table[rows, :P] = prefix
    seq_lens = torch.tensor([1, 50, 300, 520, 700, 9, 100, 600]) + P
    q = torch.randn(B, H, D)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = pd.paged_decode(q, k, v, table, rows, seq_lens, D ** -0.5, prefix=prefix)
    finally:
        torch.set_num_threads(old)
    bad = []

    def loop(i):
        out = torch.empty_like(q)
        own = pd.PagedDecodePlan(table, rows, seq_lens, D ** -0.5, H, KV, D, False, prefix)  # own scratch
        for n in range(20):
            args = list(own.c_args(q, k, v, out))
            args[16] = 2  # nthreads
            pd._KERNEL.lib().lm_paged_decode(*args)
            if not torch.equal(out, want):
                bad.append((i, n))

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not bad, bad


def test_attention_and_matmuls_share_one_worker_pool_from_many_threads():
    """The kernel runs its parallel calls on qdot.c's pool (one set of workers for a step's
    matmuls and attention); attention and int4 matmul calls from several threads at once give
    what one thread gives, bit for bit, and none hangs."""
    import threading

    from lmprog_runtime.model_executor import qgemm

    if not qgemm.dot_available():
        pytest.skip("qdot.c not built here")
    assert pd._KERNEL.lib().lm_paged_decode_shares_pool() == 1
    torch.manual_seed(8)
    B, H, KV, D, slots = 4, 9, 3, 64, 4000
    k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
    table, rows = torch.randint(1, slots, (5, 1500)), torch.arange(1, 5)
    seq_lens, q = torch.tensor([1500, 700, 300, 1100]), torch.randn(B, H, D)
    w = torch.randint(0, 16, (3072, 576), dtype=torch.int32)
    packed, sm = qgemm.pack_q4_f16(w, torch.rand(3072, 18) * 0.01 + 1e-3, torch.rand(3072, 18))
    x = torch.randn(3, 576)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want_attn = pd.paged_decode(q, k, v, table, rows, seq_lens, D ** -0.5)
        want_mm = qgemm.dot_matmul("int4", x, packed, sm)
    finally:
        torch.set_num_threads(old)
    bad = []

    def attend(i):
        out = torch.empty_like(q)
        own = pd.PagedDecodePlan(table, rows, seq_lens, D ** -0.5, H, KV, D, False)
        for n in range(20):
            args = list(own.c_args(q, k, v, out))
            args[16] = 2  # nthreads
            pd._KERNEL.lib().lm_paged_decode(*args)
            if not torch.equal(out, want_attn):
                bad.append(("attention", i, n))

    def matmul(i):
        for n in range(20):
            y = torch.empty(3, 3072)
            qgemm.dot_fn("int4")(x.data_ptr(), 3, 576, packed.data_ptr(), sm.data_ptr(), 3072, y.data_ptr(), 2)
            if not torch.equal(y, want_mm):
                bad.append(("matmul", i, n))

    threads = [threading.Thread(target=f, args=(i,)) for i in range(2) for f in (attend, matmul)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not bad, bad


@pytest.mark.parametrize("flags", [pytest.param(("-mno-avx512f",), marks=pytest.mark.slow),
                                   ("-mno-avx512f", "-mno-avx2", "-mno-avx", "-mno-fma")])
def test_narrower_vector_builds_match_sdpa(flags, monkeypatch):
    """The kernel built for narrower vectors than this machine's (8-float vectors: a ymm with
    AVX2, two xmm without AVX) against SDPA: every head size's loop, cascade and merges. (The
    AVX2 build is `slow`: an AVX2-only machine's own build is it, and each build is ~10 s of
    a fresh clone's suite; the build without AVX stays.)"""
    from lmprog_runtime import native

    kernel = native.Kernel(pd._SOURCE, native.NATIVE_FLAGS + flags, True, pd._declare)
    if kernel.lib() is None:
        pytest.skip("the compiler refused " + " ".join(flags))
    monkeypatch.setattr(pd, "_KERNEL", kernel)
    torch.manual_seed(8)
    for D in (20, 40, 64, 96):
        H, KV, slots, P = 6, 2, 4000, 300
        k, v = torch.randn(slots, KV, D), torch.randn(slots, KV, D)
        table = torch.randint(1, slots, (5, 1400))
        prefix, rows = torch.randint(1, slots, (P,)), torch.tensor([4, 1, 3])
        table[rows, :P] = prefix
        seq_lens, q = torch.tensor([1, 700, 1100]) + P, torch.randn(3, H, D)
        for pre in (None, prefix):
            got = pd.paged_decode(q, k, v, table, rows, seq_lens, D ** -0.5, prefix=pre)
            torch.testing.assert_close(got, _reference(q, k, v, table, rows, seq_lens, D ** -0.5),
                                       rtol=1e-4, atol=1e-5)
