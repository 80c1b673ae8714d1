"""PaddleNLP's Trainer end to end: the model with our layers swapped in (``swap_fused_layers``), and
``FusedAdamW`` as the Trainer's optimizer, against the plain model with the Trainer's own AdamW: same
configuration, initial weights and batches, ``max_grad_norm=1.0``, gradient accumulation 2, fp32 on CPU.

Equal means: the logged loss of every step within 1e-5 relative, the global gradient norm the clip
computed at every step within 1e-5 relative, the final parameters within the fp32 bound. The plain
reference is the plain model under the same parallel layout where fleet runs it on CPU (sharding), and
the single-process run of the same global batch where it cannot (tensor parallel: fleet's parallel
layers have no CPU kernels). One launch of 2 gloo processes per layout, every run of that layout in it;
model families alternate across layouts (LLaMA: tensor + sequence parallel, recompute; GPT: sharding
stage 1; one process: Mamba and GPT with FusedAdamW, the Trainer's checkpointing, the other recompute
granularities). What does not run on CPU, and why: docs/distributed.md.

``FLEET_CONTRACT``: which of our layers (in which parallel form) each layout's runs swap in; a new
layer joins with one entry, and the test fails until a run of the layouts it names swaps it in.
"""

import json
import os
import traceback
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("paddlenlp")

from paddlenlp_fused.testing.distributed import run_distributed  # noqa: E402

LOSS_RTOL = 1e-5
NORM_RTOL = 1e-5
PARAM_RTOL = 1e-5  # relative norm over all parameters; elementwise 4x (docs/numerics.md)
OUT_ENV = "PADDLENLP_FUSED_TRAINER_OUT"
GRANULARITIES = ("full", "full_attn", "core_attn")

# Our layers, as swap_fused_layers reports them (qualified by the parallel form they take), and the
# layouts whose runs must hold them.
FLEET_CONTRACT = {
    "parallel_linear": ("tensor_parallel",),  # ColumnParallelLinear / RowParallelLinear, sequence parallel
    "vocab_parallel_embedding": ("tensor_parallel",),
    "llama_mlp (tensor parallel)": ("tensor_parallel",),  # ParallelFusedMLP's fused_mlp_func over the group
    "criterion (tensor parallel)": ("tensor_parallel",),  # vocabulary-parallel linear_cross_entropy
    "rms_norm (sequence parallel)": ("tensor_parallel",),
    "layer_norm": ("sharding_stage1",),
    "gpt_mlp": ("sharding_stage1",),
    "criterion": ("sharding_stage1",),
    "mamba_mixer": ("single_process",),
}


def _layer_kinds(report, args):
    """The FLEET_CONTRACT names of what a swap replaced under ``args``."""
    kinds = {kind for kind, count in report.swapped.items() if count}
    if args.tensor_parallel_degree > 1:
        kinds |= {f"{kind} (tensor parallel)" for kind in ("llama_mlp", "criterion") if kind in kinds}
        if args.sequence_parallel and "rms_norm" in kinds:
            kinds.add("rms_norm (sequence parallel)")
    return kinds


def _summary(run, args):
    kinds = _layer_kinds(run.report, args) if run.report is not None else ()
    return dict(losses=run.losses, grad_norms=run.grad_norms, optimizer=run.optimizer,
                params={k: v.tolist() for k, v in run.params.items()}, kinds=sorted(kinds))


