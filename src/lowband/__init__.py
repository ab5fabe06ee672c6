"""lowband: data-parallel PyTorch training for networks too slow for plain synchronous SGD.

    import lowband
    engine = lowband.distribute(model, optimizer, algorithm="ssgd")
"""
from .algorithms import ALGORITHMS, CPSGD, SSGD, CPDiLoCo, Algorithm, CompressedSGD, LazyUpdate, make_algorithm, register
from .comm.agreement import ConfigMismatchError
from .engine.engine import Engine, distribute
from .engine.guard import NonFiniteGradientError
from .runtime.local_launch import launch

__version__ = "0.1.0"

__all__ = ["distribute", "Engine", "Algorithm", "SSGD", "CompressedSGD", "CPSGD", "CPDiLoCo", "LazyUpdate", "ALGORITHMS", "make_algorithm", "register", "__version__",
           "ConfigMismatchError", "NonFiniteGradientError", "launch"]
