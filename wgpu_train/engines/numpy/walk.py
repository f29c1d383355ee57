"""One walk of the NumPy engine over the layer plan: the batch's shape, positions and segments, and for generation
its KV cache rows; shared by the engine's training forward and its KV-cache generation. And the engine's Mode,
which its parts are given."""
from __future__ import annotations

from wgpu_train.models.config import ModelConfig


class Walk:
    """What a walk over the layer plan needs besides the activations: the batch's shape (B, T), positions
    and segment ids (B, T); for generation (B = 1) the KV cache and each token's cache row (T,), and where the cache
    holds recurrent state each row's run of tokens (shared/recurrent_state.row_runs); long_rope:
    whether RoPE takes longrope's long factors; router_loss: a training forward's shared/moe.RouterLoss, or None
    (a mixture of experts without the router's auxiliary loss, or a dense model); blocks: (B, T) the images'
    bidirectional blocks (shared/image_tokens.ImageTokens), or None; rope_positions: what RoPE turns by, the
    positions unless M-RoPE gives each pair its own (B, T, R/2)."""

    def __init__(self, b, t, positions, segments, kv=None, rows=None, long_rope=False, router_loss=None, runs=None,
                 blocks=None, rope_positions=None):
        self.b, self.t, self.positions, self.segments, self.kv, self.rows = b, t, positions, segments, kv, rows
        self.long_rope, self.router_loss, self.runs, self.blocks = long_rope, router_loss, runs, blocks
        self.rope_positions = positions if rope_positions is None else rope_positions

    @property
    def real_tokens(self):
        """(B*T,) 1 for a real token, 0 for padding (the attention mask transformers' aux loss reads)."""
        return (self.segments.reshape(-1) != 0).astype(float)

    def heads(self, x, cfg: ModelConfig):
        """x (B*T, H*D) as (B, T, H, D)."""
        return x.reshape(self.b, self.t, x.shape[-1] // cfg.head_dim, cfg.head_dim)


class Mode:
    """How the engine's walks run now, shared by the engine and its parts: training (dropout on the LoRA inputs),
    adapter_enabled (False: every LoRA module skipped, a preference objective's reference), the loss head's
    temperature, the weight of the router's auxiliary loss on the gradient of a training forward (0: off), and the
    dropout position (the protocol's dropout_seed and dropout_calls)."""

    def __init__(self):
        self.training = False
        self.adapter_enabled = True
        self.loss_temperature = 1.0
        self.router_loss_weight = 0.0
        self.dropout_seed = 0
        self.dropout_calls = 0
