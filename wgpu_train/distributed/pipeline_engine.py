"""PipelineEngine: S pipeline stages (engines' PipelineStage, each holding a range of layers, in this process or
as Ray actors) driven as one Engine, so that the Trainer, checkpoints and Model run unchanged over them; the
step's schedule (GPipe or 1F1B over its micro-batches), the router's load-balancing statistics summed across stages
and the global-norm clipping across stages. (Over 450 lines: one Engine, so every call of the protocol (training,
scoring, generation, images, the router's statistics) is routed through the stages here.)"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.protocol import LossScaler, OptimizerParams, SequenceObjective, TokenObjective
from wgpu_train.engines.shared.moe import check_router_aux_loss, load_balancing_value
from wgpu_train.engines.shared.image_tokens import ImageTokens
from wgpu_train.engines.shared.kv_rows import check_rows
from wgpu_train.errors import ConfigError
from wgpu_train.models.stage_plan import EMBED, StagePlan

SCHEDULES = ("gpipe", "1f1b")


class StageLost(RuntimeError):
    """A stage's process died (its Ray actor): the run restarts its stages from the last checkpoint."""


def stage_ops(schedule: str, stages: int, micro: int) -> list:
    """Each stage's ops in the order it runs them: ("F", j) a forward of micro-batch j, ("B", j) its backward,
    ("L", j) the last stage's forward, loss and backward at once. GPipe: every forward, then every backward;
    1F1B: stage s runs min(S - 1 - s, M) forwards ahead, then one forward and one backward in turn, so it holds
    at most S - s micro-batches' activations. Either way the backwards run in the forwards' order, so each stage
    sums a step's gradients in the order one process does."""
    out = []
    for s in range(stages):
        if s == stages - 1:
            out.append([("L", j) for j in range(micro)])
            continue
        ahead = micro if schedule == "gpipe" else min(stages - 1 - s, micro)
        ops = [("F", j) for j in range(ahead)]
        for j in range(micro - ahead):
            ops += [("F", ahead + j), ("B", j)]
        out.append(ops + [("B", j) for j in range(micro - ahead, micro)])
    return out


class LocalStages:
    """Stages in this process, each call run at once (the oracle of the Ray actors, and a pipeline's arithmetic
    without Ray)."""

    def __init__(self, stages: list):
        self.stages = list(stages)

    def __len__(self) -> int:
        return len(self.stages)

    def call(self, s: int, method: str, *args, returns: int = 1):
        return getattr(self.stages[s], method)(*args)

    def get(self, values):
        return values

    def attr(self, s: int, name: str):
        return getattr(self.stages[s], name)

    def close(self):
        self.stages = []


