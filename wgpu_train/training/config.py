"""TrainConfig: every setting of one fine-tuning run, each also a `wgpu-train finetune --option` (its help text,
choices and checks), and the embedded default run's recipe, model and dataset. (Over 450 lines on purpose: one
dataclass holds every option with its help text, and the command line, TOML files and run records are made from
its fields.)"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from wgpu_train.training import tracking
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.engines.backend_choice import BACKENDS
from wgpu_train.engines.protocol import PRECISION_CHOICES, OptimizerParams, Precision
from wgpu_train.errors import ConfigError
from wgpu_train.adapters.layout import DEFAULT_TARGETS, last_layers, parse_layers, parse_pattern
from wgpu_train.engines.shared.quant import BASE_CHOICES, EMBED_CHOICES, StorageDtype, check_dtypes, parse_dtype
from wgpu_train.models.vision import split_targets
from wgpu_train.training.run_folder import DEFAULT_OUT, output_folder, recorded_settings
from wgpu_train.training.objectives import DPO_LOSSES, OBJECTIVES, PreferenceSettings, TrainerKind, objective_class
from wgpu_train.training.objectives.grpo import GRPOSettings
from wgpu_train.training.schedule import SCHEDULES

METHODS = ("lora", "full")
PAD_MULTIPLE = 8   # sequence lengths are padded to a multiple of this


def _opt(default, help_text: str, **extra):
    return field(default=default, metadata={"help": help_text, **extra})


@dataclass
class TrainConfig:
    """Everything one fine-tuning run needs; each field is also a `wgpu-train finetune --option`."""

    model: str | None = _opt(None, "Hugging Face model folder (config.json, *.safetensors, tokenizer.json) or hub "
                                   "id org/name[@revision] (from the hub cache, else downloaded); default: the "
                                   "embedded model")
    data: str | None = _opt(None, "data file (JSONL, JSON array, Parquet), folder with a train split and optional "
                                  "validation and test splits (ours or the hub's data/ layout), hub dataset id, "
                                  "or a glob; repeat the option (or separate with commas) to mix several; "
                                  "default: the embedded dataset")
    images_demo: bool = _opt(False, "the embedded image demo: a tiny Gemma 3 vision model learns to name the "
                                    "colour of a square in generated pictures (no --model or --data; "
                                    "docs/guides/vision.md)")
    columns: str | None = _opt(None, "other column names of the data, FIELD=COLUMN[,...] (fields: messages, "
                                     "prompt, completion, instruction, input, output, response, context, system, "
                                     "text), e.g. prompt=question,completion=answer")
    out: str | None = _opt(None, "output folder: adapter, metrics.jsonl, summary.json, checkpoints/; default: "
                                 f"{DEFAULT_OUT}, or with --resume the folder of the run it continues")
    backend: str = _opt("auto", "compute engine: wgpu, numpy, or auto (WebGPU on a GPU; where the only WebGPU "
                                "adapters are CPUs, the NumPy engine for a model whose layers hold under 1M weights, "
                                "like the embedded one, and the CPU adapter for a larger one; nothing is timed)",
                        choices=BACKENDS)
    device: str | None = _opt(None, "WebGPU adapter: an index or part of its name/backend (see `wgpu-train devices`); "
                                    "with --num-workers, a comma-separated list: worker i of a node takes the i-th")
    method: str = _opt("lora", "lora (train an adapter) or full (train every weight)", choices=METHODS)
    base_dtype: StorageDtype = _opt(StorageDtype.AUTO, "storage of the frozen weights of the linear layers: "
                                                       "float32, bfloat16, float16, nf4 (4-bit NormalFloat blocks "
                                                       "of 64, QLoRA), nf4-dq (nf4 with double-quantised absmax "
                                                       "values), mxfp4 (an MoE model's experts as OCP MXFP4, "
                                                       "blocks of 32 with an e8m0 scale, every other weight "
                                                       "bfloat16, as gpt-oss's checkpoints store them) or auto "
                                                       "(as the checkpoint stores them: "
                                                       "config.json's torch_dtype bfloat16 or float16, else "
                                                       "float32; float32 for method full); anything but float32 "
                                                       "is LoRA only",
                                    choices=BASE_CHOICES)
    embed_dtype: StorageDtype = _opt(StorageDtype.AUTO, "storage of the embedding and lm_head: float32, bfloat16, "
                                                        "float16, or auto (the base's own over a float32 or "
                                                        "bfloat16 base, bfloat16 over an MXFP4 one, float16 over a "
                                                        "float16 or NF4 one, as in QLoRA); LoRA only unless float32",
                                     choices=EMBED_CHOICES)
    precision: Precision = _opt(Precision.AUTO, "where activations, saved tensors and activation gradients are "
                                                "stored: fp32, bf16 or f16 (arithmetic stays float32; LoRA, "
                                                "gradients and AdamW state float32; f16 adds dynamic loss scaling), "
                                                "or auto (bf16 on a GPU; fp32 on the NumPy reference, on CPU "
                                                "adapters and for a model with an odd width)",
                                choices=PRECISION_CHOICES)
    lora_rank: int = _opt(8, "LoRA rank r")
    lora_alpha: float = _opt(16.0, "LoRA alpha: the update is scaled by alpha / r (alpha / sqrt(r) with --rslora)")
    lora_dropout: float = _opt(0.0, "dropout on the LoRA input while training, in [0, 1)")
    lora_targets: str = _opt(DEFAULT_TARGETS, "modules to adapt, comma-separated (q_proj, k_proj, v_proj, o_proj, "
                                              "gate_proj, up_proj, down_proj; Phi-3's qkv_proj, o_proj, gate_up_proj, "
                                              "down_proj, where the default means qkv_proj), or all-linear; "
                                              "with images also the vision tower's: fc1, fc2, vision_tower.q_proj "
                                              "(k_proj, v_proj, out_proj), vision_tower for all of them")
    lora_target_parameters: str = _opt("", "a mixture of experts' expert tensors to adapt with a LoRA pair per "
                                           "expert (PEFT's target_parameters), comma-separated: "
                                           "mlp.experts.gate_up_proj, mlp.experts.down_proj (all-linear takes both, "
                                           "as PEFT's does), gate.weight (the router)")
    router_aux_loss_coef: float | None = _opt(None, "a mixture of experts' load-balancing loss (transformers' "
                                                    "router aux loss) added with this weight; default: the model "
                                                    "config's router_aux_loss_coef where its output_router_logits is "
                                                    "true, else off; 0: off")
    rslora: bool = _opt(False, "rank-stabilised LoRA: scale alpha / sqrt(r)")
    loraplus_lr_ratio: float = _opt(1.0, "LoRA+: the learning rate of the LoRA B matrices over lr (PEFT's "
                                         "loraplus_lr_ratio; the LoRA+ paper suggests 16; 1: plain LoRA)")
    dora: bool = _opt(False, "DoRA: weight-decomposed LoRA, a trained magnitude per output row scaling W + "
                             "scale * B A by m / ||W + scale * B A|| (PEFT's use_dora)")
    # ---- PEFT's per-layer choices and initialisations (adapters/layout.py, adapters/inits.py) ----
    lora_layers: str | None = _opt(None, "layers that get LoRA: N, the last N (mlx-lm's --num-layers), or indices "
                                         "such as 0,2,5 or 3-5 (one layer i: i,); default: every layer "
                                         "(PEFT's layers_to_transform)")
    lora_rank_pattern: str | None = _opt(None, "per-module ranks, PATTERN=R[,...] (PEFT's rank_pattern: the first "
                                               "pattern matching the end of a module path wins, e.g. "
                                               "q_proj=16,layers.0.mlp.down_proj=4), or a JSON object")
    lora_alpha_pattern: str | None = _opt(None, "per-module alphas, PATTERN=ALPHA[,...] as --lora-rank-pattern "
                                                "(PEFT's alpha_pattern)")
    lora_init: str = _opt("default", "initialisation of a new adapter (PEFT's init_lora_weights): default (A "
                                     "kaiming-uniform, B zeros), gaussian, pissa, pissa_niter_K (K subspace "
                                     "iterations), olora; pissa and olora train over the residual base and save "
                                     "the adapter converted to rank 2r for the original base")
    # ---- PEFT's modules_to_save (adapters/saved_modules.py) ----
    modules_to_save: str | None = _opt(None, "also train full float32 copies of these modules beside LoRA, saved in "
                                             "the adapter (PEFT's modules_to_save, e.g. after adding tokens): "
                                             "embed_tokens, lm_head or both, comma-separated")
    ensure_weight_tying: bool = _opt(False, "with --modules-to-save on a model with tied embeddings: one copy serves "
                                            "the embedding and lm_head (PEFT's ensure_weight_tying); without it each "
                                            "named module trains its own copy and the other keeps the original")
    adapter_path: str | None = _opt(None, "start from this PEFT LoRA adapter (folder or hub id) instead of a fresh "
                                          "one: its weights, rank, alpha, targets and rsLoRA (LoRA options left at "
                                          "their defaults take the adapter's, others must agree); the optimizer "
                                          "starts fresh: not a resume")
    epochs: int = _opt(3, "passes over the training set (ignored when --max-steps is given)")
    max_steps: int | None = _opt(None, "stop after this many optimizer steps (overrides --epochs)")
    batch_size: int = _opt(4, "samples (rows) per micro-batch")
    max_tokens_per_batch: int | None = _opt(None, "form micro-batches of up to this many tokens (rows x their "
                                                  "longest length) from rows of similar lengths, instead of "
                                                  "--batch-size rows; at least the longest sample")
    grad_accum: int = _opt(1, "micro-batches per optimizer step; the loss is normalised by the trained tokens "
                              "of all of them, so the step equals one batch of batch_size * grad_accum")
    lr: float = _opt(1e-3, "peak learning rate")
    lr_schedule: str = _opt("cosine", "learning-rate decay after warmup: constant, linear or cosine",
                            choices=SCHEDULES)
    warmup_steps: int = _opt(0, "steps of linear warmup up to --lr")
    weight_decay: float = _opt(0.0, "AdamW decoupled weight decay")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.999, "AdamW beta2")
    adam_eps: float = _opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = _opt(1.0, "clip the global gradient norm to this value (0: no clipping)")
    gradient_checkpointing: bool = _opt(False, "recompute each layer's activations in the backward: less GPU "
                                               "memory, about one more forward per step")
    max_seq_len: int = _opt(512, "longer samples are truncated, and dropped when no response token remains")
    pack: bool = _opt(False, "pack several samples into each row (attention never crosses samples)")
    valid_split: float = _opt(0.1, "fraction of train held out (seeded) for validation when the data has no validation split")
    no_chat_template: bool = _opt(False, "train on raw prompt + response text instead of the chat template")
    train_on_last_turn: bool = _opt(False, "in multi-turn chats, train only the last assistant turn")
    skip_invalid: bool = _opt(False, "skip invalid records (and report how many) instead of stopping")
    eval_every: int = _opt(0, "validation loss every N steps (0: only at each epoch's end); always at the end")
    save_every: int = _opt(0, "checkpoint every N steps (0: only at the end and on Ctrl-C)")
    keep_checkpoints: int = _opt(3, "keep only the newest K checkpoints (0: keep all)")
    early_stop_patience: int = _opt(0, "stop after N evaluations without a lower validation loss (0: off); the "
                                       "adapter written is then the best evaluation's (kept in memory)")
    seed: int = _opt(0, "seed of the validation split, shuffling, LoRA initialisation and dropout")
    resume: str | None = _opt(None, "continue a run from a checkpoint folder (or an output folder: its newest "
                                    "checkpoint)")
    overwrite: bool = _opt(False, "replace an earlier run in --out (its checkpoints are deleted); without it a new "
                                  "run refuses an output folder that already holds one")
    no_progress: bool = _opt(False, "no progress bar; plain log lines instead (for logs and CI)")
    eval_generate: bool | None = _opt(None, "exact match of greedy answers on the held-out set (test, else valid) "
                                            "before and after training; default: on for the embedded dataset")
    max_eval_samples: int = _opt(100, "at most this many held-out samples for exact match (0: all)")
    max_new_tokens: int = _opt(64, "longest answer generated for exact match")
    log_every: int = _opt(10, "one metrics.jsonl row (and log line) every N steps")
    profile_interval: int = _opt(0, "every N steps, GPU time per op group (timestamp queries) as a table and a "
                                    "metrics.jsonl row (0: off)")
    report_to: str = _opt("none", "also send the metrics.jsonl rows to tensorboard, wandb, trackio or mlflow "
                                  "(comma-separated; each an extra: pip install 'wgpu-train[tensorboard]'), or none")
    # ---- preference tuning (training/objectives/, training/preference_trainer.py) ----
    objective: str = _opt("sft", "what to train: sft (supervised), or a preference objective with TRL's meaning: dpo "
                                 "(chosen / rejected pairs against a reference model), simpo and orpo (pairs, no "
                                 "reference), kto (unpaired examples labelled desirable or not)",
                          choices=tuple(OBJECTIVES))
    dpo_loss: str = _opt("sigmoid", "DPO's loss (TRL's loss_type): sigmoid, ipo, hinge or robust",
                         choices=DPO_LOSSES)
    beta: float | None = _opt(None, "the objectives' beta (DPO / KTO: the reference's pull; IPO: its "
                                    "regularisation; SimPO: the reward scale; ORPO: lambda, the odds-ratio term's "
                                    "weight; GRPO: the KL term's weight); default: 0.1, for grpo 0 (TRL's)")
    label_smoothing: float = _opt(0.0, "the assumed share of flipped preference labels, in [0, 0.5): --dpo-loss "
                                       "robust and SimPO")
    simpo_gamma: float = _opt(0.5, "SimPO's target reward margin gamma")
    desirable_weight: float = _opt(1.0, "KTO: the weight of the desirable examples' losses")
    undesirable_weight: float = _opt(1.0, "KTO: the weight of the undesirable examples' losses")
    truncation_mode: str = _opt("keep_start", "a preference row longer than --max-seq-len keeps its start (TRL's "
                                              "default; a pair whose prompt alone fills it is dropped) or its end "
                                              "(keep_end: the prompt loses its beginning; not for kto)",
                                choices=("keep_start", "keep_end"))
    max_prompt_length: int | None = _opt(None, "preference data: keep only a prompt's last N tokens (older TRL's "
                                               "max_prompt_length); default: whole prompts")
    precompute_ref_log_probs: bool = _opt(False, "DPO / KTO: the reference model's log-probabilities computed once "
                                                 "before training and kept with the run (a resume reuses them); "
                                                 "needed with --method full, whose reference is the starting model; "
                                                 "always so with --ref-adapter and --modules-to-save")
    ref_adapter: str | None = _opt(None, "DPO / KTO / GRPO: the reference is the base model with this PEFT "
                                         "adapter; default: the base model, the adapter switched off")
    # ---- online RL: GRPO (training/objectives/grpo.py, training/grpo_trainer.py) ----
    reward: str | None = _opt(None, "grpo: the reward functions, comma-separated or repeated: a built-in "
                                    "(exact_match, format, word_positions), module:function or path.py:function, "
                                    "each f(prompts, completions, **columns) -> list of float or None (TRL's "
                                    "signature); default: word_positions on the embedded demo")
    reward_weights: str | None = _opt(None, "grpo: one weight per --reward, comma-separated (default: all 1)")
    reward_pattern: str | None = _opt(None, "grpo: the regular expression the format reward wants a whole "
                                            "completion to match")
    num_generations: int = _opt(8, "grpo: completions sampled per prompt, a group (G); --batch-size x "
                                   "--grad-accum (x --num-workers) rows per step must be a multiple of it")
    max_completion_length: int = _opt(256, "grpo: the most tokens a completion may have")
    temperature: float = _opt(1.0, "grpo: the sampling temperature of the completions")
    top_p: float = _opt(1.0, "grpo: nucleus sampling's top_p (1: off)")
    top_k: int = _opt(0, "grpo: sample among the k likeliest tokens (0: off)")
    mask_truncated_completions: bool = _opt(False, "grpo: completions cut at --max-completion-length carry no "
                                                   "loss (DAPO's overlong filtering)")
    scale_rewards: str = _opt("group", "grpo: advantages divided by the rewards' standard deviation in each "
                                       "group, in the whole batch, or none (Dr. GRPO)",
                              choices=("group", "batch", "none"))
    grpo_loss: str = _opt("dapo", "grpo: the loss's normalisation (TRL's loss_type): dapo, grpo, dr_grpo, bnpo, "
                                  "cispo or sapo", choices=("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"))
    epsilon: float = _opt(0.2, "grpo: the ratio's clipping range below 1 (and above, without --epsilon-high)")
    epsilon_high: float | None = _opt(None, "grpo: the ratio's clipping range above 1 (DAPO's clip-higher); "
                                            "default: --epsilon")
    num_iterations: int = _opt(1, "grpo: optimizer steps per generated batch (TRL's mu; the old log-probabilities "
                                  "kept for its ratios)")
    importance_sampling_level: str = _opt("token", "grpo: the ratio per token, or per sequence (GSPO)",
                                          choices=("token", "sequence"))
    tool: str | None = _opt(None, "grpo: a tool the model may call, repeated or comma-separated: a built-in "
                                  "(calculator) or module:function / path.py:function with type hints and a "
                                  "docstring (TRL's tools); rollouts run the tool loop")
    environment: str | None = _opt(None, "grpo: module:Class or path.py:Class, TRL's environment_factory: an "
                                         "instance per rollout, reset() before it, its public methods tools, its "
                                         "optional get_reward() a reward named after the class")
    max_tool_calling_iterations: int | None = _opt(None, "grpo: the most rounds of tool calls in a rollout; default: "
                                                         "no limit (TRL's)")
    # ---- data parallelism on Ray Train (distributed/) ----
    num_workers: int | None = _opt(None, "train on this many Ray Train workers, each on its own WebGPU adapter "
                                         "(--device may list one per worker; workers may share one): a step's "
                                         "batch is batch_size x grad_accum x num_workers, its gradients averaged "
                                         "over all of them; needs pip install 'wgpu-train[ray]'; default: one "
                                         "process, no Ray")
    ray_address: str | None = _opt(None, "with --num-workers: the Ray cluster to join (auto, or HOST:PORT of its "
                                         "head); default: start a local Ray instance")
    max_failures: int = _opt(1, "with --num-workers (or --pipeline-stages): restart the workers (the stages) this "
                                "many times after a failure, from the last checkpoint (see --save-every)")
    # ---- pipeline stages on Ray (distributed/pipeline_*.py) ----
    pipeline_stages: int | None = _opt(None, "split the model's layers into this many contiguous stages, each a Ray "
                                             "actor that loads and holds only its layers (the first also the "
                                             "embedding, the last the final norm and head), for a model larger "
                                             "than one device; balanced by the memory estimate; each stage on "
                                             "--backend's engine, and --device may list one adapter per stage; "
                                             "needs pip install 'wgpu-train[pipeline]'")
    stage_layers: str | None = _opt(None, "the stages' layers by hand, FIRST-LAST per stage: e.g. 0-11,12-23 "
                                          "(every layer exactly once, in order)")
    pipeline_micro_batches: int | None = _opt(None, "micro-batches of batch_size rows per step through the "
                                                    "stages (the step is batch_size x this, as --grad-accum); "
                                                    "default: --grad-accum")
    pipeline_schedule: str = _opt("1f1b", "gpipe (every forward, then every backward) or 1f1b (a stage holds "
                                          "at most as many micro-batches as stages after it, plus one); the "
                                          "same numbers either way", choices=("gpipe", "1f1b"))
    stage_resources: str | None = _opt(None, "the Ray resources each pipeline stage reserves, as its bundle of the "
                                             "run's placement group (packed onto as few nodes as hold them): "
                                             "NAME=AMOUNT,... (e.g. CPU=1,GPU=1 for a GPU each); default CPU=1")
    device_memory: str | None = _opt(None, "the memory of each pipeline stage's device (WebGPU does not report it): "
                                           "one size for all (24GiB) or one per stage (24GiB,16GiB); a stage whose "
                                           "memory estimate exceeds its device's is refused; default: unchecked")

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)

        # names from TOML, the command line or Python, parsed once
        self.precision = Precision.parse(self.precision)
        self.base_dtype = parse_dtype(self.base_dtype, "base_dtype")
        self.embed_dtype = parse_dtype(self.embed_dtype, "embed_dtype", EMBED_CHOICES)
        for name in ("backend", "method", "lr_schedule", "objective", "dpo_loss",
                     "truncation_mode", "scale_rewards", "grpo_loss", "importance_sampling_level"):
            choices = next(f for f in dataclasses.fields(self) if f.name == name).metadata["choices"]
            need(getattr(self, name) in choices,
                 f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        for name in ("lr", "lora_alpha", "lora_dropout", "weight_decay", "beta1", "beta2", "adam_eps",
                     "max_grad_norm", "valid_split", "loraplus_lr_ratio", "beta", "label_smoothing", "simpo_gamma",
                     "desirable_weight", "undesirable_weight", "temperature", "top_p", "epsilon", "epsilon_high",
                     "router_aux_loss_coef"):
            value = getattr(self, name)
            if value is None and name in ("beta", "epsilon_high", "router_aux_loss_coef"):
                continue
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 f"{name} must be a finite number, got {value!r}")
        for name in ("lora_rank", "epochs", "batch_size", "grad_accum", "max_seq_len", "max_new_tokens",
                     "log_every"):
            need(getattr(self, name) >= (2 if name == "max_seq_len" else 1),
                 f"{name} must be at least {2 if name == 'max_seq_len' else 1}, got {getattr(self, name)}")
        for name in ("warmup_steps", "weight_decay", "max_grad_norm", "eval_every", "save_every",
                     "keep_checkpoints", "early_stop_patience", "max_eval_samples"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.max_steps is None or self.max_steps >= 1, f"max_steps must be at least 1, got {self.max_steps}")
        need(self.max_tokens_per_batch is None or self.max_tokens_per_batch >= 1,
             f"max_tokens_per_batch must be at least 1, got {self.max_tokens_per_batch}")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}")
        need(self.loraplus_lr_ratio > 0, f"loraplus_lr_ratio must be > 0, got {self.loraplus_lr_ratio}")
        need(self.method == "lora" or self.loraplus_lr_ratio == 1,
             "loraplus_lr_ratio sets the LoRA B matrices' learning rate: method lora")
        need(self.method == "lora" or not self.dora, "dora trains a LoRA adapter's magnitudes: method lora")
        need(self.adam_eps > 0, f"adam_eps must be > 0, got {self.adam_eps}")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1 and beta2 must be in [0, 1)")
        need(0 <= self.valid_split < 1, f"valid_split must be in [0, 1), got {self.valid_split}")
        if self.method == "full":
            need(self.storage_dtypes() == ("float32", "float32"),
                 f"method full trains every weight, so it needs base_dtype and embed_dtype float32 "
                 f"(got {', '.join(self.storage_dtypes())})")
        if self.method == "lora":
            self.lora_config()  # validates rank, dropout and targets
        need(self.method == "lora" or (self.lora_init, self.lora_layers, self.lora_rank_pattern,
                                       self.lora_alpha_pattern) == ("default", None, None, None),
             "lora_init, lora_layers and the LoRA patterns set up LoRA matrices: method lora")
        need(self.method == "lora" or not (self.modules_to_save or self.ensure_weight_tying),
             "modules_to_save trains copies beside LoRA: method lora (method full trains every weight)")
        need(not (self.adapter_path and self.resume),
             "adapter_path starts a new run from an adapter and resume continues a run from its checkpoint: give one")
        need(not self.adapter_path or self.method == "lora", "adapter_path continues a LoRA adapter: method lora")
        tracking.parse_report_to(self.report_to)
        objective = objective_class(self.objective)
        if objective.trainer is TrainerKind.PREFERENCE:
            self.preference_settings()     # validates beta, label_smoothing and the weights
            need(not self.pack, "packing puts several samples in a row; a preference objective scores whole rows: "
                                "leave out --pack")
            need(not self.max_tokens_per_batch, "max_tokens_per_batch forms SFT micro-batches; a preference "
                                                "objective takes --batch-size examples per micro-batch")
            need(objective.uses_reference or not (self.ref_adapter or self.precompute_ref_log_probs),
                 f"--objective {self.objective} needs no reference model: leave out --ref-adapter and "
                 "--precompute-ref-log-probs")
            need(not (self.method == "full" and objective.uses_reference and not self.precompute_ref_log_probs),
                 f"--objective {self.objective} with --method full needs --precompute-ref-log-probs: the reference "
                 "is the starting model, whose log-probabilities are computed once before training")
            need(not (self.method == "full" and self.ref_adapter), "--ref-adapter is a LoRA adapter's reference: "
                                                                    "method lora")
        if objective.trainer is TrainerKind.ONLINE:
            settings = self.grpo_settings()     # validates the generation, clipping and loss options
            need(not self.pack, "packing puts several samples in a row; GRPO scores whole completions: leave out "
                                "--pack")
            need(not self.max_tokens_per_batch, "max_tokens_per_batch forms SFT micro-batches; GRPO takes "
                                                "--batch-size completions per micro-batch")
            rows = self.batch_size * self.grad_accum * (self.num_workers or 1)
            need(rows % settings.num_generations == 0,
                 f"a GRPO step samples --num-generations {settings.num_generations} completions of each prompt: "
                 f"--batch-size x --grad-accum{' x --num-workers' if self.num_workers else ''} ({rows}) must be a "
                 f"multiple of it")
            need(self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 1,
                 f"--max-tool-calling-iterations must be at least 1, got {self.max_tool_calling_iterations}")
            need(not self.precompute_ref_log_probs, "GRPO scores its reference on each step's new completions: "
                                                    "leave out --precompute-ref-log-probs")
            need(not (self.ref_adapter and not settings.uses_reference),
                 "--ref-adapter is the reference of GRPO's KL term, which --beta 0 (the default) leaves out")
            need(self.method == "lora" or not settings.uses_reference,
                 "GRPO's reference is the adapter switched off: --beta > 0 needs method lora")
        objective.check_run(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        taken = {TrainerKind.SUPERVISED: (), TrainerKind.PREFERENCE: PREFERENCE_FIELDS,
                 TrainerKind.ONLINE: tuple(objective.options) + ("max_prompt_length", "ref_adapter")}[objective.trainer]
        given = [f"--{name.replace('_', '-')}" for name in PREFERENCE_FIELDS + GRPO_FIELDS
                 if name not in taken and getattr(self, name) != defaults[name]]
        need(not given, f"{', '.join(given)}: not an option of --objective {self.objective}"
                        + ("; give --objective" if objective.trainer is TrainerKind.SUPERVISED else ""))
        need(self.max_prompt_length is None or self.max_prompt_length >= 1,
             f"max_prompt_length must be at least 1, got {self.max_prompt_length}")
        need(self.num_workers is None or self.num_workers >= 1, f"num_workers must be at least 1, got {self.num_workers}")
        need(self.max_failures >= 0, f"max_failures must be >= 0, got {self.max_failures}")
        need(self.ray_address is None or self.num_workers or self.pipelined(),
             "ray_address joins a Ray cluster for --num-workers: give both")
        need(self.pipelined() or (self.stage_resources, self.device_memory) == (None, None),
             "--stage-resources and --device-memory are pipeline stages': give --pipeline-stages")
        self._check_pipeline(need)

    def pipelined(self) -> bool:
        """Whether the run trains through pipeline stages (--pipeline-stages or --stage-layers)."""
        return bool(self.pipeline_stages or self.stage_layers)

    def _check_pipeline(self, need):
        """--pipeline-stages' own options, each refusal one line."""
        need(self.pipeline_stages is None or self.pipeline_stages >= 1,
             f"pipeline_stages must be at least 1, got {self.pipeline_stages}")
        need(self.pipeline_micro_batches is None or self.pipeline_micro_batches >= 1,
             f"pipeline_micro_batches must be at least 1, got {self.pipeline_micro_batches}")
        if not self.pipelined():
            need(self.pipeline_micro_batches is None and self.pipeline_schedule == "1f1b",
                 "--pipeline-micro-batches and --pipeline-schedule schedule pipeline stages: give --pipeline-stages")
            return
        need(self.pipeline_micro_batches is None or self.grad_accum in (1, self.pipeline_micro_batches),
             f"--pipeline-micro-batches {self.pipeline_micro_batches} and --grad-accum {self.grad_accum} both set "
             f"a step's micro-batches: give one")

    def continued_lora(self, adapter: LoraConfig, model) -> LoraConfig:
        """The LoraConfig of a run that continues `adapter` (adapter_path): the adapter's rank, alpha, targets,
        rsLoRA, layers and patterns where these options keep their defaults, refused (one line) where they say
        otherwise; the dropout is this run's when given, else the adapter's."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        mine = self.lora_config(model.num_hidden_layers)
        targets = mine.targets_in(model) if self.lora_targets != defaults["lora_targets"] else None   # when given
        pairs = (("lora_rank", "r", mine.r, adapter.r), ("lora_alpha", "lora_alpha", mine.alpha, adapter.alpha),
                 ("lora_targets", "target_modules", targets, adapter.targets_in(model)),
                 ("rslora", "use_rslora", mine.use_rslora, adapter.use_rslora),
                 ("lora_layers", "layers_to_transform", mine.layers_to_transform, adapter.layers_to_transform),
                 ("lora_rank_pattern", "rank_pattern", mine.rank_pattern, adapter.rank_pattern),
                 ("lora_alpha_pattern", "alpha_pattern", mine.alpha_pattern, adapter.alpha_pattern),
                 ("dora", "use_dora", mine.use_dora, adapter.use_dora),
                 ("modules_to_save", "modules_to_save", mine.modules_to_save, adapter.modules_to_save),
                 ("ensure_weight_tying", "ensure_weight_tying", mine.ensure_weight_tying, adapter.ensure_weight_tying))
        for name, key, given, theirs in pairs:
            if getattr(self, name) != defaults[name] and given != theirs:
                shown = ",".join(map(str, theirs)) if isinstance(theirs, tuple) else theirs
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} contradicts the adapter's "
                                  f"{key}={shown} ({self.adapter_path}); leave it out to continue with the adapter's")
        if self.lora_init != defaults["lora_init"] and self.lora_init != adapter.init:
            raise ConfigError(f"--lora-init {self.lora_init} initialises a new adapter, but adapter_path continues "
                              f"{self.adapter_path} (init {adapter.init}): leave it out")
        dropout = mine.dropout if self.lora_dropout != defaults["lora_dropout"] else adapter.dropout
        return dataclasses.replace(adapter, dropout=dropout)

    def output_dir(self) -> Path:
        """The output folder: `out`, else the folder of the run that `resume` continues (see run_folder), else
        wgpu-train-out."""
        return output_folder(self.out, self.resume)

    def storage_dtypes(self, checkpoint_dtype: str | None = None) -> tuple[StorageDtype, StorageDtype]:
        """(base_dtype, embed_dtype) resolved (engines/shared/quant.check_dtypes): a base_dtype auto with the
        checkpoint's dtype (ModelConfig.checkpoint_dtype), which method full does not need."""
        return check_dtypes(self.base_dtype, self.embed_dtype, checkpoint_dtype, full=self.method == "full")

    def lora_config(self, num_hidden_layers: int | None = None) -> LoraConfig:
        """The LoraConfig these options describe; lora_layers "N" (the last N) needs the model's num_hidden_layers
        (without it, only checked: every layer)."""
        layers = parse_layers(self.lora_layers)
        if isinstance(layers, int):
            layers = last_layers(layers, num_hidden_layers) if num_hidden_layers else None
        language, tower = split_targets(self.lora_targets)      # the tower's: the vision model's (tower_lora.py)
        if tower and not language:
            raise ConfigError(f"--lora-targets {self.lora_targets}: the vision tower's alone; name the language "
                              f"model's too (q_proj, ...)")
        return LoraConfig(r=int(self.lora_rank), alpha=float(self.lora_alpha), dropout=float(self.lora_dropout),
                          target_modules=language, use_rslora=bool(self.rslora), layers_to_transform=layers,
                          rank_pattern=parse_pattern(self.lora_rank_pattern, "lora_rank_pattern"),
                          alpha_pattern=parse_pattern(self.lora_alpha_pattern, "lora_alpha_pattern"),
                          init=self.lora_init, use_dora=bool(self.dora), modules_to_save=self.modules_to_save,
                          ensure_weight_tying=self.ensure_weight_tying,
                          target_parameters=self.lora_target_parameters or ())

    def lora_layers_last(self) -> bool:
        """Whether lora_layers says "the last N" (resolved with the model's layer count)."""
        return isinstance(parse_layers(self.lora_layers), int)

    def preference_settings(self) -> PreferenceSettings:
        """The preference objective's settings (objective other than sft)."""
        return PreferenceSettings(self.objective, beta=0.1 if self.beta is None else float(self.beta),
                                  dpo_loss=self.dpo_loss,
                                  label_smoothing=float(self.label_smoothing), simpo_gamma=float(self.simpo_gamma),
                                  desirable_weight=float(self.desirable_weight),
                                  undesirable_weight=float(self.undesirable_weight))

    def grpo_settings(self) -> GRPOSettings:
        """GRPO's settings (objective grpo), checked."""
        return GRPOSettings(num_generations=int(self.num_generations),
                            max_completion_length=int(self.max_completion_length),
                            temperature=float(self.temperature), top_p=float(self.top_p), top_k=int(self.top_k),
                            mask_truncated_completions=bool(self.mask_truncated_completions),
                            scale_rewards=self.scale_rewards, loss_type=self.grpo_loss, epsilon=float(self.epsilon),
                            epsilon_high=None if self.epsilon_high is None else float(self.epsilon_high),
                            beta=0.0 if self.beta is None else float(self.beta),
                            num_iterations=int(self.num_iterations),
                            importance_sampling_level=self.importance_sampling_level)

    def tool_specs(self) -> list[str]:
        """--tool as a list of specs (built-in names, module:function, path.py:function)."""
        return [s.strip() for s in (self.tool or "").split(",") if s.strip()]

    def reward_specs(self) -> list[str]:
        """--reward as a list of specs (built-in names, module:function, path.py:function)."""
        return [s.strip() for s in (self.reward or "").split(",") if s.strip()]

    def optimizer_params(self, lr: float) -> OptimizerParams:
        """AdamW settings of one step at learning rate `lr`."""
        return OptimizerParams(lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.adam_eps,
                               weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm or None,
                               lora_b_lr_ratio=float(self.loraplus_lr_ratio))

    def to_dict(self) -> dict:
        """The fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)


# the options of a preference objective (refused with objective sft)
PREFERENCE_FIELDS = ("dpo_loss", "beta", "label_smoothing", "simpo_gamma", "desirable_weight", "undesirable_weight",
                     "truncation_mode", "max_prompt_length", "precompute_ref_log_probs", "ref_adapter")
# GRPO's options (refused with the other objectives)
GRPO_FIELDS = ("reward", "reward_weights", "reward_pattern", "num_generations", "max_completion_length",
               "temperature", "top_p", "top_k", "mask_truncated_completions", "scale_rewards", "grpo_loss", "epsilon",
               "epsilon_high", "num_iterations", "importance_sampling_level", "tool", "environment",
               "max_tool_calling_iterations")

# say how a run is started, not what it is (a continued adapter's settings are recorded as the LoRA options)
INVOCATION_FIELDS = ("out", "resume", "overwrite", "no_progress", "adapter_path", "ray_address", "stage_resources",
                     "device_memory")


def resumed_settings(resume) -> dict:
    """The settings of the run that a --resume path continues, for the command line (or a restarted Ray worker)
    to fill the options it was not given: the run folder's train_config.json (run_folder.recorded_settings)
    restricted to TrainConfig fields and without INVOCATION_FIELDS."""
    names = {f.name for f in dataclasses.fields(TrainConfig)} - set(INVOCATION_FIELDS)
    return {k: v for k, v in recorded_settings(resume).items() if k in names}


# ---- the embedded default run ---------------------------------------------------------------------

def default_run_values(objective: str = "sft") -> dict:
    """The embedded recipe (wgpu_train/assets/recipe.toml) that `wgpu-train finetune` with no --model and no
    --data uses below the command line and --config: its top-level values, with those of the objective's own
    table (e.g. [grpo]) over them."""
    try:
        from wgpu_train.assets import default_recipe
    except ImportError:
        return {}
    recipe = default_recipe()
    own = recipe.get(objective, {})
    return {**{k: v for k, v in recipe.items() if not isinstance(v, dict)}, **own}


def default_run_config(**overrides) -> "TrainConfig":
    """The TrainConfig of the default run (embedded model, dataset and recipe), with overrides."""
    return TrainConfig(**{**default_run_values(overrides.get("objective", "sft")), **overrides})


def default_model_dir() -> Path:
    """The embedded model folder (wgpu_train/assets), or a ConfigError saying it is not installed."""
    return _asset("default_model_dir", "model", "--model DIR")


def default_vision_model_dir() -> Path:
    """The embedded image demo's vision-language model folder (wgpu_train/assets), or a ConfigError."""
    return _asset("default_vision_model_dir", "vision model", "--model DIR")


def default_data_dir() -> Path:
    """The embedded dataset folder (wgpu_train/assets), or a ConfigError saying it is not installed."""
    return _asset("default_data_dir", "dataset", "--data PATH")


def _asset(func: str, what: str, option: str) -> Path:
    try:
        from wgpu_train import assets
        path = Path(getattr(assets, func)())
    except (ImportError, AttributeError, OSError):
        raise ConfigError(f"the embedded default {what} is not installed; pass {option}") from None
    if not path.exists():
        raise ConfigError(f"the embedded default {what} is missing ({path}); pass {option}")
    return path
