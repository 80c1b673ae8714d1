"""Pure-Paddle contrastive (InfoNCE / CLIP) loss: the ground truth and the CPU fallback.

Materialises the similarity matrix ``S = scale * q @ k.T`` (``[B_q, B_k]``, computed in float32, so
it accepts every input dtype on CPU), so it costs O(B^2) memory: fine for tests and small batches.
"""

from __future__ import annotations

import paddle


def contrastive_rows_ref(q: paddle.Tensor, k: paddle.Tensor, labels: paddle.Tensor, scale) -> paddle.Tensor:
    """Per-row loss ``logsumexp_j S[i, j] - S[i, labels[i]]`` (float32) for q [M, D], k [N, D], labels
    [M] in [0, N); ``scale`` a float or a Paddle scalar tensor (differentiable)."""
    scores = paddle.matmul(q.astype("float32"), k.astype("float32"), transpose_y=True) * scale
    positive = paddle.take_along_axis(scores, labels.astype("int64").reshape([-1, 1]), axis=1).reshape([-1])
    return paddle.logsumexp(scores, axis=1) - positive


def contrastive_loss_ref(q: paddle.Tensor, k: paddle.Tensor, labels: paddle.Tensor, scale,
                         symmetric: bool = False, q_all: paddle.Tensor | None = None,
                         k_all: paddle.Tensor | None = None) -> paddle.Tensor:
    """Per-row loss of the local rows (float32, [B]).

    Single process: ``q_all``/``k_all`` None, the loss of ``cross_entropy(S, labels)`` per row, and with
    ``symmetric`` the mean of both directions, ``(row_i + col_i) / 2`` with ``col_j =
    logsumexp_i S[i, j] - S[labels[j], j]`` (q and k of one batch size). Data parallel: ``k_all``
    (and ``q_all`` when symmetric) hold the global batch and labels are global indices.
    """
    k_all = k if k_all is None else k_all
    rows = contrastive_rows_ref(q, k_all, labels, scale)
    if not symmetric:
        return rows
    q_all = q if q_all is None else q_all
    cols = contrastive_rows_ref(k, q_all, labels, scale)  # S.T: columns of the local k
    return 0.5 * (rows + cols)
