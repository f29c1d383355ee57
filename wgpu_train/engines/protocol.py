"""The one protocol between an engine (the NumPy reference engine, engines/numpy/engine.py; the WebGPU engine,
webgpu/engine.py) and what drives it (model.py, generate.py, training/): everything
those may read or call on an engine, and nothing else (tests/test_engine_protocol.py holds them to it).
(Over 450 lines on purpose: the one protocol, every method's contract in one place.)"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig

# Prompt tokens per prefill call of generation (generate.py): an engine's activations grow with the tokens of one
# call, and ragged prompts may be cut anywhere, since each chunk's keys land in the cache before the next chunk
# reads them. The WebGPU engine sizes its attention scratch for these on CPU adapters.
PREFILL_TOKENS = 256


class NamedValue(str, Enum):
    """An option's value parsed once (Precision, quant.StorageDtype, kv_dtype.KvDtype): a str, so it compares
    with, prints, hashes and serialises as its name. A subclass names its option (`class Precision(NamedValue,
    option="precision")`) for parse's one-line refusal."""

    def __init_subclass__(cls, option: str | None = None, **kw):
        super().__init_subclass__(**kw)
        cls._option = option or cls.__name__

    @classmethod
    def parse(cls, value):
        """value (a name or a member) as a member; ConfigError (one line) naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{cls._option} must be one of {', '.join(m.value for m in cls)}, "
                              f"got {value!r}") from None

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:          # as its name's: a dict or set of names finds it
        return hash(self.value)


class Precision(NamedValue, option="precision"):
    """--precision, parsed once where it enters (TrainConfig, load_model, the engines, estimate_memory) and then
    carried with its traits: where an engine stores activations, saved tensors and activation gradients
    (engine.precision; arithmetic is float32 in each). fp32, bf16, or f16 (with dynamic loss scaling, LossScaler);
    AUTO is resolved by engines/loading.py before an engine takes it. A str, so it compares with, prints and
    serialises as its name (summary.json, train_config.json)."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"
    F16 = "f16"

    @property
    def resolved(self) -> bool:
        """Not AUTO: an engine can run it."""
        return self is not Precision.AUTO

    @property
    def sixteen_bit(self) -> bool:
        """Activations stored in 16 bits (bf16, f16): rounded where they are stored, two to a 32-bit word on the
        GPU (so widths must be even), and the LoRA modules of a layer run one by one."""
        return self in (Precision.BF16, Precision.F16)

    @property
    def loss_scaling(self) -> bool:
        """f16: its range needs dynamic loss scaling, and a forward whose activations overflow it is refused."""
        return self is Precision.F16

    @property
    def storage(self) -> str:
        """The storage format of its 16-bit activation buffers (engines/webgpu/device/storage.py): f32, bf16, f16."""
        if not self.resolved:
            raise ValueError("Precision.AUTO has no storage: engines/loading.py resolves it first")
        return "f32" if self is Precision.FP32 else self.value


# the precisions an engine runs, and the names --precision takes
PRECISIONS = (Precision.FP32, Precision.BF16, Precision.F16)
PRECISION_CHOICES = tuple(p.value for p in Precision)

def check_precision_widths(precision: Precision | str, cfg: ModelConfig):
    """Refuse (ConfigError, one line) a 16-bit precision on the WebGPU engine for a model with an odd width: its
    kernels store 16-bit activations two to a 32-bit word, a row's pairs never shared with the next row (every
    checkpoint on the hub has even widths)."""
    if not Precision.parse(precision).sixteen_bit:
        return
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim}
    widths.update(cfg.moe.widths() if cfg.moe is not None else {})
    widths.update(cfg.linear_attention.even_widths if cfg.linear_attention is not None else {})
    odd = [f"{name} {value}" for name, value in widths.items() if value % 2]
    if odd:
        raise ConfigError(f"--precision {precision} on the WebGPU engine needs even widths (this model has "
                          f"{', '.join(odd)}); use --precision fp32 or --backend numpy")


