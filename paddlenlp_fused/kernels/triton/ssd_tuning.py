"""Launch tuning of the Mamba-2 SSD forward kernels (``ssd.py``), kept apart from the kernels.

No op sets any of this: ``mamba_chunk_scan_combined`` always launches with ``config=None``. Large 16-bit
problems on the GPU (``TUNE_MIN_PROGRAMS``) take the autotuned kernels over the config lists below;
everything else takes ``SSDConfig``'s fixed tiles, which tests and the benchmark's sweep also set to
reach each kernel variant. The measurements behind these choices are in ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import triton


class SSDConfig(NamedTuple):
    """Tile sizes (powers of two; clipped to the problem) and launch options of the stages. Defaults:
    the best of an H200 sweep at the benchmark shape (x [4, 4096, 64, 128] bf16, dstate 128, chunk
    256); that shape now takes the autotuned kernels, these serve the interpreter and small problems."""
    cumsum_block_h: int = 8
    cb_block: int = 64           # CB tile [cb_block, cb_block], dstate steps of 64
    state_block_p: int = 128     # chunk-state tile [p, n], token steps
    state_block_n: int = 64
    state_block_k: int = 64
    state_warps: int = 8
    state_stages: int = 3
    pass_block: int = 2048       # state passing: p*n elements per program
    # stages 3+4 fused: one program per (p, n) tile, batch and head walks the tokens (the state never
    # leaves registers, no round trip of the own states through memory); fewer, sequential programs.
    # None: fused once batch * nheads >= FUSED_MIN_ROWS (enough programs to fill the GPU)
    fuse_state_passing: Optional[bool] = None
    fused_block_p: int = 64
    fused_block_n: int = 64
    fused_block_k: int = 128     # tokens per step (divides chunk_size)
    fused_warps: int = 4
    fused_stages: int = 2
    scan_block_m: int = 64       # chunk-scan tile [tokens, p], token steps, dstate steps
    scan_block_p: int = 128
    scan_block_k: int = 64
    scan_block_n: int = 128
    scan_warps: int = 4
    scan_stages: int = 2
    # chunk-scan programs of one chunk and token tile for all heads run side by side (head = fastest
    # program id), so the C, B and CB tiles they share are read from L2
    scan_heads_first: bool = True
    # a chunk-scan program walks all token tiles of its chunk (for dstate <= 256): the fp32 entering
    # state is read once per (chunk, head, headdim tile) instead of once per token tile
    scan_m_loop: bool = True
    # bf16 only: the intra-chunk weights (C.B * decay * dt, fp32) go into the matmul as two bf16 terms
    # (8 more bits of y) for one more matmul. Off: one term is what any bf16 GEMM of these weights
    # gives, inside the numerics bound.
    split_scores: bool = False
    # chunk scan recomputes its C.B blocks by matmul (C tile kept in registers) instead of loading
    # the fp32 CB written by stage 2 (which the backward reads); for dstate <= 256
    recompute_cb: bool = False


DEFAULT_CONFIG = SSDConfig()

TUNE_MIN_PROGRAMS = 2048  # batch * nchunks * nheads from which the tuned kernels run
FUSED_MIN_ROWS = 128      # batch * nheads from which stages 3 and 4 run fused (SSDConfig.fuse_state_passing=None)

# Autotuner configs: the best of the H200 sweeps (tile choices of the chunk scan differ by about 2x)
# and a few untried neighbours.
# Chunk scan: (BLOCK_M, BLOCK_P, BLOCK_K, warps, stages, RECOMPUTE_CB, M_LOOP); the last one also serves
# dstate > 256, where the one-tile variants are pruned.
SCAN_CONFIGS = [triton.Config(dict(BLOCK_M=bm, BLOCK_P=bp, BLOCK_K=bk, RECOMPUTE_CB=rc, M_LOOP=ml, HEADS_FIRST=True),
                              num_warps=w, num_stages=st)
                for bm, bp, bk, w, st, rc, ml in ((64, 128, 32, 4, 3, False, True), (64, 128, 64, 4, 2, False, True),
                                                  (64, 128, 64, 4, 3, False, True), (64, 128, 32, 4, 2, False, True),
                                                  (64, 128, 64, 4, 2, True, False), (64, 128, 64, 4, 2, False, False))]
# Chunk states (stage 3 alone): (BLOCK_P, BLOCK_N, BLOCK_K, warps, stages)
STATE_CONFIGS = [triton.Config(dict(BLOCK_P=bp, BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=st)
                 for bp, bn, bk, w, st in ((128, 64, 64, 8, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 2))]
# Stages 3+4 fused: (BLOCK_P, BLOCK_N, BLOCK_K, warps, stages); all compile without spills for
# headdim = dstate = 128
FUSED_CONFIGS = [triton.Config(dict(BLOCK_P=bp, BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=st)
                 for bp, bn, bk, w, st in ((128, 64, 128, 4, 2), (128, 64, 128, 4, 3), (128, 64, 64, 4, 3),
                                           (64, 128, 128, 4, 2), (128, 128, 128, 8, 2), (128, 128, 64, 8, 3),
                                           (64, 64, 128, 4, 2), (64, 64, 128, 4, 3), (128, 64, 128, 8, 2))]
