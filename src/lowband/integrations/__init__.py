"""Adapters for training loops lowband does not own: PyTorch DDP communication hooks."""