@runtime_checkable
class Engine(Protocol):
    """Arrays cross this boundary as NumPy arrays; tensors are keyed by Hugging Face names (weights) or module
    paths (LoRA). Step inputs are the data.Batch fields (ids, targets, segment ids, position ids)."""

    name: str                   # "numpy" or "wgpu"
    backend_reason: str         # why this engine (backend auto's choice), for the log and summary.json
    cfg: ModelConfig
    base_dtype: str             # storage of the frozen linear weights and of the embedding / lm_head: each a
    embed_dtype: str            # shared/quant.StorageDtype (a str), resolved
    precision: Precision        # where activations are stored: fp32, bf16 or f16 (engines/numpy/precision.py)
    precision_reason: str       # why that precision (auto's choice), for the log and summary.json
    kv_dtype: str               # how new_kv_cache stores keys and values: a shared/kv_dtype.KvDtype (a str)
    loss_scaler: "LossScaler | None"   # f16's dynamic loss scaling (None in fp32 / bf16)
    counters: dict              # real call counts: submits, readbacks, bytes up / down, non-finite steps skipped,
    #                             loss heads run with the adapter on (policy_forwards) and off (reference_forwards)
    step_logps: list            # after train_step: per micro-batch, the (B, T) float32 log-probabilities its loss
    #                             head computed where its fifth element was a Token- or SequenceObjective (else None)
    step_entropies: list        # and there the (B, T) float32 entropies of the policy's distributions at the loss
    #                             temperature (GRPO's "entropy" metric; 0 where a position has no target)
    last_profile: dict          # op group -> GPU seconds of the last profiled step ({} without one)
    last_aux_loss: "float | None"   # after train_step: the router's auxiliary loss (set_router_aux_loss), or None
    base_weight_bytes: int      # bytes the frozen weights take on the device (0: no device copy)
    max_binding: int | None     # largest storage binding of the device (None: no device)
    device_description: str     # where it computes, for the log
    adapter_banks: bool         # whether set_adapter_bank takes a bank (rows of mixed adapters in forward_rows)

    # ---- what is trained ----
    def set_lora(self, modules: dict) -> None:
        """{module path: (A (r, in), B (out, r), scale, dropout)}, or with DoRA (..., dropout, magnitude (out,))
        (dora.split_entry): attach LoRA there (replacing any)."""

    def lora_tensors(self) -> dict:
        """{module path: (A, B)} as float32 arrays."""

    def set_full_finetune(self, enabled: bool = True) -> None:
        """Train every base weight (set_trained_base of all of them), or none."""

    def set_trained_base(self, names, untie: bool = False) -> None:
        """Train these base weights (HF names, stored in float32 from now on) beside any LoRA; the others are
        frozen. untie (a tied model): lm_head.weight becomes a tensor of its own, a copy of the embedding;
        False ties them again (modules_to_save, saved_modules.py)."""

    def set_gradient_checkpointing(self, on: bool = True) -> None: ...

    def set_adapter_enabled(self, enabled: bool = True) -> None:
        """False: every forward skips the LoRA modules (the base model, PEFT's disable_adapter: a preference
        objective's reference model); True again to train."""

    def set_router_aux_loss(self, coef: float = 0.0) -> None:
        """A mixture of experts' training forwards add coef times transformers' load-balancing loss (its router's
        auxiliary loss; a train_step divides it among its micro-batches); 0 (the default) turns it off.
        last_aux_loss then holds the last train_step's (None when off). ConfigError for coef > 0 on a dense
        model."""

    def set_loss_temperature(self, temperature: float = 1.0) -> None:
        """The loss head of training steps and token_losses scores logits / temperature (GRPO's log-probabilities
        at its sampling temperature, as TRL's GRPOTrainer takes them); loss() and generation keep the model's
        own logits. 1 (the default) changes nothing, bit for bit."""

    def seed_dropout(self, seed: int) -> None:
        """Restart the LoRA dropout masks from `seed` (they hash seed, micro-batch count and module)."""

    def trainable(self) -> dict:
        """The trainable tensors by name (LoRA: path + ".lora_A" / ".lora_B", DoRA's path +
        ".lora_magnitude_vector"; trained base weights: HF names)."""

    def set_trainable(self, tensors: dict) -> None: ...

    def weights(self) -> dict:
        """The base weights as float32 (dequantised where stored in float16 / NF4)."""

    def set_base_weights(self, weights: dict) -> None:
        """Replace some base weights ({HF name: float32 array} of their shapes), stored as the engine stores
        them (rounded to float16 / NF4 where it keeps that storage): PiSSA / OLoRA's residual base."""

    # ---- computing ----
    def logits(self, ids, segment_ids, position_ids): ...

    def loss(self, ids, targets, segment_ids, position_ids):
        """(summed loss, trained tokens) of one batch, no gradients."""

    def token_losses(self, ids, targets, segment_ids, position_ids, reference=False):
        """(B, T) float32, no gradients: each position's loss, minus the log-probability of its target (0 where
        the target is ignored). A sequence's log-probability is minus the sum of its row. With reference, a pair
        (the policy's, the reference's) of them: the reference is the engine with its adapter switched off
        (set_adapter_enabled(False), a preference objective's reference), scored in the same engine call (the
        WebGPU engine: one submission and one readback for both)."""

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        """Accumulate d(sum of grad_scale * token loss) into the gradients, grad_scale one number or a weight per
        token (B, T); (summed loss, unweighted; trained tokens)."""

    def zero_grads(self) -> None: ...

    def gradients(self) -> dict: ...

    def train_step(self, micro_batches, hp, step: int, profile: bool = False, reduce=None):
        """One optimizer step over micro-batches (gradients accumulated, clipped, AdamW with hp at `step`);
        (loss_sum, trained tokens, grad_norm, applied) of these micro-batches. A micro-batch is (ids, targets,
        segment_ids, position_ids), or with a fifth element, weights (B, T) float32 that multiply each token's
        gradient (a preference objective's coefficients), or a TokenObjective: the loss head then computes each
        token's log-probability, the weight from it (TokenObjective.terms) and the backward with it, in the
        same forward, and keeps the log-probabilities in step_logps (read back with the step's losses), or a
        SequenceObjective: the host's function of the micro-batch's log-probabilities gives its weights between
        the loss head's forward and its backward (step_logps keeps those too); either way the gradients are
        divided by the micro-batches' trained tokens. A micro-batch may end with its images: ImageTokens (their
        embeddings), or TowerImages (their pixels), which the engine's vision tower (set_vision_tower, where the
        engine has one) runs inside the step, its LoRA (where set) trained with the engine's (reduced, clipped and
        updated together).

        reduce (data parallelism): None, or a callable (gradients, tokens) -> gradients. After the backward of
        every micro-batch, the gradients (normalised by these micro-batches' trained tokens) cross it once, as
        one flat float32 array in an order fixed by the engine, with that token count; the array it returns
        (same size) replaces them before the clipping and AdamW. Without it a step reads nothing back but
        its losses and norm.

        With a loss_scaler (f16) the loss gradient is multiplied by its scale and the gradients are unscaled
        before `reduce`; a step with a non-finite gradient is skipped (applied False) and the scaler updated."""

    # ---- state a checkpoint keeps ----
    def optimizer_state(self) -> dict: ...

    def load_optimizer_state(self, state: dict) -> None: ...

    def state_dict(self) -> dict:
        """Plain-JSON state beyond tensors that a resumed run must restore (the dropout position; f16's loss
        scale)."""

    def load_state_dict(self, state: dict) -> None: ...

    # ---- generation ----
    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """A cache of `batch` rows of up to max_len positions, its keys and values stored as self.kv_dtype."""

    def free_kv_cache(self, kv: dict) -> None: ...

    def forward_rows(self, ids, rows, positions, kv: dict, last, long_rope=None, adapters=None):
        """adapters: (n,) each token's adapter in the bank set_adapter_bank gave (negative: none), or None."""

    def set_adapter_bank(self, bank: dict | None) -> None:
        """Adapters for rows of mixed adapters in forward_rows ({module path: shared.mixed_lora.BankModule}, the
        engine's own LoRA off), or None to drop them."""


