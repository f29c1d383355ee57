"""The vision tower a NumPy engine runs inside its train_step (TowerStep): a micro-batch's TowerImages through the
tower's forward before the language model's (SigLIP's, or Qwen's with its DeepStack features), its LoRA's backward
after it, and its LoRA's gradients and AdamW moments beside the engine's (one global norm, one update)."""
from __future__ import annotations

from wgpu_train.engines.numpy.optim import Optimizer
from wgpu_train.engines.shared.image_tokens import ImageTokens, TowerImages


class TowerStep:
    """tower: engines/numpy/vision_tower.VisionTower or qwen3_vl_tower.Qwen3VLTower (its `lora` dict, whose arrays
    `optimizer` updates in place); dtype: the engine's."""

    def __init__(self, tower, dtype):
        self.tower = tower
        self.optimizer = Optimizer(self.trainable, dtype, {"nonfinite_skipped": 0})    # the engine counts skips

    def trainable(self) -> dict:
        """The tower's LoRA tensors by name (path.lora_A / .lora_B), the arrays themselves."""
        return {f"{p}.lora_{w}": t for p, (a, b, _) in self.tower.lora.items() for w, t in (("A", a), ("B", b))}

    @property
    def trains(self) -> bool:
        return bool(self.tower.lora)

    def forward(self, images: TowerImages) -> tuple:
        """(the ImageTokens of the images' embeddings (Qwen's: with their M-RoPE positions and DeepStack
        features), the backward's cache, or None: the tower frozen)."""
        qwen = images.grids is not None
        given = (images.pixels, images.grids) if qwen else (images.pixels,)
        if self.trains:     # SigLIP's (embeds, cache), Qwen's (embeds, DeepStack features, cache)
            embeds, *deepstack, cache = self.tower.forward(*given)
        else:
            embeds, *deepstack, cache = (*(self.tower(*given) if qwen else (self.tower(*given),)), None)
        return ImageTokens(images.blocks, embeds.reshape(-1, embeds.shape[-1]), images.positions,
                           tuple(deepstack[0]) if deepstack else ()), cache

    def backward(self, image_grad, deepstack_grad: dict, cache):
        """The LoRA gradients from the image rows' gradient (N*M, text C) (and Qwen3-VL's DeepStack features'
        {layer k: (N*M, text C)}), added to the optimizer's."""
        if "n" in cache:        # SigLIP's: per image
            grads = self.tower.backward(image_grad.reshape(cache["n"], self.tower.vc.mm_tokens_per_image, -1), cache)
        else:
            grads = self.tower.backward(image_grad, [deepstack_grad[k] for k in range(len(deepstack_grad))], cache)
        for name, g in grads.items():
            self.optimizer.add(name, g)
