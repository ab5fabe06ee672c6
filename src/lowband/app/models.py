"""Models registered by name: image classifiers for 1x28x28 inputs and 10 classes (``mlp``,
``cnn``, ``resnet20``) and byte-level language models for the text datasets (``gpt``, and
``gpt-ngram``, the same transformer with hashed n-gram input embeddings: a heavy input side)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, hidden: tuple[int, ...] = (256, 128), num_classes: int = 10):
        super().__init__()
        dims = (28 * 28, *hidden)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


class LeNet(nn.Module):
    """The classic Caffe/MXNet LeNet (conv20-pool-conv50-pool-fc500-fc10), 0.43M parameters.
    Its fully connected layer dominates the bytes, which makes it communication-heavy."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(50 * 4 * 4, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            # 1x1 projection (He et al. option B), as in PCNN's ResNet-20
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the shortcut first: in data-flow order the projection is the input-side layer of its
        # block, as in PCNN's layer list (the lazy update orders layers by first forward use)
        identity = self.shortcut(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet20(nn.Module):
    """CIFAR-style ResNet-20 (3 stages of 3 blocks, 16/32/64 channels), with a one-channel
    stem for 28x28 inputs (feature maps 28 -> 14 -> 7)."""

    def __init__(self, num_classes: int = 10, blocks_per_stage: int = 3, widths: tuple[int, int, int] = (16, 32, 64)):
        super().__init__()
        self.conv1 = nn.Conv2d(1, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, cin = [], widths[0]
        for stage, width in enumerate(widths):
            for b in range(blocks_per_stage):
                stride = 2 if stage > 0 and b == 0 else 1
                layers.append(BasicBlock(cin, width, stride))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# -- a byte-level language model ------------------------------------------------------------

#: byte-level vocabulary: every token is one byte of the text
BYTE_VOCAB = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not a multiple of n_heads {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.proj = nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small decoder-only transformer over bytes (GPT-2's layout: learned positions,
    pre-LayerNorm blocks, a final LayerNorm, and the output projection tied to the input
    embedding, so ``head.weight`` *is* ``tok.weight`` and appears once in ``parameters()``).

    Input: int64 byte ids [batch, time] with time <= ``context``; output: logits
    [batch, time, 256]. No dropout, so a run is a function of its seed and data order.
    The defaults (d_model 128, 6 layers) give 1.24M parameters (4.95 MB of fp32 gradients,
    about 3x the ``cnn``'s), sized so that one CPU step at batch 16 x 128 bytes stays under
    ~0.2 s on one thread (docs/workloads.md).
    """

    def __init__(self, context: int = 128, d_model: int = 128, n_layers: int = 6, n_heads: int = 4,
                 mlp_ratio: int = 4, vocab: int = BYTE_VOCAB):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight            # tied input/output embedding
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        # GPT-2: N(0, 0.02) everywhere, residual output projections scaled by 1/sqrt(2 * layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            else:
                std = 0.02 / (2 * n_layers) ** 0.5 if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The input representation of byte ids ``idx`` [batch, time]: token plus position."""
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context {self.context}")
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


#: the modulus of the n-gram hash's polynomial (a prime below 2**31, so every product fits int64)
_HASH_PRIME = (1 << 31) - 1
#: Knuth's multiplicative constant (2**32 / golden ratio): spreads the polynomial over the buckets
_HASH_MIX = 2654435761


def ngram_hashes(idx: torch.Tensor, n: int, buckets: int) -> torch.Tensor:
    """Bucket of the n bytes ending at each position of ``idx`` [batch, time] (int64, same
    shape): the polynomial ``sum_k x[i-k] * 257**k`` modulo a prime, with positions before the
    window's start read as 256 (a value no byte has), then multiplied by Knuth's constant
    modulo 2**32 and reduced modulo ``buckets``. Deterministic and the same on every rank."""
    x = F.pad(idx.long(), (n - 1, 0), value=BYTE_VOCAB)
    t = idx.shape[1]
    h = torch.zeros_like(idx, dtype=torch.long)
    for k in range(n):                         # oldest byte first: h = h * 257 + x
        h = (h * (BYTE_VOCAB + 1) + x[:, k:k + t]) % _HASH_PRIME
    return (h * _HASH_MIX) % (1 << 32) % buckets


class NgramGPT(GPT):
    """``GPT`` with hashed n-gram input embeddings, as in the Byte Latent Transformer's
    encoder (Pagnoni et al., 2024): for each order n in ``orders`` the n bytes ending at a
    position are hashed into one of ``buckets`` rows of that order's own embedding table, and
    the rows are added to the byte and position embeddings. The tables give a byte-level model
    the context of its last few bytes at its input, and they are a large *input side*: with
    the defaults (orders 2 and 3, 4096 buckets, d_model 128) they hold 1.05M of the model's
    2.29M parameters, whose gradients backward produces last. That is the case the lazy
    update is for (docs/lazy.md); ``gpt``'s own input embedding is 32K weights tied to its
    output head. The tables are not tied to anything; initialised N(0, 0.02) like the rest.
    """

    def __init__(self, orders: tuple[int, ...] = (2, 3), buckets: int = 4096, **kwargs):
        super().__init__(**kwargs)
        if not orders or min(orders) < 2:
            raise ValueError(f"n-gram orders must be >= 2, got {orders!r}")
        self.orders = tuple(int(n) for n in orders)
        self.buckets = int(buckets)
        d_model = self.tok.embedding_dim
        self.ngrams = nn.ModuleList(nn.Embedding(self.buckets, d_model) for _ in self.orders)
        for table in self.ngrams:
            nn.init.normal_(table.weight, 0.0, 0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = super().embed(idx)
        for n, table in zip(self.orders, self.ngrams):
            x = x + table(ngram_hashes(idx, n, self.buckets))
        return x


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "cnn": LeNet,
    "resnet20": ResNet20,
    "gpt": GPT,
    "gpt-ngram": NgramGPT,
}


def make_model(name: str) -> nn.Module:
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}") from None