@runtime_checkable
class PipelineStage(Protocol):
    """An Engine over a contiguous range of a model's layers (distributed/pipeline_engine.py drives S of them as
    one Engine): the embedding on the first stage, the final norm, head and loss on the last. Activations and
    their gradients cross a boundary as engines/shared/boundary.py packs them, in the run's precision. `micro`
    numbers a training micro-batch within its step (None: a forward that keeps nothing for a backward); a stage
    keeps each training forward's activations until that micro-batch's backward, so a schedule may run several
    forwards before their backwards (GPipe, 1F1B). Besides these, a stage answers the Engine protocol for its
    own tensors (set_lora, trainable, optimizer_state, ... of its layers only)."""

    span: range                 # the layers it holds
    first: bool                 # holds the embedding: its input is token ids (B, T)
    last: bool                  # holds the final norm and head: it computes the loss

    def stage_forward(self, micro, inputs, segment_ids, position_ids):
        """A stage before the last: its output (N, C), packed, from ids (B, T) (the first stage) or the previous
        stage's packed output."""

    def stage_balance(self, micro, previous=None):
        """After a training forward with the router's aux loss on: its layers' load-balancing statistics (2E + 1,)
        float64 (assignments, probability sums per expert, real tokens; zeros without a sparse layer) + previous."""

    def stage_loss(self, micro, inputs, targets, segment_ids, position_ids, grad_scale, objective=None,
                   balance=None, aux_weight=0.0):
        """The last stage: its forward, the loss, and its backward with grad_scale per token (one number or (B, T),
        as forward_backward's; a training step's times f16's loss scale), with a TokenObjective times the weights
        its head computes; (summed loss, trained tokens, the packed gradient of its input (None on a first stage or
        without a trained token), the (B, T) float32 log-probabilities and entropies (objective only, else None),
        the whole forward's stage_balance (None without aux_weight: the router aux loss's weight, its own
        statistics added to the earlier stages' `balance`))."""

    def stage_backward(self, micro, d_outputs, balance=None, aux_weight=0.0):
        """The packed gradient of its input (None on the first stage, which accumulates the embedding's, if
        trained) from that of its output (None: no trained token, nothing to add; the forward's activations are
        dropped either way); its routers' aux loss from stage_loss's `balance` at aux_weight."""

    def stage_scores(self, inputs, targets, segment_ids, position_ids, rows: bool):
        """The last stage, no gradients: logits (B, T, V) without targets; with them, token_losses' (B, T) rows
        (rows) or loss()'s (summed loss, trained tokens)."""

    def stage_set_images(self, micro, images) -> None:
        """The images (a shared/image_tokens.ImageTokens, or None) of micro-batch `micro` (None: the forwards that
        keep nothing, a prefill's too): their blocks and M-RoPE positions in every stage's layers, the DeepStack
        features of the layers it holds, their embeddings in the first stage's rows (whose backward keeps the
        image rows' gradient, image_grad); a training micro-batch's dropped after its backward."""

    def stage_set_reference(self, modules: dict) -> None:
        """Hold a reference adapter's modules of its layers (set_lora's entries) beside its own (--ref-adapter)."""

    def stage_use_reference(self, on: bool) -> None:
        """Forwards with the reference adapter in place of its own (on; its own state kept) or its own (off)."""

    def stage_unscale(self) -> None:
        """f16: its gradients unscaled (times 1 / the loss scale), before they are summed, reduced or measured."""

    def stage_grad_square(self, leave_out=()) -> float:
        """The sum of the squares of its gradients but those named in leave_out: the driver adds every stage's for
        the global norm that clipping takes."""

    def set_gradients(self, grads: dict) -> None:
        """Overwrite some of its gradients by name (gradients() gives them): a tied embedding's summed over the
        two stages that train it, or the data-parallel workers' reduced."""

    def stage_update(self, norm: float, hp: "OptimizerParams", step: int) -> bool:
        """Clip by the global `norm`, then AdamW on its tensors (skipped for a non-finite norm); whether applied."""

    def stage_new_cache(self, key: int, batch: int, max_len: int) -> None:
        """Generation: a KV cache of its layers under the driver's key (new_kv_cache's sizes)."""

    def stage_free_cache(self, key: int) -> None: ...

    def stage_rows(self, key: int, inputs, rows, positions, last, long_rope: bool):
        """forward_rows through its layers (arguments checked by the driver): the packed output (n, C), or on the
        last stage the logits (m, V) float32 of the tokens at `last`."""

    def weight_names(self) -> list:
        """The base weights it holds."""

    def weight(self, name: str):
        """One of them, float32 (as weights() gives it)."""


