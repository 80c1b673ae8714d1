"""Pure-Paddle linear cross-entropy: the ground truth for every option and the CPU fallback.

The same three stages as the Triton kernels, computed in float32 over blocks of tokens so that no
more than ``block_tokens x V`` logits exist at once (on the CPU too):

``lse_stats_ref``  hidden ``[T, D]``, weight ``[V, D]`` / ``[D, V]`` -> stats ``[3, T]`` (lse, target
                   logit, logit sum over the vocabulary rows held here, ids ``vocab_start + v``);
``token_loss_ref`` (global) stats -> per-token loss ``[T]``;
``grads_ref``      recomputes each block's logits and returns dh, dW, dbias for
                   ``G = f'(a) * (coef_p * softmax - coef_y * ((1 - eps) onehot + eps / V_total))``.

With ``a = h W^T + b`` and ``s = softcap(a) = c tanh(a / c)`` (or ``s = a``):
``loss = lse - (1 - eps) s_y - eps / V_total * sum_v s_v + z lse^2`` for labelled tokens, 0 for ignored.

``loss_and_lse_ref`` is the whole-vocabulary single-block case through Paddle's autograd: where
``T x V`` logits fit one block, holding them for the backward costs no more memory than a block
does, and it spares the recomputing GEMM of ``grads_ref``.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from ._common import float32

_CE_CLAMP_SAFE = 60.0  # below Paddle's CPU softmax clamp of s - max at -64, with a margin

DEFAULT_BLOCK_ELEMENTS = 2**24  # logits held at once (64 MB of fp32)


def _block_tokens(n_tok: int, V: int, block_tokens: int | None) -> int:
    if block_tokens is not None:
        return max(1, int(block_tokens))
    return max(1, min(max(n_tok, 1), DEFAULT_BLOCK_ELEMENTS // max(V, 1)))


def fits_one_block(n_tok: int, V: int) -> bool:
    """Whether ``n_tok x V`` logits fit the default block (``loss_and_lse_ref`` may hold them)."""
    return n_tok * V <= DEFAULT_BLOCK_ELEMENTS


def loss_and_lse_ref(hidden, weight, labels, bias=None, *, transpose_y: bool = True, ignore_index: int = -100,
                     label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None):
    """(per-token fp32 loss ``[T]``, fp32 lse ``[T]``) over the whole vocabulary, differentiable
    through Paddle's autograd; the same loss as ``lse_stats_ref`` + ``token_loss_ref``."""
    a = paddle.matmul(float32(hidden), float32(weight), transpose_y=transpose_y)
    if bias is not None:
        a = a + float32(bias)
    s = _softcapped(a, softcap)
    lse = paddle.logsumexp(s, axis=-1)
    labels = labels.reshape([-1]).astype("int64")
    valid = labels != ignore_index
    zeros = paddle.zeros_like(lse)
    s_y = paddle.take_along_axis(s, paddle.clip(labels, 0, s.shape[-1] - 1).unsqueeze(-1), axis=-1).squeeze(-1)
    # Paddle's CPU F.cross_entropy caps a token's loss near 64 (its softmax clamps s - max at -64).
    # Below that it is the plain composition's own kernel, whose rounding a loss curve compared with
    # the plain model's shares; a batch with a token at the cap gets lse - s_y written out.
    if float(paddle.where(valid, s.max(axis=-1) - s_y, zeros).max()) < _CE_CLAMP_SAFE:
        nll = F.cross_entropy(s, labels, ignore_index=ignore_index, reduction="none").reshape([-1])
    else:
        nll = lse - s_y
    loss = (1.0 - label_smoothing) * nll
    if label_smoothing:
        loss = loss + label_smoothing * (lse - s.mean(axis=-1))
    if z_loss:
        loss = loss + z_loss * lse * lse
    return paddle.where(valid, loss, paddle.zeros_like(loss)), lse


def _weight_vd(weight, transpose_y: bool):
    """The weight as fp32 ``[V, D]``."""
    w = weight.astype("float32")
    return w if transpose_y else w.t()


def _softcapped(a, softcap):
    return a if softcap is None else softcap * paddle.tanh(a / softcap)


def check_labels(labels, vocab_total: int, ignore_index: int) -> int:
    """ValueError unless every label is ``ignore_index`` or in ``[0, vocab_total)`` (host sync); returns
    how many labels are not ``ignore_index``."""
    lab = labels.numpy().reshape(-1)  # one host copy of the labels: cheaper than a chain of Paddle ops
    if lab.size and 0 <= lab.min() and lab.max() < vocab_total:  # all in range: only the count is left
        return lab.size - (int(np.count_nonzero(lab == ignore_index)) if 0 <= ignore_index < vocab_total else 0)
    labelled = lab != ignore_index
    bad = labelled & ((lab < 0) | (lab >= vocab_total))
    if bad.any():
        first = int(lab[bad.argmax()])
        raise ValueError(f"labels: expected values in [0, {vocab_total}) or ignore_index={ignore_index}, "
                         f"got {first}")
    return int(np.count_nonzero(labelled))


