"""Algorithm registry: name -> class. One module per algorithm."""
from __future__ import annotations

from typing import Any

from .base import Algorithm, EngineContext, Finiteness, OptionError, check_fields, check_options
from .compressed import CompressedSGD
from .cpsgd import CPSGD
from .cp_diloco import CPDiLoCo
from .lazy import LazyUpdate
from .noop import NoComm
from .ssgd import SSGD
from .peers.ddp import DDP, DDPFP16, DDPPowerSGD
from .peers.localsgd import LocalSGD
from .peers.diloco import DiLoCo, StreamingDiLoCo

ALGORITHMS: dict[str, type[Algorithm]] = {
    SSGD.name: SSGD,
    NoComm.name: NoComm,
    CompressedSGD.name: CompressedSGD,
    CPSGD.name: CPSGD,
    CPDiLoCo.name: CPDiLoCo,
    LazyUpdate.name: LazyUpdate,
    # peers lowband is compared against (docs/peers.md)
    DDP.name: DDP,
    DDPFP16.name: DDPFP16,
    DDPPowerSGD.name: DDPPowerSGD,
    LocalSGD.name: LocalSGD,
    # through torchft, the optional extra lowband[peers]
    DiLoCo.name: DiLoCo,
    StreamingDiLoCo.name: StreamingDiLoCo,
}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator / function adding an algorithm to the registry under ``cls.name``."""
    ALGORITHMS[cls.name] = cls
    return cls


def make_algorithm(spec: "str | Algorithm", **options: Any) -> Algorithm:
    """An algorithm object from a registry name plus options, or the object itself. Options
    are type- and range-checked against the algorithm's dataclass fields (strings such as the
    CLI's ``--option warmup_steps=20`` are coerced to the field's type); ValueError names the
    bad option."""
    if isinstance(spec, Algorithm):
        if options:
            raise ValueError(f"options {sorted(options)} given together with an algorithm object; set them on the object")
        try:
            check_fields(spec)
        except OptionError as e:
            raise ValueError(f"bad options for algorithm {spec.name!r}: {e}") from None
        return spec
    try:
        cls = ALGORITHMS[spec]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {spec!r}; choose one of: {', '.join(sorted(ALGORITHMS))}") from None
    try:
        return cls(**check_options(cls, options))
    except (OptionError, TypeError) as e:
        raise ValueError(f"bad options for algorithm {spec!r}: {e}") from None


__all__ = ["Algorithm", "EngineContext", "Finiteness", "SSGD", "NoComm", "CompressedSGD", "CPSGD", "CPDiLoCo", "LazyUpdate", "DDP", "DDPFP16", "DDPPowerSGD",
           "LocalSGD", "DiLoCo", "StreamingDiLoCo", "ALGORITHMS", "register", "make_algorithm"]