class LossScaler:
    """f16's dynamic loss scaling with torch.amp.GradScaler's semantics: the loss gradient is multiplied by
    `scale` (an engine's grad_scale), the gradients are unscaled (times 1 / scale, exact: a power of two) before
    the clipping and AdamW; a step with an inf / nan gradient is skipped and the scale multiplied by
    backoff_factor; after growth_interval clean steps in a row it is multiplied by growth_factor."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0          # clean steps since the scale last changed

    def update(self, finite: bool):
        """After a step: back off on a non-finite gradient (the step was skipped), grow after enough clean ones."""
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"loss_scale": self.scale, "loss_scale_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict):
        self.scale = float(state.get("loss_scale", self.scale))
        self.growth_tracker = int(state.get("loss_scale_growth_tracker", 0))


class EngineState:
    """What both engines keep between steps beyond tensors, with the protocol's methods: the LoRA dropout
    position (the masks hash (seed, micro-batches drawn so far, module)) and, in f16, the loss scaler."""

    dropout_seed = 0
    dropout_calls = 0
    adapter_banks = True
    loss_scaler: LossScaler | None = None

    def seed_dropout(self, seed: int):
        self.dropout_seed, self.dropout_calls = int(seed) & 0xFFFFFFFF, 0

    def state_dict(self) -> dict:
        state = {"dropout_seed": int(self.dropout_seed), "dropout_calls": int(self.dropout_calls)}
        return {**state, **self.loss_scaler.state_dict()} if self.loss_scaler is not None else state

    def load_state_dict(self, state: dict):
        self.dropout_seed = int(state.get("dropout_seed", self.dropout_seed))
        self.dropout_calls = int(state.get("dropout_calls", 0))
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state)


# the protocol's attributes and methods by name
MEMBERS = frozenset(list(Engine.__annotations__) + [k for k in vars(Engine) if not k.startswith("_")])


@dataclass(frozen=True)
class OptimizerParams:
    """AdamW hyper-parameters of one step (the learning rate comes from the schedule)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    lora_b_lr_ratio: float = 1.0     # LoRA+: the learning rate of the LoRA B matrices over lr (the A matrices')


