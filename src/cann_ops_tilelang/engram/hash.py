"""``engram_hash``: the multiplicative-XOR n-gram hash of the Engram layer, from token ids to embedding-table
rows (docs/ops/engram.md#hash)."""

from typing import Optional

import torch
from torch import Tensor

from .. import limits
from .._checks import OpError, check_same_device, check_tensor
from .._library import declare
from ._common import check_mask

__all__ = ["engram_hash"]

I32, I64 = torch.int32, torch.int64


# every tensor is read element by element (the output, new and fresh, is stored in vectors)
@declare("engram_hash", tokens="ngram_token_ids", outputs=("output",))
def engram_hash(
    ngram_token_ids: Tensor,
    multipliers: Tensor,
    vocab_sizes: Tensor,
    offsets: Tensor,
    image_token_mask: Optional[Tensor] = None,
) -> Tensor:
    """Embedding-table rows of every n-gram of every token, per Engram layer.

    For layer ``l``, n-gram order ``n = j + 2`` (``j = 0 .. N-2``) and table ``e``, with all arithmetic in
    int64 (products and XOR wrap around as two's complement)::

        h = XOR_{k = 0 .. n-1} int64(ngram_token_ids[t, k]) * multipliers[l, k]
        out[l, t, j * E + e] = int32(floor_mod(h, vocab_sizes[l, j, e]) + offsets[l, j * E + e])

    ``floor_mod`` takes the sign of the table size (Python's and ``torch.remainder``'s ``%``: a negative ``h``
    still gives a row in ``[0, size)``); the final ``int32`` wraps around like torch's int32 addition.
    Tokens with ``image_token_mask`` set get ``-1`` in every column.

    Args:
        ngram_token_ids: ``(T, N)`` int32; column ``k`` holds the token ``k`` positions back (column 0 the
            current token), as the Engram layer builds its n-grams; any int32 values.
        multipliers: ``(L, N)`` int64, per layer one multiplier per n-gram position.
        vocab_sizes: ``(L, N-1, E)`` int32, the table sizes (primes in the Engram layer); must be
            positive (data, not checked: a size below 1 has no defined result).
        offsets: ``(L, (N-1)*E)`` int32, each table's first row (e.g. the exclusive prefix sum of the sizes).
        image_token_mask: None or ``(T,)`` bool.

    Returns:
        ``(L, T, (N-1)*E)`` int32.

    Sizes: ``N >= 2``, ``E >= 1``, ``L >= 1`` and ``L * T * (N-1) * E < 2**31`` (``limits.ENGRAM_HASH_*``;
    on Ascend ``N <= 8``, ``(N-1) * E <= 128``, ``L <= 32``); any ``T >= 0``.
    """
    err = OpError("engram_hash")
    ids = check_tensor(err, "ngram_token_ids", ngram_token_ids, dtype=I32, ndim=2)
    tokens, ngram = ids.shape
    device = ids.device.type
    limits.ENGRAM_HASH_NGRAM.of(device).check(err, "ngram_token_ids", ngram)
    mult = check_tensor(err, "multipliers", multipliers, dtype=I64, ndim=2)
    layers = mult.shape[0]
    if mult.shape[1] != ngram:
        raise err.value("multipliers", f"expected shape ({layers}, {ngram}) (one multiplier per column of "
                                       f"'ngram_token_ids'), got {tuple(mult.shape)}")
    limits.ENGRAM_HASH_LAYERS.of(device).check(err, "multipliers", layers)
    vocab = check_tensor(err, "vocab_sizes", vocab_sizes, dtype=I32, shape=(layers, ngram - 1, None))
    tables = vocab.shape[2]
    if tables < 1:
        raise err.value("vocab_sizes", f"expected at least one table per n-gram order (E >= 1), got shape "
                                       f"{tuple(vocab.shape)}")
    columns = (ngram - 1) * tables
    limits.ENGRAM_HASH_COLUMNS.of(device).check(err, "vocab_sizes", columns)
    offs = check_tensor(err, "offsets", offsets, dtype=I32, shape=(layers, columns))
    mask = check_mask(err, image_token_mask, tokens)
    limits.ENGRAM_HASH_ELEMENTS.check(err, "ngram_token_ids", layers * tokens * columns)
    check_same_device(err, [("ngram_token_ids", ids), ("multipliers", mult), ("vocab_sizes", vocab),
                            ("offsets", offs), ("image_token_mask", mask)])
    return ids.new_empty((layers, tokens, columns))


# DTensor sharding (docs/distributed.md): token-wise (the token dim is dim 1 of the output); the hash
# parameters are replicated.
engram_hash.sharding({"ngram_token_ids": "S0", "image_token_mask": "S0", "returns": "S1"})