def _write(name, results):
    import paddle.distributed as dist

    with open(os.path.join(os.environ[OUT_ENV], f"{name}.{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)


def _run(family, args, layers, fused_adamw, **kwargs):
    """A Trainer run, summarised, or the error it raised (FusedAdamW under fleet before issue 28's
    optimizer work: the comparison then fails on it)."""
    from paddlenlp_fused.testing import trainer as T

    try:
        run = T.train(family, args, layers=layers, fused_adamw=fused_adamw, **kwargs)
    except Exception:  # noqa: BLE001 - reported by the test that reads it
        return dict(error=traceback.format_exc()[-3000:])
    return _summary(run, args)


def _counting_recompute(run_model):
    """``run_model()`` with LLaMA's calls of fleet's recompute counted: (its result, the count)."""
    from paddlenlp.transformers.llama import modeling

    calls, recompute = [], modeling.recompute

    def counted(*args, **kwargs):
        calls.append(1)
        return recompute(*args, **kwargs)

    modeling.recompute = counted
    try:
        result = run_model()
    finally:
        modeling.recompute = recompute
    result["recompute_calls"] = len(calls)
    return result


# other families' pipe models, one stage: (config class, pipe model class, config beyond CONFIGS["llama"])
PIPE_FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLMPipe", {}),
    "qwen": ("QWenConfig", "QWenForCausalLMPipe", dict(intermediate_size=64, kv_channels=8)),
    "chatglm_v2": ("ChatGLMv2Config", "ChatGLMv2ForCausalLMPipe",
                   dict(ffn_hidden_size=32, num_layers=1, kv_channels=8,
                        multi_query_group_num=1)),
}


def _pipeline_pieces():
    """LlamaForCausalLMPipe (one stage: fleet's pipeline has no gloo send, see docs/distributed.md), untied and
    tied as its last stage holds it (the LM head with the embedding's weight), Qwen2's and QWen's pipe models:
    loss and gradients before and after swap_fused_layers, what the swap replaced, whether the training forward
    deferred the logits and how far the eval one's logits are from the plain ones. What the swap leaves: the
    tied LLaMA pipe on one stage as PaddleNLP builds it, ChatGLMv2's pipe."""
    import paddle
    import paddle.distributed as dist
    from paddle.utils import unique_name
    from paddlenlp import transformers
    from paddlenlp.transformers.llama.modeling_pp import LlamaLMHeadPipe

    from paddlenlp_fused.integrations.paddlenlp import swap_fused_layers
    from paddlenlp_fused.testing import trainer as T

    ids = paddle.to_tensor(T.TokenDataset().ids[:2])

    def loss_and_grads(model):
        loss = T.pipe_loss(model, ids)
        loss.backward()
        grads = {name: p.grad.numpy().tolist() for name, p in model.named_parameters() if p.grad is not None}
        model.clear_gradients()
        return float(loss), grads

    def logits(model):
        hidden = ids
        for layer in model.run_function:
            hidden = layer(hidden)
        return hidden

    def pieces(model):
        plain = loss_and_grads(model)
        model.eval()
        eval_ref = logits(model).numpy()
        model.train()
        report = swap_fused_layers(model, backend="reference")
        fused = loss_and_grads(model)
        deferred = type(logits(model)).__name__
        model.eval()
        eval_err = float(np.abs(logits(model).numpy() - eval_ref).max() / np.abs(eval_ref).max())
        return dict(plain=plain, fused=fused, swapped=report.swapped, skipped=report.skipped,
                    paths=report.swapped_paths, stages=[type(layer).__name__ for layer in model.run_function],
                    deferred=deferred, eval_logits_err=eval_err)

    def family_pipe(config_cls, model_cls, extra):
        # padded_vocab_size: ChatGLMv2's vocabulary size (the other configs keep it as an unused attribute)
        config = getattr(transformers, config_cls)(**dict(T.CONFIGS["llama"], padded_vocab_size=T.VOCAB, **extra))
        paddle.seed(0)
        with mock.patch.object(dist.ParallelEnv, "device_id", property(lambda self: 0)), unique_name.guard():
            return getattr(transformers, model_cls)(config)

    found = dict(untied=pieces(T.build_pipe_model()))
    with mock.patch.dict(T.CONFIGS, llama=dict(T.CONFIGS["llama"], tie_word_embeddings=True)):
        found["tied_one_stage_skipped"] = swap_fused_layers(T.build_pipe_model(), backend="reference").skipped
        tied = T.build_pipe_model()
    head = LlamaLMHeadPipe(tied.config, transpose_y=True)
    head.weight = tied.shared_layers["llama_shared_weight"].embedding_weight  # fleet's shared-weight sync
    tied.run_function[-1] = head
    tied.add_sublayer(str(len(tied.run_function) - 1), head)
    found["tied"] = pieces(tied)
    found["tied"]["shares_embedding_weight"] = tied.run_function[-1].embedding_weight is head.weight
    for family in ("qwen2", "qwen"):
        found[family] = pieces(family_pipe(*PIPE_FAMILIES[family]))
    found["chatglm_v2_skipped"] = swap_fused_layers(family_pipe(*PIPE_FAMILIES["chatglm_v2"]),
                                                    backend="reference").skipped
    return found


def _tensor_parallel_body():
    """LLaMA, tensor parallel 2 + sequence parallel: our layers with Paddle's AdamW; the same with
    FusedAdamW; our layers with recompute (granularity full; the others run in one process)."""
    from paddlenlp_fused.testing import trainer as T

    args = T.make_args(os.path.join(os.environ[OUT_ENV], "tp"), tensor_parallel_degree=2, sequence_parallel=True)
    results = {"layers": _run("llama", args, True, False), "fused_adamw": _run("llama", args, True, True)}
    # Last: a run after a recompute run in the same gloo processes times out at its first all-reduce.
    args.recompute = True  # what --recompute sets; the Trainer reads it when it is built
    results["recompute_full"] = _counting_recompute(
        lambda: _run("llama", args, True, False, recompute=True, recompute_granularity="full"))
    _write("tensor_parallel", results)


def _sharding_body():
    """GPT, sharding stage 1 over 2 ranks: plain; our layers with Paddle's AdamW; our layers with
    FusedAdamW. Then the pipeline model's pieces (fleet is initialised without model parallelism here)."""
    from paddlenlp_fused.testing import trainer as T

    args = T.make_args(os.path.join(os.environ[OUT_ENV], "sharding"), sharding="stage1", per_device_train_batch_size=1)
    results = {"plain": _run("gpt", args, False, False), "layers": _run("gpt", args, True, False),
               "fused_adamw": _run("gpt", args, True, True), "pipeline": _pipeline_pieces()}
    _write("sharding_stage1", results)


def _checkpoint_runs(out):
    """GPT with our layers and FusedAdamW, one process: 4 steps; 2 steps saved (save_steps=2); resumed
    from that checkpoint to step 4."""
    from paddlenlp_fused.testing import trainer as T

    saving = dict(save_strategy="steps", save_steps=2)
    return {"gpt_plain": _run("gpt", T.make_args(out / "gpt_plain"), False, False),
            "gpt_fused": _run("gpt", T.make_args(out / "gpt_fused"), True, True),
            "gpt_saved": _run("gpt", T.make_args(out / "gpt_ckpt", max_steps=2, **saving), True, True),
            "gpt_resumed": _run("gpt", T.make_args(out / "gpt_ckpt", **saving), True, True,
                                resume_from_checkpoint=str(out / "gpt_ckpt" / "checkpoint-2"))}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every run: the single-process ones here, each layout in one launch of 2 processes."""
    from paddlenlp_fused.testing import trainer as T

    out = tmp_path_factory.mktemp("trainer")
    os.environ[OUT_ENV] = str(out)
    try:
        found = {"single_process": {
            "llama_plain": _run("llama", T.make_args(out / "llama"), False, False),
            "mamba_plain": _run("mamba", T.make_args(out / "mamba"), False, False),
            "mamba_fused": _run("mamba", T.make_args(out / "mamba_fused"), True, True),
        }}
        found["single_process"].update(_checkpoint_runs(out))
        amp = dict(bf16=True, fp16_opt_level="O2", amp_master_grad=True)  # fp32 on CPU: Paddle's AMP is GPU-only
        found["single_process"]["llama_master_grad"] = _run("llama", T.make_args(out / "amp", **amp), True, True)
        for granularity in GRANULARITIES[1:]:
            found["single_process"][f"llama_recompute_{granularity}"] = _counting_recompute(lambda: _run(
                "llama", T.make_args(out / granularity, recompute=True), True, True, recompute=True,
                recompute_granularity=granularity))
        for body in (_tensor_parallel_body, _sharding_body):
            run_distributed(body, timeout=400)
    finally:
        del os.environ[OUT_ENV]
    for layout in ("tensor_parallel", "sharding_stage1"):
        ranks = [json.load(open(out / f"{layout}.{rank}.json")) for rank in range(2)]
        for name, run in ranks[0].items():  # rank 0's run, failed where any rank's failed
            if name == "pipeline":
                continue
            errors = [f"rank {rank}: {r[name]['error']}" for rank, r in enumerate(ranks) if "error" in r[name]]
            if errors:
                run["error"] = "\n".join(errors)
        found[layout] = ranks[0]
    return found


def _ok(run):
    assert "error" not in run, run["error"]
    return run


def assert_same_run(new, ref, steps=None):
    """Loss and gradient norm of every step (``steps``: a slice of the reference's), final parameters."""
    new, ref = _ok(new), _ok(ref)
    cut = steps or slice(None)
    ref_losses, ref_norms = ref["losses"][cut], ref["grad_norms"][cut]
    assert len(new["losses"]) == len(ref_losses) and ref_losses, (new["losses"], ref_losses)
    np.testing.assert_allclose(new["losses"], ref_losses, rtol=LOSS_RTOL)
    assert len(new["grad_norms"]) == len(ref_norms), ("global norms recorded", new["grad_norms"], ref_norms)
    np.testing.assert_allclose(new["grad_norms"], ref_norms, rtol=NORM_RTOL)
    assert new["params"].keys() == ref["params"].keys()
    flat_new = np.concatenate([np.ravel(new["params"][k]) for k in sorted(ref["params"])])
    flat_ref = np.concatenate([np.ravel(ref["params"][k]) for k in sorted(ref["params"])])
    assert np.isfinite(flat_new).all()
    err = np.linalg.norm(flat_new - flat_ref) / np.linalg.norm(flat_ref)
    assert err <= PARAM_RTOL, err
    assert np.max(np.abs(flat_new - flat_ref)) <= 4 * PARAM_RTOL * np.max(np.abs(flat_ref))


def test_single_process_mamba_fused_layers_and_fused_adamw(results):
    runs = results["single_process"]
    assert runs["mamba_fused"]["optimizer"] == "FusedAdamW" and runs["mamba_plain"]["optimizer"] == "AdamW"
    assert "mamba_mixer" in runs["mamba_fused"]["kinds"]
    assert_same_run(runs["mamba_fused"], runs["mamba_plain"])


def test_tensor_parallel_sequence_parallel(results):
    """Our layers under tensor parallel 2 + sequence parallel equal the single-process plain run."""
    run = results["tensor_parallel"]["layers"]
    assert_same_run(run, results["single_process"]["llama_plain"])


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_recompute(results, granularity):
    """recompute=True at each granularity (full: under tensor + sequence parallel with Paddle's AdamW;
    full_attn, core_attn: one process, FusedAdamW) equals the plain run without recompute."""
    run = results["tensor_parallel"]["recompute_full"] if granularity == "full" else \
        results["single_process"][f"llama_recompute_{granularity}"]
    assert run.get("recompute_calls", 0) > 0, ("the model ran without recompute", run.get("error"))
    assert_same_run(run, results["single_process"]["llama_plain"])


def test_sharding_stage1(results):
    runs = results["sharding_stage1"]
    assert_same_run(runs["layers"], runs["plain"])


def test_single_process_gpt_fused_layers_and_fused_adamw(results):
    runs = results["single_process"]
    assert runs["gpt_fused"]["optimizer"] == "FusedAdamW"
    assert_same_run(runs["gpt_fused"], runs["gpt_plain"])


def test_amp_master_grad(results):
    """--amp_master_grad wraps the optimizer in fleet's MixPrecisionOptimizer (gradients in main_grad),
    on CPU too, where Paddle applies no AMP: our layers and FusedAdamW inside it equal the plain run."""
    run = results["single_process"]["llama_master_grad"]
    assert run.get("optimizer") == "FusedAdamW", run
    assert_same_run(run, results["single_process"]["llama_plain"])


def test_checkpoint_resume(results):
    """save_steps=2, then resume_from_checkpoint (model, FusedAdamW's state, scheduler, data position):
    the resumed steps continue the uninterrupted run."""
    runs = results["single_process"]
    saved, resumed, whole = _ok(runs["gpt_saved"]), _ok(runs["gpt_resumed"]), _ok(runs["gpt_fused"])
    np.testing.assert_allclose(saved["losses"], whole["losses"][:2], rtol=LOSS_RTOL)
    assert_same_run(resumed, whole, steps=slice(2, None))


@pytest.mark.parametrize("layout,reference", [("tensor_parallel", ("single_process", "llama_plain")),
                                              ("sharding_stage1", ("sharding_stage1", "plain"))])
def test_fused_adamw_under_fleet(results, layout, reference):
    """Our layers and FusedAdamW inside fleet's HybridParallelOptimizer (tensor parallel: the global norm
    by HybridParallelClipGrad) and DygraphShardingOptimizer (its _apply_optimize) equal the plain run
    (issue 28 items 1-2: per-rank clipping, NotImplementedError in sharding before the fix)."""
    run = results[layout]["fused_adamw"]
    assert_same_run(run, results[reference[0]][reference[1]])
    assert run["optimizer"] == "FusedAdamW"


@pytest.mark.parametrize("case", ["untied", "tied", "qwen2", "qwen"])
def test_pipeline_model_swap(results, case):
    """swap_fused_layers on a PipelineLayer (LlamaForCausalLMPipe untied and tied, Qwen2's, QWen's) swaps the
    stage layers' MLP and norms, the last stage's LM head and the pipe's loss function (linear_cross_entropy, no
    logits in the training forward; tied: the head holds the embedding's weight, as the last stage does), and
    the pipe's loss and every gradient stay the plain ones; the eval forward's logits are the plain ones."""
    pipe = results["sharding_stage1"]["pipeline"][case]
    if case in ("untied", "tied"):
        assert pipe["stages"] == ["LlamaEmbeddingPipe", "LlamaDecoderLayerPipe", "LlamaRMSNormPipe",
                                  "FusedLMHeadPipe"], pipe["stages"]
        assert pipe["swapped"].get("llama_mlp") == 1 and pipe["swapped"].get("rms_norm") == 3, pipe["swapped"]
    if case == "tied":  # the attribute fleet's SharedLayerDesc(shared_weight_attr="embedding_weight") reads
        assert pipe["shares_embedding_weight"]
    assert pipe["stages"][-1] == "FusedLMHeadPipe", pipe["stages"]
    assert pipe["swapped"].get("lm_head") == 1 and pipe["swapped"].get("criterion") == 1, pipe["swapped"]
    loss_paths = [change for path, change in pipe["paths"] if path == "_loss_fn[0]"]
    assert len(loss_paths) == 1 and loss_paths[0].endswith("PretrainingCriterion -> FusedCausalLMCriterion"), loss_paths
    assert pipe["deferred"] == "DeferredLogits" and not pipe["skipped"], (pipe["deferred"], pipe["skipped"])
    assert pipe["eval_logits_err"] <= PARAM_RTOL, pipe["eval_logits_err"]  # the swapped norms and MLP round apart
    (loss_ref, grads_ref), (loss, grads) = pipe["plain"], pipe["fused"]
    assert abs(loss - loss_ref) <= LOSS_RTOL * abs(loss_ref)
    assert grads.keys() == grads_ref.keys() and grads
    total = np.sqrt(sum(np.sum(np.square(g)) for g in grads_ref.values()))
    for name, ref in grads_ref.items():
        ref, new = np.asarray(ref), np.asarray(grads[name])
        assert np.isfinite(new).all(), name
        assert np.linalg.norm(new - ref) <= PARAM_RTOL * max(np.linalg.norm(ref), 1e-3 * total), name
        assert np.max(np.abs(new - ref)) <= 4 * PARAM_RTOL * max(np.max(np.abs(ref)), 1e-3 * total), name


@pytest.mark.parametrize("case,words", [("tied_one_stage", "shared embedding layer"),
                                        ("chatglm_v2", "[seq, batch, vocab] transposed")])
def test_pipeline_head_left_reported(results, case, words):
    """What the swap leaves in a pipe model, it reports once, with the reason: PaddleNLP's tied pipe model on
    one stage runs its shared embedding layer as the last stage (its own forward fails); ChatGLMv2's head
    returns transposed logits."""
    skipped = results["sharding_stage1"]["pipeline"][f"{case}_skipped"]
    heads = [why for path, why in skipped if "embedding" in why or "head" in why.lower()]
    assert len(heads) == 1 and words in heads[0], skipped


def test_fleet_contract_covered(results):
    """Every layer of FLEET_CONTRACT is swapped in by a run of each layout it names (the runs' equality
    is the other tests')."""
    for kind, layouts in FLEET_CONTRACT.items():
        for layout in layouts:
            held = set().union(*(run.get("kinds", ()) for name, run in results[layout].items()
                                 if name != "pipeline" and "error" not in run))
            assert kind in held, (kind, layout, sorted(held))