TOKEN_LOSSES = ("clipped", "cispo", "sapo")     # TokenObjective.loss: the per-token policy losses an engine computes


@dataclass(frozen=True)
class TokenObjective:
    """A micro-batch's per-token objective, train_step's fifth element in place of weights (GRPO's loss types at
    the token importance-sampling level, training/objectives/grpo.py): the engine's loss head computes each
    token's log-probability logp in its forward, then its gradient weight

        w = -scale * d(token loss) / d logp

    and the cross-entropy backward with w (a token's cross-entropy is -logp, so that is the objective's
    gradient): one forward. A token's loss is its policy loss of the log importance ratio r = logp - old
    (0 without old_logps: TRL's detached ratio of 1) and its row's advantage A,
      clipped: -min(e^r A, clip(e^r, 1 - epsilon_low, 1 + epsilon_high) A);
      cispo:   -min(e^r, epsilon_high) A logp, the clamped factor constant;
      sapo:    -sigmoid(tau (e^r - 1)) 4 / tau A, tau = temperature_pos where A > 0, else temperature_neg;
    plus beta times the k3 estimator of the KL to the reference, e^(ref - logp) - (ref - logp) - 1, times e^r
    where bias_correction_kl (its ratio differentiated too)."""

    scale: np.ndarray                   # (B, T) d(step loss) / d(token loss) times the step's trained tokens
    advantages: np.ndarray              # (B,) each row's advantage
    old_logps: np.ndarray | None        # (B, T) the sampling policy's log-probabilities (None: the ratio is 1)
    ref_logps: np.ndarray | None        # (B, T) the reference's (beta != 0)
    loss: str = "clipped"               # one of TOKEN_LOSSES
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    bias_correction_kl: bool = True
    temperature_pos: float = 1.0
    temperature_neg: float = 1.05

    def __post_init__(self):
        if self.loss not in TOKEN_LOSSES:
            raise ValueError(f"TokenObjective.loss must be one of {', '.join(TOKEN_LOSSES)}, got {self.loss!r}")
        if self.beta and self.ref_logps is None:
            raise ValueError("TokenObjective: beta != 0 needs ref_logps")

    def terms(self) -> np.ndarray:
        """(B*T, 4) float32, a row per token: [scale, advantage, old logp, reference logp] (0 where absent), what
        the engines' token_objective_backward reads beside the loss head's rows."""
        shape = np.shape(self.scale)
        out = np.zeros(shape + (4,), np.float32)
        out[..., 0] = self.scale
        out[..., 1] = np.asarray(self.advantages, np.float32).reshape(-1, 1)
        if self.old_logps is not None:
            out[..., 2] = self.old_logps
        if self.ref_logps is not None:
            out[..., 3] = self.ref_logps
        return out.reshape(-1, 4)


@dataclass(frozen=True)
class SequenceObjective:
    """A micro-batch's objective whose coefficients couple its tokens or rows (a sequence's or a pair's summed
    log-probability: DPO, SimPO, ORPO), train_step's fifth element in place of weights: the engine runs the
    forward and the loss head's forward, passes the head's log-probabilities to `weights` on the host and runs
    the backward with what it returns, without a second forward (the WebGPU engine submits the step up to the
    head there and reads the log-probabilities back: one more submission and readback per micro-batch; it
    recomputes the head's logits where they take more than one chunk). The log-probabilities are kept in
    step_logps too."""

    weights: Callable[[np.ndarray], np.ndarray]    # (B, T) float32 log-probabilities (0 where no target) -> (B, T)