class PipelineEngine:
    """The Engine protocol over the stages of `plan`, reached through `runner` (LocalStages, or
    pipeline_ray.RayStages: each call a Ray actor task whose arguments may be the results of other stages'
    tasks, so the stages run a schedule concurrently). A tensor goes to the stage that holds it
    (StagePlan.holds); what every stage keeps alike (the dropout position) is read from the first."""

    last_profile: dict = {}
    max_binding = None
    base_weight_bytes = 0
    adapter_banks = False       # a server switches its adapters one at a time (serve/adapters.py)

    def __init__(self, runner, plan: StagePlan, schedule: str = "1f1b"):
        if schedule not in SCHEDULES:
            raise ConfigError(f"pipeline_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.runner, self.plan, self.schedule = runner, plan, schedule
        self._shared: tuple = ()        # trained weights that two stages hold (a tied embedding trained as one)
        self._caches = 0                # generation's KV caches made so far (each stage keeps its part by key)
        self.router_aux_coef = 0.0      # set_router_aux_loss's
        self._images = None             # set_images' (every stage holds them)
        self.step_logps: list = []
        self.step_entropies: list = []
        for name in ("name", "cfg", "dtype", "base_dtype", "embed_dtype", "precision_reason", "kv_dtype",
                     "backend_reason"):
            setattr(self, name, runner.attr(0, name))
        resolved = [runner.attr(s, "precision") for s in range(len(plan))]
        self.precision = resolved[0]
        if len(set(resolved)) > 1:      # --precision auto on adapters of different kinds
            raise ConfigError(f"the pipeline stages resolved --precision to {', '.join(map(str, resolved))} on "
                              f"their devices: give --precision, one for every stage")
        self.device_description = "; ".join(f"stage {s} (layers {span.start}-{span.stop - 1}): "
                                            f"{runner.attr(s, 'device_description')}"
                                            for s, span in enumerate(plan.stages))

    # ---- tensors, by the stage that holds them --------------------------------------------------------
    def _all(self, method: str, *args) -> list:
        return self.runner.get([self.runner.call(s, method, *args) for s in range(len(self.plan))])

    def _split(self, method: str, tensors: dict, *args):
        self._all_each(method, [{k: v for k, v in tensors.items() if self.plan.holds(s, k)}
                                for s in range(len(self.plan))], *args)

    def _all_each(self, method: str, per_stage: list, *args):
        self.runner.get([self.runner.call(s, method, part, *args) for s, part in enumerate(per_stage)])

    def _merged(self, method: str) -> dict:
        out = {}
        for s, part in enumerate(self._all(method)):
            out.update({k: v for k, v in part.items() if self.plan.owner(k) == s})
        return out

    @property
    def counters(self) -> dict:
        """Every stage's counters summed (each stage's loss head counts once: the last stage's)."""
        out: dict = {}
        for part in (self.runner.attr(s, "counters") for s in range(len(self.plan))):
            for k, v in part.items():
                out[k] = out.get(k, 0) + v
        return out

    def set_lora(self, modules: dict):
        self._split("set_lora", modules)

    def lora_tensors(self) -> dict:
        return self._merged("lora_tensors")

    def set_full_finetune(self, enabled: bool = True):
        """Every stage trains every weight it holds (or none); a tied embedding on both end stages as one."""
        self._all("set_full_finetune", enabled)
        self._shared = (EMBED,) if enabled and self._tied_ends() else ()

    def set_trained_base(self, names, untie: bool = False):
        """Each stage trains the named weights it holds. A tied model's untied head is the last stage's own copy
        of the embedding (its first stage's embedding then trains there alone); a tied embedding that stays
        the head trains on both end stages as one tensor: its gradients summed, the same update on both."""
        last = len(self.plan) - 1
        for s in range(len(self.plan)):
            mine = tuple(n for n in names if self.plan.holds(s, n) and (n != EMBED or s == 0 or not untie))
            self.runner.get(self.runner.call(s, "set_trained_base", mine, untie and s == last))
        self._shared = (EMBED,) if EMBED in names and not untie and self._tied_ends() else ()

    def _tied_ends(self) -> bool:
        """Whether the first and last stages both hold the embedding (a tied model over two stages or more)."""
        return self.plan.tied and len(self.plan) > 1

    def _sum_shared(self):
        """The tied embedding's gradient of both end stages summed into both (the first's lookup, the last's
        head), so that both take the same update; the last leaves it out of its squared norm."""
        if not self._shared:
            return
        last = len(self.plan) - 1
        first_g, last_g = self.runner.get([self.runner.call(s, "gradients") for s in (0, last)])
        total = {name: first_g[name] + last_g[name] for name in self._shared}
        self.runner.get([self.runner.call(s, "set_gradients", total) for s in (0, last)])

    def reduce_gradients(self, reduce, total: int):
        """The data-parallel reduction of every stage's gradients as one flat float32 array (the stages' order,
        each stage's own; a tied embedding once), its result put back into every stage that holds them."""
        grads = self.gradients()
        names = list(grads)
        flat = np.concatenate([grads[k].reshape(-1) for k in names]) if names else np.zeros(0, np.float32)
        out = np.asarray(reduce(flat, int(total)), dtype=np.float32)
        if out.shape != flat.shape:
            raise ValueError(f"train_step: reduce returned {out.shape[0]} gradients for {flat.shape[0]}")
        at, reduced = 0, {}
        for k in names:
            reduced[k] = out[at:at + grads[k].size].reshape(grads[k].shape)
            at += grads[k].size
        self._split("set_gradients", reduced)

    def set_gradient_checkpointing(self, on: bool = True):
        self._all("set_gradient_checkpointing", on)

    def set_adapter_enabled(self, enabled: bool = True):
        self._all("set_adapter_enabled", enabled)

    def set_loss_temperature(self, temperature: float = 1.0):
        self._all("set_loss_temperature", temperature)

    last_aux_loss = None

    def set_router_aux_loss(self, coef: float = 0.0):
        """The protocol's: each stage's training forwards count its layers' routing, and the driver hands every
        stage's counts of a micro-batch, summed, to each stage's backward (the loss is not a sum over layers: it
        multiplies the whole forward's assignments by its probabilities); last_aux_loss as one process's."""
        self.router_aux_coef = check_router_aux_loss(self.cfg, coef)
        self._all("set_router_aux_loss", self.router_aux_coef)

    def seed_dropout(self, seed: int):
        self._all("seed_dropout", seed)

    def trainable(self) -> dict:
        return self._merged("trainable")

    def set_trainable(self, tensors: dict):
        self._split("set_trainable", tensors)

    def weights(self) -> "StageWeights":
        """The base weights by name, each fetched from the stage that holds it when read (DoRA's start reads its
        modules' alone; only merging reads them all)."""
        return StageWeights(self)

    @property
    def loss_scaler(self):
        """f16's loss scaler as the stages keep it (each updates its own alike): a copy, for the log."""
        state = self.state_dict()
        if "loss_scale" not in state:
            return None
        scaler = LossScaler()
        scaler.load_state_dict(state)
        return scaler

    def set_base_weights(self, weights: dict):
        self._split("set_base_weights", weights)

    def zero_grads(self):
        self._all("zero_grads")

    def gradients(self) -> dict:
        return self._merged("gradients")

    def optimizer_state(self) -> dict:
        return self._merged("optimizer_state")

    def load_optimizer_state(self, state: dict):
        self._split("load_optimizer_state", state)

    def state_dict(self) -> dict:
        return self.runner.get(self.runner.call(0, "state_dict"))

    def load_state_dict(self, state: dict):
        self._all("load_state_dict", state)

    def set_images(self, images):
        """The forwards that follow take these images (a shared/image_tokens.ImageTokens), or none (None): every
        stage holds them (their blocks in its attention, their M-RoPE positions in its RoPE, their DeepStack
        features where it holds those layers, their embeddings in the first stage's rows: stage_set_images)."""
        self._images = images
        self._all("stage_set_images", None, images)

    @property
    def image_grad(self):
        """The image rows' gradient of the last backward (the first stage's): the vision tower's LoRA starts there."""
        return self.runner.attr(0, "image_grad")

    def apply_update(self, norm, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
                     lora_b_lr_ratio=1.0):
        """Every stage's clipping and AdamW update with the global norm given (the vision tower's LoRA's in it:
        engines/vision_model.py); (norm, applied)."""
        hp = OptimizerParams(lr, beta1, beta2, eps, weight_decay, max_grad_norm, lora_b_lr_ratio)
        return norm, bool(self._all("stage_update", norm, hp, step)[0])

    # ---- computing ------------------------------------------------------------------------------------
    def _scores(self, ids, targets, segment_ids, position_ids, rows: bool = False):
        x = ids
        for s in range(len(self.plan) - 1):
            x = self.runner.call(s, "stage_forward", None, x, segment_ids, position_ids)
        return self.runner.get(self.runner.call(len(self.plan) - 1, "stage_scores", x, targets, segment_ids,
                                                position_ids, rows))

    def logits(self, ids, segment_ids, position_ids):
        return self._scores(ids, None, segment_ids, position_ids)

    def loss(self, ids, targets, segment_ids, position_ids):
        return self._scores(ids, targets, segment_ids, position_ids)

    def token_losses(self, ids, targets, segment_ids, position_ids, reference=False):
        policy = self._scores(ids, targets, segment_ids, position_ids, rows=True)
        if not reference:
            return policy
        self.set_adapter_enabled(False)
        try:
            return policy, self._scores(ids, targets, segment_ids, position_ids, rows=True)
        finally:
            self.set_adapter_enabled(True)

    def reference(self, modules: dict) -> "ReferenceStages":
        """The stages scoring with the adapter `modules` (set_lora's entries: --ref-adapter's), each stage holding
        its layers' modules beside the policy's: an engine for the reference's token_losses."""
        self._split("stage_set_reference", modules)
        return ReferenceStages(self)

    def _run(self, micro_batches: list, scales: list, objectives: list, aux_weight: float = 0.0) -> tuple:
        """The forwards and backwards of a step's micro-batches in the schedule's order, each stage's calls
        submitted as soon as their inputs are (a Ray stage starts each when they exist); the per-token gradient
        scale of micro-batch j is scales[j], times the weights of its TokenObjective objectives[j] where not None.
        With the router's aux loss on, each micro-batch's weight of it is aux_weight: after each forward a stage
        adds its layers' load-balancing statistics to the earlier stages' (stage_balance), the last stage adds
        its own and returns the whole forward's, which every earlier stage's backward takes.
        (summed loss, trained tokens, each micro-batch's log-probabilities and entropies: None without objective,
        each micro-batch's aux loss: None when off)."""
        stages, call = len(self.plan), self.runner.call
        ops = stage_ops(self.schedule, stages, len(micro_batches))
        at, outs, grads, losses, firsts = [0] * stages, {}, {}, {}, []
        sums, totals = {}, {}       # (stage, micro-batch) -> the statistics so far; micro-batch -> the whole's
        while any(at[s] < len(ops[s]) for s in range(stages)):
            moved = False
            for s in range(stages):
                while at[s] < len(ops[s]):
                    kind, j = ops[s][at[s]]
                    ids, targets, seg, pos = micro_batches[j][:4]
                    if s and (s - 1, j) not in outs or kind == "B" and (s + 1, j) not in grads:
                        break
                    x = outs[(s - 1, j)] if s else ids
                    if kind == "F":
                        outs[(s, j)] = call(s, "stage_forward", j, x, seg, pos)
                        if aux_weight:
                            sums[(s, j)] = call(s, "stage_balance", j, sums.get((s - 1, j)))
                    elif kind == "L":
                        loss, count, grads[(s, j)], logps, entropies, totals[j] = call(
                            s, "stage_loss", j, x, targets, seg, pos, scales[j], objectives[j],
                            sums.get((s - 1, j)), aux_weight, returns=6)
                        losses[j] = (loss, count, logps, entropies)
                    else:
                        grads[(s, j)] = call(s, "stage_backward", j, grads[(s + 1, j)], totals[j], aux_weight)
                        if s == 0:
                            firsts.append(grads[(s, j)])
                    at[s] += 1
                    moved = True
            if not moved:
                raise RuntimeError(f"pipeline schedule {self.schedule} is stuck at {at}")
        m = len(micro_batches)
        done = self.runner.get([v for j in sorted(losses) for v in losses[j]] + [totals[j] for j in range(m)]
                               + firsts)   # errors surface here
        heads = [done[4 * j:4 * j + 4] for j in range(m)]     # (loss, count, logps, entropies)
        aux = [None if t is None else load_balancing_value(t, self.cfg.moe.num_experts) for t in done[4 * m:5 * m]]
        loss_sum = 0.0
        for loss, _, _, _ in heads:
            loss_sum += loss
        return loss_sum, sum(int(h[1]) for h in heads), [h[2] for h in heads], [h[3] for h in heads], aux

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        if self._images is not None:        # set_images': the stages hold them for micro-batch 0 too
            self._all("stage_set_images", 0, self._images)
        # the router's aux loss at the coefficient's full weight, as one process's forward_backward
        loss_sum, count, _, _, _ = self._run([(ids, targets, segment_ids, position_ids)], [grad_scale], [None],
                                             self.router_aux_coef)
        self._sum_shared()
        return loss_sum, count

    def train_step(self, micro_batches, hp, step: int, profile: bool = False, reduce=None):
        """The protocol's train_step through the stages: micro-batches (ids, targets, segment ids, positions[,
        weights (B, T) or a TokenObjective, whose weights the last stage computes from its loss head's
        log-probabilities][, their ImageTokens, which every stage holds]) in the schedule; `reduce` (data
        parallelism, the protocol's) takes every stage's gradients as one flat array; then every stage's squared
        gradient norm summed into the global norm that each stage clips by before its AdamW update."""
        for j, mb in enumerate(micro_batches):     # a micro-batch's images (its last item): each stage holds them
            if len(mb) > 4 and isinstance(mb[-1], ImageTokens):
                self._all("stage_set_images", j, mb[-1])
        micro_batches = [mb[:-1] if len(mb) > 4 and isinstance(mb[-1], ImageTokens) else mb for mb in micro_batches]
        if any(isinstance(mb[4], SequenceObjective) for mb in micro_batches if len(mb) > 4):
            raise ConfigError("pipeline stages take per-token weights or a TokenObjective, not a SequenceObjective "
                              "(a host function between the last stage's head and its backward)")
        total = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches)
        scaler = self.loss_scaler
        scale = 1.0 / max(total, 1) * (scaler.scale if scaler is not None else 1.0)
        self.zero_grads()
        objectives = [mb[4] if len(mb) > 4 and isinstance(mb[4], TokenObjective) else None for mb in micro_batches]
        scales = [np.float32(scale) * np.asarray(mb[4], np.float32) if len(mb) > 4 and o is None else scale
                  for mb, o in zip(micro_batches, objectives)]
        # the router's aux loss: each micro-batch's share of the step's, as the token loss's (f16: loss-scaled)
        aux_weight = self.router_aux_coef / len(micro_batches) * (scaler.scale if scaler is not None else 1.0)
        loss_sum, _, self.step_logps, self.step_entropies, aux = self._run(micro_batches, scales, objectives,
                                                                          aux_weight)
        self.last_aux_loss = float(np.mean(aux)) if aux_weight else None
        self._all("stage_unscale")
        self._sum_shared()
        if reduce is not None:
            self.reduce_gradients(reduce, total)
        last = len(self.plan) - 1
        norm = math.sqrt(sum(self.runner.get([self.runner.call(s, "stage_grad_square", self._shared if s == last
                                                               and s else ()) for s in range(len(self.plan))])))
        applied = self._all("stage_update", norm, hp, step)
        return loss_sum, total, norm, bool(applied[0])

    # ---- generation: each stage keeps the KV cache of its layers ----------------------------------------------
    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        self._caches += 1
        self._all("stage_new_cache", self._caches, batch, max_len)
        return {"key": self._caches, "len": 0, "batch": batch, "max_len": max_len, "dtype": self.kv_dtype}

    def free_kv_cache(self, kv: dict):
        self._all("stage_free_cache", kv["key"])

    def forward_rows(self, ids, rows, positions, kv: dict, last, long_rope=None, adapters=None):
        """The protocol's forward_rows through the stages, each writing its layers' keys and values into its own
        part of the cache: logits (m, V) float32 of the tokens at `last`. No bank of adapters (adapters None)."""
        if adapters is not None:
            raise ConfigError("pipeline stages generate with the run's own adapter, not a bank of adapters")
        ids, rows, positions, last = check_rows(ids, rows, positions, last, kv, self.cfg.vocab_size)
        if long_rope is None:
            long_rope = self.cfg.rope_long(int(positions.max(initial=0)))
        x = ids
        for s in range(len(self.plan)):
            x = self.runner.call(s, "stage_rows", kv["key"], x, rows, positions, last, bool(long_rope))
        return self.runner.get(x)

    def set_adapter_bank(self, bank: dict | None):
        """The stages serve no bank of adapters (a server's mixed batches): None only."""
        if bank:
            raise ConfigError("pipeline stages generate with the run's own adapter, not a bank of adapters")

    def close(self):
        self.runner.close()


