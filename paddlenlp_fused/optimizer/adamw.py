"""FusedAdamW: ``paddle.optimizer.AdamW`` with 16-bit moments, fp32 master weights and one Triton
launch per dtype group.

The update is AdamW's (see ``kernels/triton/adamw.py``): decoupled weight decay, bias correction
from per-parameter ``beta^t`` kept in float32 as Paddle does, learning-rate schedulers, parameter
groups, per-group ``grad_clip``, ``apply_decay_param_fun``, ``lr_ratio`` and AMP's ``found_inf``.
What changes is the storage: the first and second moments are kept in ``moment_dtype`` (bfloat16
by default; half the bytes of Paddle's float32 moments), rounded stochastically so that they stay
unbiased, and float16/bfloat16 parameters get float32 master weights when ``multi_precision``.

State-dict layout follows Paddle's AdamW, so checkpoints move between the two (moments written in
``checkpoint_moment_dtype``, float32 by default as Paddle's AdamW asserts, and cast to
``moment_dtype`` on load): ``{name}_moment1_0``, ``{name}_moment2_0`` (``{name}_moment2_max_0``
with AMSGrad), ``{name}_beta1_pow_acc_0``,
``{name}_beta2_pow_acc_0`` where ``name`` is the parameter's name, or its master weight's
(``{param}_fp32_master_0``) when it has one; ``"master_weights"``: {param name: fp32 tensor};
``"LR_Scheduler"``; plus ``STEP_KEY``: int64 [step, seed] of the stochastic-rounding stream, so a
reloaded run continues with the same random numbers.

Inside fleet's wrappers: the clip is read at step time, so ``HybridParallelClipGrad`` (and the
sharding optimizers' clips) that fleet installs in ``_grad_clip`` after construction apply, also
to parameter groups that took the constructor's clip; ``_apply_optimize`` applies exactly the
(param, grad) pairs or the parameter-group dict that ``DygraphShardingOptimizer`` and
``MixPrecisionOptimizer`` pass, ``main_grad`` included; the parameter list is read at step time
(sharding narrows it to this rank's). The kernel path keeps its per-parameter-set tables for the
``TABLE_CACHE_SIZE`` most recent sets, so routing that changes which parameters have a gradient
(MoE) does not grow them.

Host work per step: Python over the parameters (gradients, hyper-parameters, the offsets table of
the addresses, ~5 us a parameter) and one upload of the per-tensor scalar table, which Paddle copies
synchronously: the GPU idles for the host work that follows it in the step (the launch itself).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import numpy as np
import paddle
from paddle.base.dygraph.base import in_to_static_mode
from paddle.nn.clip import GradientClipBase
from paddle.optimizer import Optimizer
from paddle.optimizer.lr import LambdaDecay, LRScheduler

from ..kernels.triton.adamw import (MOMENT_DTYPES, adamw_multi_tensor, check_group, hyper_table, offsets_table,
                                    plan_chunks, step_seed, table_aligned)
from ..ops._checks import check_eps
from ..reference.adamw import HostGroup, KernelGroup, adamw_multi_tensor_ref
from ..runtime import tensor as T
from ..runtime.backend import BACKENDS, BackendUnavailableError, resolve_backend
from ..runtime.triton_paddle import triton_args, triton_scoped

STEP_KEY = "FusedAdamW.step_seed"
_SIXTEEN_BIT = ("float16", "bfloat16")
_GROUP_KEYS = ("params", "learning_rate", "weight_decay", "beta1", "beta2", "epsilon", "grad_clip", "lazy_mode")
IMPLEMENTED = ("triton", "reference")
_AMSGRAD_ON_KERNEL = ("amsgrad: FusedAdamW's Triton kernel has no AMSGrad yet; use backend='reference' (a host "
                      "update, slow on a GPU) or paddle.optimizer.AdamW(amsgrad=True)")


def _float(name: str, value) -> float:
    """A Python float from a float/int or a one-element Tensor (Paddle's AdamW takes both)."""
    if isinstance(value, paddle.Tensor):
        if value.size != 1:
            raise ValueError(f"{name}: expected a scalar or a one-element Tensor, got shape {list(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def _check_finite(name: str, value: float) -> None:
    """NaN or inf would silently turn every updated parameter into NaN."""
    if not np.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value}")


def _check_hyper(beta1: float, beta2: float, epsilon: float, weight_decay: float, where: str = "") -> None:
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{where}{name}: expected a value in [0, 1), got {value}")
    check_eps(f"{where}epsilon", epsilon)
    _check_finite(f"{where}weight_decay", weight_decay)


def _dtype_name(dtype) -> str:
    name = T.dtype_name(dtype) if not isinstance(dtype, str) else dtype
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}.get(
        name, name)


