"""The vision tower a NumPy engine runs inside its train_step (TowerStep): a micro-batch's TowerImages through the
tower's forward before the language model's, its LoRA's backward after it, and its LoRA's gradients and AdamW
moments beside the engine's (one global norm, one update)."""
from __future__ import annotations

from wgpu_train.engines.numpy.optim import Optimizer
from wgpu_train.engines.shared.image_tokens import ImageTokens, TowerImages


class TowerStep:
    """tower: engines/numpy/vision_tower.VisionTower (its `lora` dict, whose arrays `optimizer` updates in
    place); dtype: the engine's."""

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
        """(the ImageTokens of the images' embeddings, the backward's cache, or None: the tower frozen)."""
        if self.trains:
            embeds, cache = self.tower.forward(images.pixels)
        else:
            embeds, cache = self.tower(images.pixels), None
        return ImageTokens(images.blocks, embeds.reshape(-1, embeds.shape[-1])), cache

    def backward(self, image_grad, cache):
        """The LoRA gradients from the image rows' gradient (N*M, text C), added to the optimizer's."""
        dout = image_grad.reshape(cache["n"], self.tower.vc.mm_tokens_per_image, -1)
        for name, g in self.tower.backward(dout, cache).items():
            self.optimizer.add(name, g)
