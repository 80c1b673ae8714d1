"""swap_fused_layers on tensor- (and sequence-) parallel PaddleNLP models, 2 CPU processes on gloo.

Each rank builds the single-process model (the same full weights on both: same seed) and the model with
``tensor_parallel_degree=2`` whose shards are cut from those full weights, swaps our layers into the
latter (fleet's own parallel layers have no CPU kernels, so only the swapped model runs here), and
checks that the loss equals the single-process loss and that each shard's gradient equals its slice
of the full gradient (``CASES``: LLaMA tensor + sequence parallel with the logits and a few AdamW steps,
LLaMA with a fused gate-up weight on the Triton kernels, LLaMA with tied embeddings, GPT). All cases run
in one pair of processes: starting them costs more than the cases. Runs only where PaddleNLP is
installed (the ``paddlenlp`` test extra).
"""

import numpy as np
import pytest

pytest.importorskip("paddlenlp")

from paddlenlp_fused.testing.distributed import init_fleet, run_distributed  # noqa: E402

VOCAB, BATCH, SEQ = 128, 2, 16
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, seq_length=SEQ)
GPT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, seq_length=SEQ)
# float32, as in test_integration_paddlenlp: the parallel model sums partial products in another order.
LOSS_ATOL = 1e-5
GRAD_RTOL = 2e-5
GRAD_FLOOR = 1e-3  # relative to the whole gradient's norm (GPT's key biases have an exactly-zero gradient)
CURVE_RTOL = 1e-5
STEPS = 4


def _models(kind, rank, sequence_parallel, **extra):
    """(single-process model, tensor-parallel model holding this rank's shards of the same weights).
    ``extra``: config attributes set after construction (PaddleNLP 3.0.0b4's config resets some)."""
    import paddle
    from paddlenlp.transformers import GPTConfig, GPTForCausalLM, LlamaConfig, LlamaForCausalLM

    config_cls, model_cls, kwargs = (LlamaConfig, LlamaForCausalLM, LLAMA) if kind == "llama" else \
        (GPTConfig, GPTForCausalLM, GPT)

    def build(seed, **parallel):
        config = config_cls(**kwargs, **parallel)
        for key, value in extra.items():
            setattr(config, key, value)
        paddle.seed(seed)
        return model_cls(config)

    full = build(0)
    parallel = build(1, tensor_parallel_degree=2, tensor_parallel_rank=rank, sequence_parallel=sequence_parallel)
    weights = full.state_dict()
    for name, param in parallel.named_parameters():
        param.set_value(_shard(weights[name].numpy(), param, rank, name))
    return full, parallel


def _shard(full, param, rank, name):
    """This rank's piece of a full array, as fleet marks the parameter (``split_axis``); a fused
    gate-up weight ``[hidden, gate | up]`` shards as ``[gate shard | up shard]`` (PaddleNLP's layout)."""
    if not getattr(param, "is_distributed", False):
        return full
    if "gate_up_fused_proj" in name:
        return np.concatenate([np.split(half, 2, axis=1)[rank] for half in np.split(full, 2, axis=1)], axis=1)
    return np.split(full, 2, axis=param.split_axis)[rank]


def _assert_rel(new, ref, what, bound=GRAD_RTOL):
    assert new.shape == ref.shape, (what, new.shape, ref.shape)
    err = np.linalg.norm(new - ref) / np.linalg.norm(ref)
    assert err <= bound, (what, err)


def _logits(output):
    return output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output


def _loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out[0] if isinstance(out, tuple) else out.loss