TABLE_CACHE_SIZE = 8  # sets of parameters whose kernel tables are kept; a step uses one per dtype group


class _LRU:
    """At most ``size`` entries; ``put`` makes an entry the most recent, evicting the oldest."""

    def __init__(self, size: int) -> None:
        self.size, self._entries = size, OrderedDict()

    def get(self, key):
        return self._entries.get(key)

    def put(self, key, value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class _ParamState:
    """Optimizer state of one parameter. ``key``: the name its state-dict entries start with."""

    __slots__ = ("key", "exp_avg", "exp_avg_sq", "exp_avg_sq_max", "master", "beta1_pow", "beta2_pow")

    def __init__(self, key, exp_avg, exp_avg_sq, exp_avg_sq_max, master, beta1_pow, beta2_pow):
        self.key, self.exp_avg, self.exp_avg_sq, self.master = key, exp_avg, exp_avg_sq, master
        self.exp_avg_sq_max = exp_avg_sq_max
        self.beta1_pow, self.beta2_pow = np.float32(beta1_pow), np.float32(beta2_pow)


def _assign_from(dst: paddle.Tensor, src, what: str) -> None:
    """Copy a state-dict value (Tensor or array) into ``dst`` in place, cast to dst's dtype."""
    value = src if isinstance(src, paddle.Tensor) else paddle.to_tensor(np.asarray(src))
    if list(value.shape) != list(dst.shape):
        raise ValueError(f"state_dict[{what!r}]: expected shape {list(dst.shape)}, got {list(value.shape)}")
    if str(value.place) != str(dst.place):
        value = value._copy_to(dst.place, True)
    paddle.assign(value.astype(dst.dtype), output=dst)


def _scalar_of(src) -> np.float32:
    value = src.numpy() if isinstance(src, paddle.Tensor) else np.asarray(src)
    return np.float32(value.reshape(-1)[0])


class FusedAdamW(Optimizer):
    r"""AdamW with moments in ``moment_dtype`` and one fused launch per dtype group.

    Args (as ``paddle.optimizer.AdamW`` unless said):
        learning_rate (float|LRScheduler), beta1, beta2, epsilon (float or one-element Tensor),
        parameters (list of Tensors, or of dicts with ``params`` and any of ``learning_rate`` (a
        scale of the base rate), ``weight_decay``, ``beta1``, ``beta2``, ``epsilon``,
        ``grad_clip``), weight_decay (float), grad_clip (GradientClipBase),
        apply_decay_param_fun (callable name -> bool), lr_ratio (callable param -> float).
        moment_dtype: "bfloat16" (default), "float16" or "float32". float16 moments can underflow
            (the second moment of gradients below ~2e-4); bfloat16 keeps float32's range.
        multi_precision: fp32 master weights for float16/bfloat16 parameters (default True).
        stochastic_rounding: round 16-bit moments (and 16-bit parameters without master weights)
            stochastically, unbiased (default True); else round to nearest-even.
        backend: "auto" (Triton on GPU and under TRITON_INTERPRET=1, else the reference),
            "triton" or "reference".
        amsgrad: AMSGrad as Paddle's AdamW (divide by the running maximum of the second moment,
            kept in ``moment_dtype``, state-dict key ``{name}_moment2_max_0``). The reference
            backend only: the Triton kernel does not have it yet (NotImplementedError).
        checkpoint_moment_dtype: the dtype ``state_dict()`` writes the moments in: "float32"
            (default: the checkpoint loads into ``paddle.optimizer.AdamW``, which asserts float32
            moments) or None for ``moment_dtype`` (16-bit moments halve their bytes in the
            checkpoint; only FusedAdamW loads it). Loading casts to ``moment_dtype`` either way.
    """

    def __init__(self, learning_rate: float | LRScheduler = 0.001, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 parameters=None, weight_decay=0.01, grad_clip: Optional[GradientClipBase] = None,
                 moment_dtype="bfloat16", multi_precision: bool = True, stochastic_rounding: bool = True,
                 apply_decay_param_fun: Optional[Callable[[str], bool]] = None,
                 lr_ratio: Optional[Callable[[paddle.Tensor], float]] = None, name: Optional[str] = None,
                 backend: str = "auto", amsgrad: bool = False,
                 checkpoint_moment_dtype: Optional[str] = "float32") -> None:
        if parameters is None:
            raise ValueError("parameters: FusedAdamW runs in dygraph mode and needs the parameters to update, got None")
        if isinstance(learning_rate, int) and not isinstance(learning_rate, bool):
            learning_rate = float(learning_rate)
        if not isinstance(learning_rate, (float, LRScheduler)):
            raise TypeError(f"learning_rate: expected a float or an LRScheduler, got {type(learning_rate).__name__}")
        if isinstance(learning_rate, float):
            _check_finite("learning_rate", learning_rate)
        beta1, beta2, epsilon = _float("beta1", beta1), _float("beta2", beta2), _float("epsilon", epsilon)
        weight_decay = _float("weight_decay", weight_decay)
        _check_hyper(beta1, beta2, epsilon, weight_decay)
        moment_dtype = _dtype_name(moment_dtype)
        if moment_dtype not in MOMENT_DTYPES:
            raise ValueError(f"moment_dtype: expected one of {list(MOMENT_DTYPES)}, got {moment_dtype!r}")
        for arg, fn in (("apply_decay_param_fun", apply_decay_param_fun), ("lr_ratio", lr_ratio)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{arg}: expected a callable or None, got {type(fn).__name__}")
        if backend not in ("auto",) + BACKENDS:
            raise ValueError(f"backend: expected one of {['auto', *BACKENDS]}, got {backend!r}")
        if backend != "auto" and backend not in IMPLEMENTED:  # as every op says it (resolve_backend), but early
            raise BackendUnavailableError(f"FusedAdamW: no {backend!r} implementation; this op has {list(IMPLEMENTED)}")
        if not isinstance(amsgrad, bool):
            raise TypeError(f"amsgrad: expected a bool, got {type(amsgrad).__name__}")
        if amsgrad and backend == "triton":
            raise NotImplementedError(_AMSGRAD_ON_KERNEL)
        if checkpoint_moment_dtype is not None:
            checkpoint_moment_dtype = _dtype_name(checkpoint_moment_dtype)
            if checkpoint_moment_dtype not in MOMENT_DTYPES:
                raise ValueError(f"checkpoint_moment_dtype: expected one of {list(MOMENT_DTYPES)} or None, got "
                                 f"{checkpoint_moment_dtype!r}")
        if grad_clip is not None and not isinstance(grad_clip, GradientClipBase):
            raise TypeError(f"grad_clip: expected a paddle.nn.ClipGradBy* instance, got {type(grad_clip).__name__}")

        # read by _add_param_group, which Optimizer.__init__ calls for parameter groups
        self._group_defaults = {"weight_decay": weight_decay, "beta1": beta1, "beta2": beta2, "epsilon": epsilon,
                                "grad_clip": grad_clip}
        super().__init__(learning_rate=learning_rate, parameters=parameters, weight_decay=None, grad_clip=grad_clip,
                         name=name)
        self.type = "fused_adamw"
        self._moment_dtype = moment_dtype
        self._multi_precision = bool(multi_precision)
        self._stochastic_rounding = bool(stochastic_rounding)
        self._apply_decay_param_fun = apply_decay_param_fun
        self._lr_ratio = lr_ratio
        self._backend = backend
        self._amsgrad = amsgrad
        self._checkpoint_moment_dtype = checkpoint_moment_dtype
        self._states: Dict[str, _ParamState] = OrderedDict()
        self._step_count = 0
        # the stochastic-rounding stream follows paddle.seed without drawing from Paddle's generator
        self._seed = int(paddle.base.core.default_cpu_generator().initial_seed()) & 0xFFFFFFFF
        # device tables per set of parameters with a gradient: MoE routing changes that set from
        # step to step, so only the most recently used few are kept
        self._tables = _LRU(TABLE_CACHE_SIZE)
        self._host_groups: Dict[tuple, HostGroup | KernelGroup] = {}
        for param in self._all_params():
            if T.dtype_name(param) not in T.FLOAT_DTYPES:
                raise TypeError(f"parameters: expected dtypes in {list(T.FLOAT_DTYPES)}, got {T.dtype_name(param)} "
                                f"for {param.name}")

    # -- parameter groups --------------------------------------------------------------------------

    def _add_param_group(self, param_group: dict) -> None:
        unknown = sorted(set(param_group) - set(_GROUP_KEYS))
        if unknown:
            raise ValueError(f"parameters: unknown parameter-group options {unknown}; expected some of {_GROUP_KEYS}")
        params = param_group["params"]
        if isinstance(params, paddle.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("parameters: a group's 'params' must be an ordered collection (list), got a set")
        param_group["params"] = list(params)
        for key, value in self._group_defaults.items():
            param_group.setdefault(key, value)
        for key in ("weight_decay", "beta1", "beta2", "epsilon"):
            param_group[key] = _float(f"parameters[{len(self._param_groups)}][{key!r}]", param_group[key])
        if "learning_rate" in param_group:  # a scale of the base rate
            name = f"parameters[{len(self._param_groups)}]['learning_rate']"
            param_group["learning_rate"] = _float(name, param_group["learning_rate"])
            _check_finite(name, param_group["learning_rate"])
        _check_hyper(param_group["beta1"], param_group["beta2"], param_group["epsilon"], param_group["weight_decay"],
                     where=f"parameters[{len(self._param_groups)}] ")
        if param_group.get("lazy_mode", False):
            raise NotImplementedError("parameters: lazy_mode (sparse updates) is not supported by FusedAdamW")
        seen = {id(p) for group in self._param_groups for p in group["params"]}
        if any(id(p) in seen for p in param_group["params"]):
            raise ValueError("parameters: some parameters appear in more than one parameter group")
        for param in param_group["params"]:
            param.optimize_attr["learning_rate"] = param_group.get("learning_rate", 1.0)
        self._param_groups.append(param_group)

    def _groups(self) -> List[dict]:
        # fleet's sharding wrappers replace _parameter_list and _param_groups with this rank's
        # parameters (a list, not groups), so both are read at step time
        if self._param_groups and isinstance(self._param_groups[0], dict):
            return self._param_groups
        return [dict(self._group_defaults, params=self._parameter_list)]

    def _clip_of(self, group: dict) -> Optional[GradientClipBase]:
        """The clip a group applies now. A group holding the constructor's clip follows
        ``self._grad_clip``, which fleet's wrappers replace after construction
        (``HybridParallelClipGrad``, ``GroupShardedClipGrad``); a clip the group was given itself,
        or that a wrapper put into the group, stays the group's, as in Paddle's Optimizer."""
        clip = group.get("grad_clip", self._group_defaults["grad_clip"])
        return self._grad_clip if clip is self._group_defaults["grad_clip"] else clip

    def _all_params(self):
        return [p for group in self._groups() for p in group["params"]]

    # -- state ---------------------------------------------------------------------------------------

    def _state_for(self, param: paddle.Tensor, group: dict) -> _ParamState:
        state = self._states.get(param.name)
        if state is None:
            has_master = self._multi_precision and T.dtype_name(param) in _SIXTEEN_BIT
            master = None
            key = param.name
            if has_master:
                key = f"{param.name}_fp32_master_0"
                master = param.astype("float32").contiguous()
                master.name = key
            suffix = f"_{self._name}" if self._name else ""
            exp_avg = paddle.zeros_like(param, dtype=self._moment_dtype)
            exp_avg_sq = paddle.zeros_like(param, dtype=self._moment_dtype)
            exp_avg.name, exp_avg_sq.name = f"{key}{suffix}_moment1_0", f"{key}{suffix}_moment2_0"
            exp_avg_sq_max = None
            if self._amsgrad:
                exp_avg_sq_max = paddle.zeros_like(param, dtype=self._moment_dtype)
                exp_avg_sq_max.name = f"{key}{suffix}_moment2_max_0"
            # beta^t of the coming step, as Paddle's AdamW initialises its beta-pow accumulators
            state = _ParamState(key, exp_avg, exp_avg_sq, exp_avg_sq_max, master, group["beta1"], group["beta2"])
            self._states[param.name] = state
            if master is not None:
                self._master_weights[param.name] = master
        return state

    def _state_keys(self, state: _ParamState) -> Dict[str, str]:
        suffix = f"_{self._name}" if self._name else ""
        fields = ("moment1", "moment2") + (("moment2_max",) if self._amsgrad else ()) + (
            "beta1_pow_acc", "beta2_pow_acc")
        return {field: f"{state.key}{suffix}_{field}_0" for field in fields}

    def state_dict(self) -> dict:
        """Moments (in ``checkpoint_moment_dtype``), beta-pow accumulators (CPU float32 [1]), master
        weights, LR scheduler, step/seed. Master tensors, and moments kept in the checkpoint's dtype,
        are the live ones (as Paddle's; ``paddle.save`` copies them); cast moments are copies."""
        out = {}
        cpu = paddle.CPUPlace()
        dtype = self._checkpoint_moment_dtype or self._moment_dtype
        for state in self._states.values():
            keys = self._state_keys(state)
            moments = [("moment1", state.exp_avg), ("moment2", state.exp_avg_sq)]
            if self._amsgrad:
                moments.append(("moment2_max", state.exp_avg_sq_max))
            for field, moment in moments:
                out[keys[field]] = moment if dtype == self._moment_dtype else moment.astype(dtype)
            out[keys["beta1_pow_acc"]] = paddle.to_tensor([state.beta1_pow], dtype="float32", place=cpu)
            out[keys["beta2_pow_acc"]] = paddle.to_tensor([state.beta2_pow], dtype="float32", place=cpu)
        masters = {name: state.master for name, state in self._states.items() if state.master is not None}
        if masters:
            out["master_weights"] = masters
        if isinstance(self._learning_rate, LRScheduler):
            out["LR_Scheduler"] = self._learning_rate.state_dict()
        out[STEP_KEY] = paddle.to_tensor([self._step_count, self._seed], dtype="int64", place=cpu)
        return out

    def set_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` of FusedAdamW or of ``paddle.optimizer.AdamW`` (moments cast to
        ``moment_dtype``). Parameters with no entry keep fresh state; an entry that matches no
        parameter (renamed parameters, another model) raises ValueError."""
        entries = dict(state_dict)
        scheduler_state = entries.pop("LR_Scheduler", None)
        if isinstance(self._learning_rate, LRScheduler):
            if scheduler_state is None and not isinstance(self._learning_rate, LambdaDecay):
                raise ValueError("state_dict: 'LR_Scheduler' missing while this optimizer uses an LRScheduler")
            if scheduler_state:
                self._learning_rate.set_state_dict(scheduler_state)
        masters = entries.pop("master_weights", None) or {}
        step_and_seed = entries.pop(STEP_KEY, None)
        if step_and_seed is not None:
            values = step_and_seed.numpy() if isinstance(step_and_seed, paddle.Tensor) else np.asarray(step_and_seed)
            self._step_count, self._seed = int(values[0]), int(values[1])
        used = set()
        for group in self._groups():
            for param in group["params"]:
                state = self._state_for(param, group)
                keys = self._state_keys(state)
                present = [key for key in keys.values() if key in entries]
                if not present:
                    continue
                if len(present) != len(keys):
                    missing = sorted(set(keys.values()) - set(present))
                    raise ValueError(f"state_dict: entries {missing} missing for parameter {param.name}")
                _assign_from(state.exp_avg, entries[keys["moment1"]], keys["moment1"])
                _assign_from(state.exp_avg_sq, entries[keys["moment2"]], keys["moment2"])
                if self._amsgrad:
                    _assign_from(state.exp_avg_sq_max, entries[keys["moment2_max"]], keys["moment2_max"])
                state.beta1_pow = _scalar_of(entries[keys["beta1_pow_acc"]])
                state.beta2_pow = _scalar_of(entries[keys["beta2_pow_acc"]])
                if state.master is not None and param.name in masters:
                    _assign_from(state.master, masters[param.name], f"master_weights/{param.name}")
                used.update(keys.values())
        unmatched = sorted(set(entries) - used)
        if unmatched:
            raise ValueError(f"state_dict: entries {unmatched[:4]}{'...' if len(unmatched) > 4 else ''} match no "
                             "parameter of this optimizer (were the parameters created under other names?)")

    load_state_dict = set_state_dict

    # -- the step ------------------------------------------------------------------------------------

    @staticmethod
    def _grad_of(param: paddle.Tensor):
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param._grad_ivar()
        return grad

    def _params_and_grads(self):
        """[(param, grad, group)] of the parameters that have a gradient, after each group's clip
        and any per-parameter regularizer (as Paddle's Optimizer applies them)."""
        out = []
        for group in self._groups():
            pairs = [(param, self._grad_of(param)) for param in group["params"] if not param.stop_gradient]
            out += self._clipped(pairs, group, self._clip_of(group))
        return out

    def _clipped(self, pairs, group: dict, clip: Optional[GradientClipBase]):
        """[(param, grad, group)] of ``pairs`` with a gradient, after ``clip`` and the regularizers."""
        pairs = [(param, grad) for param, grad in pairs if grad is not None]
        for param, grad in pairs:
            if hasattr(grad, "is_selected_rows") and grad.is_selected_rows():
                raise NotImplementedError(f"FusedAdamW: sparse (SelectedRows) gradient of {param.name} is not "
                                          "supported")
        if not pairs:
            return []
        if clip is not None:
            pairs = clip(pairs)
        pairs = self.append_regularization_ops(pairs, None)
        return [(param, grad, group) for param, grad in pairs]

    def _found_inf(self) -> bool:
        """AMP's GradScaler hands over found_inf; a step with inf/nan gradients is skipped (Paddle)."""
        found_inf = self._get_auxiliary_var("found_inf")
        if isinstance(found_inf, paddle.Tensor):
            skip = bool(found_inf)
            self._set_auxiliary_var("found_inf", skip)
            return skip
        return bool(found_inf)

    @paddle.no_grad()
    def step(self) -> None:
        """One AdamW step of every parameter that has a gradient."""
        self._check_eager("step")
        if self._found_inf():
            return
        self._update(self._params_and_grads())

    @staticmethod
    def _check_eager(what: str) -> None:
        if in_to_static_mode() or not paddle.in_dynamic_mode():
            raise NotImplementedError(f"FusedAdamW.{what}: FusedAdamW updates parameters eagerly (dygraph); it "
                                      "has no static-graph program (paddle.jit.to_static, paddle.static)")

    @paddle.no_grad()
    def _apply_optimize(self, loss, startup_program, params_grads, param_group_idx=0):
        """Apply exactly ``params_grads``, as fleet's ``DygraphShardingOptimizer`` (this rank's
        shard) and ``MixPrecisionOptimizer`` (``main_grad``) call it: a list of (param, grad),
        clipped by ``self._grad_clip``, or a parameter group's dict (``params``: the pairs, plus the
        group's options), clipped by its own clip. Honours AMP's found_inf. Returns no ops (dygraph)."""
        self._check_eager("_apply_optimize")
        if self._found_inf():
            return []
        if isinstance(params_grads, dict):
            group = dict(self._group_defaults)
            group.update((key, value) for key, value in params_grads.items() if key != "params")
            work = self._clipped(self._live(params_grads["params"]), group, self._clip_of(group))
        else:
            group_of = {id(param): group for group in self._groups() for param in group["params"]}
            pairs = self._live(params_grads)
            work = [(param, grad, group_of.get(id(param), self._group_defaults))
                    for param, grad, _ in self._clipped(pairs, self._group_defaults, self._grad_clip)]
        self._update(work)
        return []

    @staticmethod
    def _live(pairs):
        return [(param, grad) for param, grad in pairs if not param.stop_gradient]

    def _update(self, work) -> None:
        """One AdamW step of ``work``: [(param, grad, group)], already clipped."""
        if not work:
            return
        self._step_count += 1
        lr = float(self.get_lr())
        states, hyper = [], []
        for param, grad, group in work:
            if grad.shape != param.shape:
                raise ValueError(f"grad of {param.name}: expected shape {list(param.shape)}, got {list(grad.shape)}")
            if not param.is_contiguous():
                raise ValueError(f"parameters: {param.name} must be contiguous, got strides {list(param.strides)}")
            state = self._state_for(param, group)
            decays = self._apply_decay_param_fun is None or self._apply_decay_param_fun(param.name)
            param_lr = lr * float(param.optimize_attr.get("learning_rate", 1.0))
            if self._lr_ratio is not None:
                param_lr *= float(self._lr_ratio(param))
            states.append(state)
            hyper.append((param_lr, group["weight_decay"] if decays else 0.0, group["beta1"], group["beta2"],
                          group["epsilon"], state.beta1_pow, state.beta2_pow))
        table = np.array(hyper, dtype=np.float32)  # the values as float32, as Paddle holds them
        backend = resolve_backend("FusedAdamW", self._backend, T.device_kind(work[0][0]),
                                  implemented=IMPLEMENTED)
        if backend == "reference":
            self._step_reference(work, states, table)
        elif self._amsgrad:
            raise NotImplementedError(_AMSGRAD_ON_KERNEL)
        else:
            self._step_triton(work, states, hyper_table(table))
        # beta^t of the next step, float32 products as Paddle's accumulators
        for state, beta1_pow, beta2_pow in zip(states, table[:, 5] * table[:, 2], table[:, 6] * table[:, 3]):
            state.beta1_pow, state.beta2_pow = beta1_pow, beta2_pow

    @staticmethod
    def _dtype_groups(work, states) -> Dict[tuple, List[int]]:
        """Indices into ``work`` by (param dtype, grad dtype, master or not): one update each."""
        # matched by identity before equality: Paddle 3.3's dtypes are singletons, and hashing or
        # comparing one is a Python-level call (a few us, per parameter and step)
        groups: List[tuple] = []
        for i, ((param, grad, _), state) in enumerate(zip(work, states)):
            p_dtype, g_dtype, master = param.dtype, grad.dtype, state.master is not None
            for (p, g, m), members in groups:
                if m == master and (p is p_dtype or p == p_dtype) and (g is g_dtype or g == g_dtype):
                    members.append(i)
                    break
            else:
                groups.append(((p_dtype, g_dtype, master), [i]))
        return OrderedDict(groups)

    def _step_reference(self, work, states, table) -> None:
        """One host update per dtype group, its random streams keyed by the step and the group. CPU
        groups keep their ``KernelGroup`` (float32 params and grads, no masters: Paddle's AdamW
        kernel) or ``HostGroup`` (numpy) from step to step while it still describes them; groups on
        other places go through host copies."""
        for index, (kind, members) in enumerate(self._dtype_groups(work, states).items()):
            params = [work[i][0] for i in members]
            grads = [work[i][1] for i in members]
            exp_avgs = [states[i].exp_avg for i in members]
            exp_avg_sqs = [states[i].exp_avg_sq for i in members]
            masters = [states[i].master for i in members] if kind[2] else None
            maxes = [states[i].exp_avg_sq_max for i in members] if self._amsgrad else None
            random_key = (self._seed, self._step_count, index)
            group = self._host_groups.get(kind)
            if group is None or not group.describes(params, exp_avgs, exp_avg_sqs, masters, maxes):
                # (tensors that moved to another place have other addresses: checked again here)
                if not all(p.place.is_cpu_place() for p in params):
                    adamw_multi_tensor_ref(params, grads, exp_avgs, exp_avg_sqs, masters, hyper_table(table[members]),
                                           self._stochastic_rounding, random_key, maxes)
                    continue
                # (Paddle's fused_adam_ kernel has no AMSGrad)
                on_kernel = kind[0] == paddle.float32 and kind[1] == paddle.float32 and not kind[2] and maxes is None
                group = self._host_groups[kind] = KernelGroup(params, exp_avgs, exp_avg_sqs) if on_kernel else \
                    HostGroup(params, exp_avgs, exp_avg_sqs, masters, maxes)
            group.step(grads, table[members] if isinstance(group, KernelGroup) else hyper_table(table[members]),
                       self._stochastic_rounding, random_key)

    @triton_scoped
    def _step_triton(self, work, states, rows) -> None:
        """One launch per dtype group. A group is checked in full when first seen; later steps check
        only the grads (shape in step(), contiguity and dtype here), so the host work per step stays
        small next to the kernel."""
        seed = step_seed(self._seed, self._step_count)
        for index, (kind, members) in enumerate(self._dtype_groups(work, states).items()):
            params = [work[i][0] for i in members]
            grads = [work[i][1] if work[i][1].is_contiguous() else work[i][1].contiguous() for i in members]
            exp_avgs = [states[i].exp_avg for i in members]
            exp_avg_sqs = [states[i].exp_avg_sq for i in members]
            masters = [states[i].master for i in members] if kind[2] else None
            place = params[0].place
            plan_key = kind + tuple((p.name, int(p.size)) for p in params)
            tables = self._tables.get(plan_key)
            if tables is None:
                check_group(params, grads, exp_avgs, exp_avg_sqs, masters)
                chunk_tensor, first_chunk = plan_chunks([int(p.size) for p in params])
                tables = [paddle.to_tensor(chunk_tensor, place=place), first_chunk, None]
            self._tables.put(plan_key, tables)
            chunk_tensor, first_chunk, cached = tables
            offsets = offsets_table(params, grads, exp_avgs, exp_avg_sqs, masters, first_chunk)
            if cached is None or not np.array_equal(cached[0], offsets):  # grads move when reallocated
                cached = tables[2] = (offsets, paddle.to_tensor(offsets, place=place),
                                      table_aligned(offsets, params, grads, exp_avgs, exp_avg_sqs, masters))
            # a synchronous host-to-device copy in Paddle: the GPU waits for the rest of this step's
            # host work (small once validated); see the module docstring
            hyper = paddle.to_tensor(np.ascontiguousarray(rows[members]), place=place)
            n = len(members)
            flat = triton_args(*params, *grads, *exp_avgs, *exp_avg_sqs, *(masters or []), chunk_tensor, cached[1],
                               hyper)
            lists = [list(flat[k * n:(k + 1) * n]) for k in range(4)]
            lists.append(list(flat[4 * n:5 * n]) if masters is not None else None)
            adamw_multi_tensor(*lists, *flat[-3:], seed=seed, stream=2 * index,
                               stochastic_rounding=self._stochastic_rounding, validate=False, aligned=cached[2])

    # -- the rest of Paddle's Optimizer interface ----------------------------------------------------

    def minimize(self, loss, startup_program=None, parameters=None, no_grad_set=None):
        """Dygraph ``minimize``: gradients must already be computed (``loss.backward()``), as with
        Paddle's dygraph optimizers; then one ``step()``."""
        if parameters is not None or no_grad_set is not None:
            raise NotImplementedError("FusedAdamW.minimize: 'parameters' and 'no_grad_set' are not supported; "
                                      "build the optimizer on the parameters to update")
        params_grads = [(p, self._grad_of(p)) for p in self._all_params() if not p.stop_gradient]
        self.step()
        return [], params_grads

    def _append_optimize_op(self, block, param_and_grad):
        raise NotImplementedError("FusedAdamW runs in dygraph mode only (no static-graph optimize op)")
