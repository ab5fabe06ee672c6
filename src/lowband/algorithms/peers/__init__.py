"""The peers lowband is compared against: PyTorch DDP (plain, fp16, PowerSGD hooks), local SGD, and
DiLoCo / Streaming DiLoCo through torchft (docs/peers.md)."""