class ReferenceStages:
    """A PipelineEngine's stages with the reference adapter they hold switched in while they score (its
    token_losses); the engine methods a reference's scoring calls, on the same stages."""

    def __init__(self, engine: PipelineEngine):
        self.engine = engine

    def token_losses(self, ids, targets, segment_ids, position_ids):
        """The reference's (B, T) float32 losses, as PipelineEngine.token_losses gives the policy's."""
        self.engine._all("stage_use_reference", True)
        try:
            return self.engine.token_losses(ids, targets, segment_ids, position_ids)
        finally:
            self.engine._all("stage_use_reference", False)

    def set_adapter_enabled(self, enabled: bool = True):
        self.engine.set_adapter_enabled(enabled)

    def set_images(self, images):
        """The images of the rows it scores next (the stages' own: PipelineEngine.set_images)."""
        self.engine.set_images(images)

    def set_loss_temperature(self, temperature: float = 1.0):
        self.engine.set_loss_temperature(temperature)


class StageWeights(Mapping):
    """A PipelineEngine's base weights by name: a weight is fetched from the stage that holds it when read."""

    def __init__(self, engine: PipelineEngine):
        self.engine = engine
        runner, plan = engine.runner, engine.plan
        held = runner.get([runner.call(s, "weight_names") for s in range(len(plan))])
        self.names = [k for s, names in enumerate(held) for k in names if plan.owner(k) == s]

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(name)
        runner = self.engine.runner
        return runner.get(runner.call(self.engine.plan.owner(name), "weight", name))

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
