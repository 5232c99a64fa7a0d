"""The host side of a GPU step without stalls (workers/device_upload.py and its users): uploads
keep values and dtypes (and on a CPU share the array's memory, as before), and a structured
output's packed token bitmask unpacked on the device blocks exactly what the host unpacking
blocks (vocabularies past and short of the mask's words, every row or some)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.device_upload import upload, upload_into
from workers.sampler import _apply_bitmask_on_device, apply_token_bitmask

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_uploads_keep_values_and_dtypes():
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    got = upload(array, DEVICE)
    assert got.dtype == torch.int32 and got.shape == (3, 4) and got.cpu().tolist() == array.tolist()
    if DEVICE.type == "cpu":
        assert np.shares_memory(got.numpy(), array)  # no copy on a CPU, as before
    target = torch.zeros(6, dtype=torch.float32, device=DEVICE)
    upload_into(target[1:5], np.array([1.5, 2.5, 3.5, 4.5], np.float32))
    assert target.cpu().tolist() == [0.0, 1.5, 2.5, 3.5, 4.5, 0.0]


@pytest.mark.parametrize("vocab,words,rows", [(70, 3, [0, 1, 2]), (100, 3, [2, 0]), (64, 2, [1])],
                         ids=["vocab-past-the-words", "mask-past-the-vocab", "one-row"])
def test_bitmask_unpacked_on_the_device_blocks_what_the_host_blocks(vocab, words, rows):
    rng = np.random.default_rng(vocab)
    bitmask = rng.integers(-2**31, 2**31, (len(rows), words), dtype=np.int64).astype(np.int32)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    on_host, on_device = logits.clone(), logits.clone().to(DEVICE)
    rows_array = np.asarray(rows, np.int32)
    apply_token_bitmask(on_host, rows_array, bitmask)  # a CPU tensor: the host unpacking
    _apply_bitmask_on_device(on_device, rows_array, bitmask)
    assert torch.equal(on_device.cpu(), on_host)
    blocked = torch.isinf(on_host[rows_array[0]])
    assert blocked.any() and not blocked.all()  # a real mask, not all or nothing
    if vocab > 32 * words:
        assert torch.isinf(on_host[rows_array[0], 32 * words:]).all()  # past the words: never allowed