def _check_step0(full, parallel, ids, rank):
    """Loss equal, every shard's gradient equal to its slice of the full one."""
    from paddlenlp_fused.layers.tensor_parallel import allreduce_sequence_parallel_grads

    loss_full, loss_par = _loss(full, ids), _loss(parallel, ids)
    loss_full.backward()
    loss_par.backward()
    allreduce_sequence_parallel_grads(parallel)  # what PaddleNLP's trainer hooks do for marked parameters
    assert abs(float(loss_par) - float(loss_full)) <= LOSS_ATOL, (float(loss_par), float(loss_full))
    grads = {n: p.grad.numpy() for n, p in full.named_parameters() if not p.stop_gradient}
    total = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    checked = 0
    for name, param in parallel.named_parameters():
        if param.stop_gradient:
            continue
        ref = _shard(grads[name], param, rank, name)
        new = param.grad.numpy()
        assert new.shape == ref.shape, (name, new.shape, ref.shape)
        assert np.isfinite(new).all(), name
        err = np.linalg.norm(new - ref) / max(np.linalg.norm(ref), GRAD_FLOOR * total)
        assert err <= GRAD_RTOL, (name, err)
        checked += 1
    assert checked == len(grads)
    return float(loss_full), float(loss_par)


def _train_and_compare(full, parallel, rng, rank):
    import paddle

    from paddlenlp_fused.layers.tensor_parallel import allreduce_sequence_parallel_grads

    opts = [paddle.optimizer.AdamW(1e-2, parameters=m.parameters()) for m in (full, parallel)]
    ids = paddle.to_tensor(rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int64"))
    curves = [list(pair) for pair in zip(_check_step0(full, parallel, ids, rank))]
    for opt in opts:
        opt.step()
        opt.clear_grad()
    for _ in range(STEPS - 1):
        ids = paddle.to_tensor(rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int64"))
        for model, opt, curve in zip((full, parallel), opts, curves):
            loss = _loss(model, ids)
            loss.backward()
            if model is parallel:
                allreduce_sequence_parallel_grads(model)
            opt.step()
            opt.clear_grad()
            curve.append(float(loss))
    ref, new = np.array(curves[0]), np.array(curves[1])
    assert ref[-1] < ref[0], ref
    np.testing.assert_allclose(new, ref, rtol=CURVE_RTOL)
    print(f"rank {rank} curves: {ref} {new}")


def _swap_keeping_rng(model):
    """swap_fused_layers (reference backend), checked to leave the global and fleet's model-parallel
    random streams where they were (our layers' throwaway initial weights are drawn and undone)."""
    import paddle
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers

    tracker = get_rng_state_tracker()
    paddle.seed(5)
    tracked = tracker.get_states_tracker()
    report = swap_fused_layers(model, backend="reference")
    drawn = [paddle.rand([4]).numpy()]
    with tracker.rng_state():
        drawn.append(paddle.rand([4]).numpy())
    paddle.seed(5)
    tracker.set_states_tracker(tracked)
    np.testing.assert_array_equal(drawn[0], paddle.rand([4]).numpy())
    with tracker.rng_state():
        np.testing.assert_array_equal(drawn[1], paddle.rand([4]).numpy())
    return report


def _llama_tp_sp(rank):
    """LLaMA, tensor + sequence parallel, reference backend: step 0, logits, a few AdamW steps."""
    import paddle

    from paddlenlp_fused.integrations.paddlenlp import FusedLlamaMLP

    full, parallel = _models("llama", rank, sequence_parallel=True)
    keys = list(parallel.state_dict())
    report = _swap_keeping_rng(parallel)
    assert list(parallel.state_dict()) == keys  # the shards keep their checkpoint keys
    assert report.skipped == [] and any("allreduce_sequence_parallel_grads" in note for note in report.notes)
    assert report.swapped == {"parallel_linear": 14, "vocab_parallel_embedding": 1, "llama_mlp": 2, "rms_norm": 5,
                              "lm_head": 1, "criterion": 1}, str(report)
    mlp = parallel.llama.layers[0].mlp
    assert isinstance(mlp, FusedLlamaMLP) and mlp.sequence_parallel and mlp.process_group.world_size == 2
    assert parallel.llama.norm.weight.sequence_parallel  # PaddleNLP's mark kept on the swapped norm
    assert type(parallel.llama.layers[0].self_attn.q_proj).__module__ == "paddlenlp_fused.layers.tensor_parallel"
    # Without labels: the logits, this rank's vocabulary shard or gathered (tensor_parallel_output=False).
    ids = paddle.to_tensor(np.random.default_rng(21).integers(0, VOCAB, (BATCH, SEQ)).astype("int64"))
    with paddle.no_grad():
        ref = full(input_ids=ids, return_dict=True).logits.numpy()
        local = parallel(input_ids=ids, return_dict=True).logits.numpy()
        gathered = parallel.lm_head(parallel.llama(input_ids=ids)[0], tensor_parallel_output=False).numpy()
    _assert_rel(local, np.split(ref, 2, axis=-1)[rank], "logits shard")
    _assert_rel(gathered, ref, "gathered logits")
    _train_and_compare(full, parallel, np.random.default_rng(20), rank)


def _llama_tp_triton(rank):
    """LLaMA with a fused gate-up weight, tensor parallel without sequence parallel, Triton kernels
    (interpreter): step 0."""
    import paddle

    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers
    from paddlenlp_fused.runtime.backend import use_backend

    full, parallel = _models("llama", rank, sequence_parallel=False, fuse_attention_ffn=True)
    assert parallel.llama.layers[0].mlp.fuse_attention_ffn
    report = swap_fused_layers(parallel, backend="triton")
    assert report.skipped == [] and report.swapped["llama_mlp"] == 2, str(report)
    ids = paddle.to_tensor(np.random.default_rng(30).integers(0, VOCAB, (BATCH, SEQ)).astype("int64"))
    with use_backend("triton"):
        _check_step0(full, parallel, ids, rank)


def _llama_tied_tp_sp(rank):
    """LLaMA with the head tied to the vocabulary-parallel embedding (one [V / n, hidden] shard): step 0."""
    import paddle

    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers

    full, parallel = _models("llama", rank, sequence_parallel=True, tie_word_embeddings=True)
    report = swap_fused_layers(parallel, backend="reference")
    assert report.skipped == [] and report.swapped["lm_head"] == 1, str(report)
    assert parallel.lm_head.weight is parallel.llama.embed_tokens.weight and parallel.lm_head.transpose_y
    ids = paddle.to_tensor(np.random.default_rng(35).integers(0, VOCAB, (BATCH, SEQ)).astype("int64"))
    _check_step0(full, parallel, ids, rank)


def _gpt_tp_sp(rank):
    """GPT (inline MLP, biases, vocabulary-parallel word embedding), tensor + sequence parallel: step 0."""
    import paddle

    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers

    full, parallel = _models("gpt", rank, sequence_parallel=True)
    report = swap_fused_layers(parallel, backend="reference")
    assert report.skipped == [], str(report)
    assert report.swapped == {"parallel_linear": 12, "vocab_parallel_embedding": 1, "gpt_mlp": 2, "layer_norm": 5,
                              "lm_head": 1, "criterion": 1}, str(report)
    # tensor_parallel=False leaves fleet's layers (and so the MLPs built on them) in place, and says so.
    kept = _models("gpt", rank, sequence_parallel=True)[1]
    reasons = dict(swap_fused_layers(kept, tensor_parallel=False, norms=False).skipped)
    assert list(reasons.values()).count("tensor_parallel=False") == 13, reasons
    assert all("fleet's parallel linears are kept" in reasons[f"gpt.decoder.layers.{i}"] for i in range(2)), reasons
    ids = paddle.to_tensor(np.random.default_rng(40).integers(0, VOCAB, (BATCH, SEQ)).astype("int64"))
    with paddle.no_grad():  # unlabelled: GPT's head returns this rank's vocabulary shard of the logits
        ref, local = (_logits(model(input_ids=ids)) for model in (full, parallel))
    _assert_rel(local.numpy(), np.split(ref.numpy(), 2, axis=-1)[rank], "GPT logits shard")
    _check_step0(full, parallel, ids, rank)


CASES = (_llama_tp_sp, _llama_tp_triton, _llama_tied_tp_sp, _gpt_tp_sp)


def _cases_body():
    import time

    rank = init_fleet(mp_degree=2).get_model_parallel_rank()
    for case in CASES:
        start = time.time()
        case(rank)
        print(f"{case.__name__}: passed on rank {rank} in {time.time() - start:.1f} s")


def test_tensor_parallel_swap_matches_single_process():
    """All cases in one pair of processes: starting them (paddle, paddlenlp, gloo) costs more than the cases."""
    run_distributed(_cases_body)
