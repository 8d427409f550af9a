"""Work of the Mosaic TPU kernels, computed from their grids and BlockSpec index maps.

The Mosaic pipeline copies a block into VMEM when the block index of a grid step differs from
the previous step's, so walking the index map over the grid in order counts the DMAs: the
paged-decode kernel must copy only a sequence's live pages, the block-sparse forward only a
query group's used blocks.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import block_sparse_tpu, paged_decode_tpu
from agentrl_jax.kernels.block_sparse_xla import compact_selection, normalize_block_indices


def _copies(indices):
    """Copies of a block walked in grid order: the first, then every change."""
    return 1 + sum(a != b for a, b in zip(indices, indices[1:]))


@pytest.mark.parametrize("window,ppb", [(None, 1), (None, 2), (6, 1), (13, 3)])
def test_paged_decode_copies_only_live_pages(window, ppb):
    page, max_pages, num_pages = 4, 6, 40
    lengths = np.array([1, 8, 13, 24, 0, 17], np.int32)
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_pages)[: len(lengths) * max_pages].reshape(-1, max_pages)
    tables = tables.astype(np.int32)
    visible = paged_decode_tpu._visible_pages(max_pages, page, window)
    steps = -(-visible // ppb)
    index = functools.partial(
        paged_decode_tpu._page_index,
        page_size=page,
        window=window,
        max_pages=max_pages,
        num_pages=num_pages,
    )
    flat = jnp.asarray(tables.reshape(-1))
    for b, length in enumerate(lengths):
        first = 0 if window is None else max(int(length) - window, 0)
        live = set(tables[b, first // page : -(-int(length) // page)].tolist())
        copied = set()
        n_copies = 0
        for j in range(ppb):  # each of the ppb page BlockSpecs walks its own slots
            pages = [int(index(b, s * ppb + j, lengths, flat)) for s in range(steps)]
            n_copies += _copies(pages)
            copied |= set(pages)
        if live:
            assert copied == live
            assert n_copies <= len(live) + ppb - 1  # each spec may re-copy one boundary page
        else:  # an empty sequence fetches one page per spec, never read
            assert n_copies == ppb


@pytest.mark.parametrize("qb,bs", [(1, 4), (2, 4), (4, 1)])
def test_block_sparse_copies_only_used_blocks(qb, bs):
    b, t, kh, n_sel = 1, 16, 2, 4
    rng = np.random.default_rng(qb + bs)
    nblk = -(-t // bs)
    raw = rng.integers(-1, nblk + 2, (b, t, kh, n_sel)).astype(np.int32)
    raw = np.repeat(raw[:, ::qb], qb, axis=1)[:, :t]
    select = jax.jit(
        lambda r: compact_selection(normalize_block_indices(r, nblk).transpose(0, 2, 1, 3), bs, qb)
    )
    blocks, counts = select(jnp.asarray(raw[:, ::qb]))
    counts = np.asarray(counts)
    groups = blocks.shape[2]
    flat = np.asarray(blocks).reshape(-1)
    index = functools.partial(
        block_sparse_tpu.kv_block_index, kv_heads=kh, groups=groups, n_sel=n_sel
    )
    for n in range(kh):
        for i in range(groups):
            got = [int(index(0, n, i, sl, flat, None)[2]) for sl in range(n_sel)]
            row = raw[0, i * qb, n]
            used = {
                int(x) for x in row if 0 <= x < nblk and x * bs <= i * qb + qb - 1
            }  # from scratch
            assert int(counts[0, n, i, 0]) == len(used)
            if used:
                assert set(got) == used and _copies(got) == len(used)
            else:
                assert _copies(got) == 1  # block 0 fetched, never read
