"""A seeded stack of residual tanh blocks (fp64), split into pipeline chunks, and its
single-process reference: the same micro-batches with gradient accumulation."""

from __future__ import annotations

from functools import partial

import torch

H, S, B, LAYERS = 8, 4, 2, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(H, H, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The residual add's output is not saved by autograd, so pseudo-freeing it releases it.
        return x + torch.tanh(self.fc(x))


def build_blocks(seed: int = 0) -> list[Block]:
    torch.manual_seed(seed)
    return [Block() for _ in range(LAYERS)]


class Chunk(torch.nn.Module):
    """Blocks `layers` of the stack; the first chunk of the model reads the data."""

    def __init__(self, blocks: list[Block], layers: range, takes_data: bool, chunk: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks[i] for i in layers)
        self.layers, self.takes_data, self.chunk = layers, takes_data, chunk
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.takes_data else self.input_tensor
        for block in self.blocks:
            h = block(h)
        return h


def microbatches(m: int, variable: bool = False, seed: int = 1) -> list[tuple]:
    """(x [s, b, h], target [s, b, h], mask [s, b]) per micro-batch; s varies if `variable`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        s = S + (i % 3) if variable else S
        x = torch.randn(s, B, H, generator=g, dtype=torch.float64)
        target = torch.randn(s, B, H, generator=g, dtype=torch.float64)
        mask = (torch.rand(s, B, generator=g) > 0.3).to(torch.float64)
        mask[0, 0] = 1.0
        out.append((x, target, mask))
    return out


def loss_func(target, mask, per_token, output):
    """Per-token mode: (summed loss, token count, reported); else (mean loss, reported)."""
    per_pos = ((output - target) ** 2).sum(-1)
    total = (per_pos * mask).sum()
    tokens = mask.sum().to(torch.int)
    if per_token:
        return total, tokens, (total.detach().clone(), tokens)
    loss = total / mask.sum()
    return loss, loss.detach().clone()


def reference(m: int, variable: bool, per_token: bool, seed: int = 0):
    """Losses and grads {layer: (dW, db)} of the full model, accumulated in one process."""
    blocks = build_blocks(seed)
    losses, tokens = [], 0
    for x, target, mask in microbatches(m, variable):
        h = x
        for block in blocks:
            h = block(h)
        out = loss_func(target, mask, per_token, h)
        if per_token:
            total, n, _ = out
            (total).backward()
            losses.append(total.item())
            tokens += int(n)
        else:
            (out[0] / m).backward()
            losses.append(out[0].item())
    if per_token:
        for block in blocks:
            for p in block.parameters():
                p.grad /= tokens
    grads = {i: (b.fc.weight.grad, b.fc.bias.grad) for i, b in enumerate(blocks)}
    return losses, grads, tokens


def make_loss(target, mask, per_token):
    return partial(loss_func, target, mask, per_token)