def lse_stats_ref(hidden, weight, labels, bias=None, *, transpose_y: bool = True, vocab_start: int = 0,
                  softcap: float | None = None, block_tokens: int | None = None):
    """stats ``[3, T]`` fp32 over this rank's vocabulary rows (see module docstring)."""
    w = _weight_vd(weight, transpose_y)
    V = w.shape[0]
    n_tok = hidden.shape[0]
    b = None if bias is None else bias.astype("float32")
    step = _block_tokens(n_tok, V, block_tokens)
    out = []
    for t0 in range(0, n_tok, step):
        h = hidden[t0:t0 + step].astype("float32")
        a = paddle.matmul(h, w, transpose_y=True)
        if b is not None:
            a = a + b
        s = _softcapped(a, softcap)
        lse = paddle.logsumexp(s, axis=-1)
        local = labels[t0:t0 + step].astype("int64") - vocab_start
        held = (local >= 0) & (local < V)
        picked = paddle.take_along_axis(s, paddle.clip(local, 0, V - 1).unsqueeze(-1), axis=-1).squeeze(-1)
        tgt = paddle.where(held, picked, paddle.zeros_like(picked))
        out.append(paddle.stack([lse, tgt, s.sum(axis=-1)]))
    if not out:
        return paddle.zeros([3, 0], dtype="float32")
    return paddle.concat(out, axis=1)


def token_loss_ref(stats, labels, *, vocab_total: int, ignore_index: int = -100, label_smoothing: float = 0.0,
                   z_loss: float = 0.0):
    """Per-token fp32 loss from global stats; 0 for ignored tokens."""
    lse, tgt, total = stats[0], stats[1], stats[2]
    loss = lse - (1.0 - label_smoothing) * tgt
    if label_smoothing:
        loss = loss - (label_smoothing / vocab_total) * total
    if z_loss:
        loss = loss + z_loss * lse * lse
    valid = labels.reshape([-1]) != ignore_index
    return paddle.where(valid, loss, paddle.zeros_like(loss))


def grads_ref(hidden, weight, labels, bias, lse, coef_p, coef_y, *, transpose_y: bool = True,
              vocab_start: int = 0, vocab_total: int | None = None, softcap: float | None = None,
              label_smoothing: float = 0.0, need=(True, True, True), block_tokens: int | None = None):
    """(dh ``[T, D]``, dW in the weight's layout, dbias ``[V]``) in the inputs' dtypes; an entry is None
    where ``need`` says so (or there is no bias). dh is the partial sum over the rows held here."""
    w = _weight_vd(weight, transpose_y)
    V, D = w.shape
    vocab_total = V if vocab_total is None else vocab_total
    n_tok = hidden.shape[0]
    b = None if bias is None else bias.astype("float32")
    need_dh, need_dw, need_db = need
    need_db = need_db and bias is not None
    dh_blocks = []
    dw = paddle.zeros([V, D], dtype="float32") if need_dw else None
    db = paddle.zeros([V], dtype="float32") if need_db else None
    step = _block_tokens(n_tok, V, block_tokens)
    for t0 in range(0, n_tok, step):
        h = hidden[t0:t0 + step].astype("float32")
        a = paddle.matmul(h, w, transpose_y=True)
        if b is not None:
            a = a + b
        s = _softcapped(a, softcap)
        p = paddle.exp(s - lse[t0:t0 + step].unsqueeze(-1))
        local = labels[t0:t0 + step].astype("int64") - vocab_start
        held = ((local >= 0) & (local < V)).astype("float32")
        onehot = paddle.nn.functional.one_hot(paddle.clip(local, 0, V - 1), V) * held.unsqueeze(-1)
        target = (1.0 - label_smoothing) * onehot + label_smoothing / vocab_total
        g = coef_p[t0:t0 + step].unsqueeze(-1) * p - coef_y[t0:t0 + step].unsqueeze(-1) * target
        if softcap is not None:
            g = g * (1.0 - (s / softcap) ** 2)
        if need_dh:
            dh_blocks.append(paddle.matmul(g, w))
        if need_dw:
            dw = dw + paddle.matmul(g, h, transpose_x=True)
        if need_db:
            db = db + g.sum(axis=0)
    dh = None
    if need_dh:
        dh = (paddle.concat(dh_blocks) if dh_blocks else paddle.zeros([0, D], "float32")).astype(hidden.dtype)
    if need_dw:
        dw = (dw if transpose_y else dw.t()).astype(weight.dtype)
    if need_db:
        db = db.astype(bias.dtype)
    return dh, dw, db
