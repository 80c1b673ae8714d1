"""What the four examples share: flags, data, the training loop, the run's description and the plot.

Data (``--data``):

- ``synthetic`` (default): a fixed random Markov chain over the vocabulary. Each token has 4 likely
  successors (Dirichlet weights) and, with probability ``BACKGROUND``, jumps to a uniformly random
  token, so the loss has a known floor, the chain's entropy rate (printed), that a working model
  approaches. It is stored sparsely (``[V, 4]`` successors and weights): ``V = 32000`` costs kilobytes,
  where a dense ``V x V`` matrix took gigabytes.
- ``text``: byte-level tokens (ids 0..255) of the Python standard library's own top-level source
  files, which every Python installation has offline. Its floor is unknown; the plot shows the bytes'
  unigram entropy (what a model ignoring context reaches) for scale.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F

BACKGROUND = 0.1  # probability of a uniform jump in the synthetic chain
SUCCESSORS = 4
TEXT_BYTES = 8 << 20  # at most this much standard-library source is read for --data text
IGNORE_INDEX = -100  # labels that take no part in the loss (PaddleNLP's and linear_cross_entropy's default)
# the loss-curve PNGs, next to the examples whatever the working directory (git ignores *.png)
PLOT_DIR = Path(__file__).resolve().parent / "plots"


class MarkovChain:
    """The synthetic data: ``successors`` / ``weights`` ``[V, 4]``; ``floor`` its entropy rate (nats)."""

    name = "synthetic Markov chain"
    floor_label = "chain entropy (floor)"

    def __init__(self, vocab: int, rng: np.random.Generator):
        self.vocab = vocab
        self.successors = np.stack([rng.choice(vocab, SUCCESSORS, replace=False) for _ in range(vocab)])
        self.weights = rng.dirichlet(np.ones(SUCCESSORS), size=vocab)
        self.cdf = self.weights.cumsum(1)
        self.floor = self._entropy_rate()

    def _row_probs(self):
        """Each row's probabilities of its successors (background included), [V, 4]."""
        return (1 - BACKGROUND) * self.weights + BACKGROUND / self.vocab

    def _entropy_rate(self) -> float:
        # the stationary distribution by power iteration on the sparse chain
        stationary = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(200):
            nxt = np.full(self.vocab, BACKGROUND / self.vocab * stationary.sum())
            np.add.at(nxt, self.successors, (1 - BACKGROUND) * self.weights * stationary[:, None])
            stationary = nxt
        p = self._row_probs()
        others = BACKGROUND / self.vocab  # every non-successor has this probability
        row_entropy = -(p * np.log(p)).sum(1) - (self.vocab - SUCCESSORS) * others * math.log(others)
        return float(stationary @ row_entropy)

    def sample(self, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
        tokens = np.empty((batch, length), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab, batch)
        for t in range(1, length):
            prev = tokens[:, t - 1]
            pick = (rng.random(batch)[:, None] > self.cdf[prev]).sum(1).clip(max=SUCCESSORS - 1)
            jump = rng.random(batch) < BACKGROUND
            tokens[:, t] = np.where(jump, rng.integers(0, self.vocab, batch), self.successors[prev, pick])
        return tokens


class StdlibText:
    """``--data text``: the bytes of the standard library's top-level ``*.py`` files (sorted by name)."""

    floor_label = "byte unigram entropy"

    def __init__(self, vocab: int):
        if vocab < 256:
            raise SystemExit(f"--data text needs a vocabulary of at least 256 byte ids, got {vocab}")
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        chunks, size = [], 0
        for path in files:
            with open(path, "rb") as f:
                chunks.append(f.read())
            size += len(chunks[-1])
            if size >= TEXT_BYTES:
                break
        self.data = np.frombuffer(b"".join(chunks)[:TEXT_BYTES], dtype=np.uint8)
        self.name = f"{len(self.data) / 1e6:.1f} MB of standard-library source ({len(chunks)} files), bytes"
        counts = np.bincount(self.data, minlength=256) / len(self.data)
        counts = counts[counts > 0]
        self.floor = float(-(counts * np.log(counts)).sum())

    def sample(self, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
        starts = rng.integers(0, len(self.data) - length, batch)
        return np.stack([self.data[s:s + length] for s in starts]).astype(np.int64)


def make_data(kind: str, vocab: int, rng: np.random.Generator):
    return MarkovChain(vocab, rng) if kind == "synthetic" else StdlibText(vocab)


def sample_batch(data, batch: int, seq: int, rng):
    """(inputs, labels) ``[batch, seq]``: labels are the inputs shifted by one token."""
    tokens = data.sample(batch, seq + 1, rng)
    return paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (``--steps 0`` has no loss to report or plot)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def default_plot(script: str, args) -> str:
    """``PLOT_DIR/<script>_<size>_<data>_<fused|plain>[_tp<N>[_sp]].png``: one name per kind of run, so that
    the fused, ``--no-fused``, ``--data text`` and fleet runs do not overwrite each other's curve."""
    parts = [script, args.size, args.data, "fused" if args.fused else "plain"]
    if getattr(args, "tensor_parallel", 1) > 1 or getattr(args, "sequence_parallel", False):
        parts.append(f"tp{args.tensor_parallel}{'_sp' if args.sequence_parallel else ''}")
    return str(PLOT_DIR / f"{'_'.join(parts)}.png")


def example_args(description, sizes, script, argv=None, default_lr=3e-3, fleet=False):
    """The flags every example takes (and, with ``fleet``, ``--tensor-parallel`` / ``--sequence-parallel``);
    sets Paddle's device and seed from them. ``script``: the example's name, which starts its default PNG
    name (``default_plot``); ``args.config``: the size's config with ``--batch`` applied."""
    parser = argparse.ArgumentParser(description=description)
    if fleet:
        parser.add_argument("--tensor-parallel", type=int, default=1,
                            help="tensor-parallel degree (fleet mode; run under paddle.distributed.launch)")
        parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallel (fleet mode)")
    parser.add_argument("--size", choices=sorted(sizes), default="tiny")
    parser.add_argument("--data", choices=("synthetic", "text"), default="synthetic",
                        help="synthetic Markov chain (known loss floor) or bytes of the standard library's source")
    parser.add_argument("--steps", type=positive_int, default=60)
    parser.add_argument("--batch", type=positive_int, default=None, help="sequences a step (default: the size's)")
    parser.add_argument("--lr", type=float, default=default_lr)
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None,
                        help=f"loss-curve PNG (default {PLOT_DIR}/{script}_<size>_<data>_<fused|plain>.png)")
    parser.add_argument("--moment-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="FusedAdamW's moments; auto: bfloat16 where FusedAdamW runs a kernel (GPU, "
                             "TRITON_INTERPRET=1), float32 where it runs its CPU reference")
    args = parser.parse_args(argv)
    args.plot = args.plot or default_plot(script, args)
    args.config = dict(sizes[args.size], **({"batch": args.batch} if args.batch else {}))
    paddle.set_device(args.device)
    paddle.seed(args.seed)
    args.moment_dtype = moment_dtype(args.moment_dtype)
    return args


def moment_dtype(requested: str) -> str:
    """``--moment-dtype``: ``auto`` is bfloat16 where FusedAdamW runs a kernel and float32 where it runs
    its CPU reference. There Paddle's AdamW kernel updates the moments, and 16-bit moments cost numpy
    passes around it (widening, random bits, stochastic rounding): the optimizer's step about twice
    Paddle's AdamW, where float32 moments match it (README, "On CPU")."""
    if requested != "auto":
        return requested
    from paddlenlp_fused.optimizer.adamw import IMPLEMENTED
    from paddlenlp_fused.runtime.backend import resolve_backend

    device = "gpu" if paddle.get_device().startswith("gpu") else "cpu"
    kernel = resolve_backend("FusedAdamW", "auto", device, implemented=IMPLEMENTED) != "reference"
    return "bfloat16" if kernel else "float32"


def backend_summary(fused: bool) -> str:
    """Which implementation the paddlenlp_fused ops run here, in words."""
    from paddlenlp_fused.runtime.backend import default_backend, interpreter_enabled, local_device

    if not fused:
        return "plain Paddle"
    chosen = default_backend()
    on_gpu = paddle.get_device().startswith("gpu")
    if chosen != "auto":
        return f"{chosen} (forced)"
    if on_gpu:
        return "CUDA / Triton kernels"
    if interpreter_enabled():
        return "Triton kernels in the interpreter (TRITON_INTERPRET=1)"
    gpu_note = "" if local_device() == "cpu" else " (tensors on the CPU)"
    return f"pure-Paddle reference{gpu_note}"


def cross_entropy(logits, labels):
    """The plain runs' loss: the mean cross-entropy over the tokens whose label is not ``IGNORE_INDEX``,
    as ``linear_cross_entropy`` and PaddleNLP's criteria take it (Paddle's ``reduction="mean"`` divides by
    every token, ignored ones included); 0 when every label is ignored."""
    logits, labels = logits.reshape([-1, logits.shape[-1]]).astype("float32"), labels.reshape([-1])
    losses = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    counted = (labels != IGNORE_INDEX).astype("float32").sum()
    return losses.sum() / paddle.clip(counted, min=1.0)


def parameter_count(model) -> int:
    return sum(int(np.prod(p.shape)) for p in model.parameters())


def describe(label: str, model, data, vocab: int, layers, args, parameters=None):
    """The run's opening lines: parameters, data, loss floor, and which layers, optimizer and backend run.
    ``parameters``: how to state the parameter count (default: the model's, in millions)."""
    parameters = parameters or f"{parameter_count(model) / 1e6:.2f}M parameters"
    print(f"{label}: {parameters}; data: {data.name}; {data.floor_label} {data.floor:.3f}, "
          f"uniform {math.log(vocab):.3f}")
    optimizer = f"FusedAdamW ({args.moment_dtype} moments)" if args.fused else "paddle.optimizer.AdamW"
    print(f"  layers: {', '.join([*layers, optimizer])}; backend: {backend_summary(args.fused)}")


def fit(model, opt, data, cfg, steps, rng, loss_of, after_backward=None, show=True):
    """Train ``steps`` steps with a progress line and the mean step time (the first step left out: it
    builds kernels and caches) when ``show``; returns the losses. ``loss_of(model, inputs, labels)`` is
    the scalar loss; ``after_backward`` runs between backward and the optimizer step."""
    losses, times, tokens_seen, start = [], [], 0, time.time()
    for step in range(1, steps + 1):
        inputs, labels = sample_batch(data, cfg["batch"], cfg["seq"], rng)
        began = time.perf_counter()
        loss = loss_of(model, inputs, labels)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        times.append(time.perf_counter() - began)
        tokens_seen += inputs.size
        done = int(30 * step / steps)
        if show:
            sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] step {step}/{steps} loss {losses[-1]:.4f} "
                             f"{tokens_seen / (time.time() - start):,.0f} tok/s")
            sys.stdout.flush()
    if show:
        step_time = float(np.mean(times[1:] if len(times) > 1 else times))
        print(f"\n{steps} steps in {time.time() - start:.1f} s, {step_time:.3f} s a step (after the first)")
    if not all(math.isfinite(v) for v in losses):
        raise SystemExit("loss is not finite")
    return losses


def loss_figure(losses, data, title: str):
    """The loss curve against steps 1..N (integer ticks, however short the run) and the data's floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(5.5, 3.4))
    axes.plot(range(1, len(losses) + 1), losses, label="loss")
    axes.axhline(data.floor, ls="--", c="gray", label=data.floor_label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title(title, fontsize=9)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats)")
    axes.legend()
    figure.tight_layout()
    return figure


def finish(losses, data, title: str, path: str):
    """Print the final loss and write the loss-curve PNG titled ``title`` to ``path`` (its folder made)."""
    print(f"final loss {np.mean(losses[-5:]):.4f} (start {losses[0]:.4f}, {data.floor_label} {data.floor:.3f})")
    import matplotlib.pyplot as plt

    figure = loss_figure(losses, data, title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"loss curve: {path}")


def plot_title(model: str, size: str, fused: bool) -> str:
    return f"{model} ({size}), {backend_summary(fused)}, {paddle.get_device()}"
