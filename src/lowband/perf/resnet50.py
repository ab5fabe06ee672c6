"""Hand-written ResNet-50 profiles for hardware lowband has not run on, from published figures.

ResNet-50 (v1.5, torchvision's layout and parameter names; 25,557,032 parameters) is written
out here layer by layer, because torchvision is not a lowband dependency. A profile needs,
besides the shapes, the time of each parameter's backward segment; no per-layer timing of the
target hardware is published, so:

* the per-sample step time comes from a published training throughput (stated in each
  profile's ``source``), minus the optimizer step, split forward : backward = 1 : 2 (the usual
  rule: backward computes the gradients of inputs and of weights);
* forward and backward are shared out over the layers in proportion to their multiply-adds
  (batch norm, ReLU and pooling, which are memory-bound, are folded into their convolution);
  ``conv1``'s backward has no input gradient, so it counts once, the others twice;
* gradients become ready in reverse registration order, a batch norm's just before its
  convolution's weight.

Regenerate the bundled files: ``python -m lowband.perf.resnet50`` (writes
``lowband/perf/profiles/resnet50-{v100,knl}.json``).
"""
from __future__ import annotations

import os
import sys
from typing import Any

from .profile import PROFILE_DIR, CodecInfo, ParamInfo, Profile


def resnet50_layers() -> list[tuple[str, str, list[int], float]]:
    """(parameter name, module, shape, forward multiply-adds per sample of the module owning it
    (0 for batch-norm and bias parameters)) in registration order."""
    out: list[tuple[str, str, list[int], float]] = []

    def conv(name: str, cout: int, cin: int, k: int, hw: int) -> None:
        out.append((f"{name}.weight", name, [cout, cin, k, k], float(cout * cin * k * k * hw * hw)))

    def bn(name: str, c: int) -> None:
        out.append((f"{name}.weight", name, [c], 0.0))
        out.append((f"{name}.bias", name, [c], 0.0))

    conv("conv1", 64, 3, 7, 112)
    bn("bn1", 64)
    cin, hw = 64, 56
    for stage, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            stride = 2 if stage > 1 and b == 0 else 1
            p = f"layer{stage}.{b}"
            out_hw = hw // stride
            conv(f"{p}.conv1", planes, cin, 1, hw)
            bn(f"{p}.bn1", planes)
            conv(f"{p}.conv2", planes, planes, 3, out_hw)      # v1.5: the stride is on the 3x3
            bn(f"{p}.bn2", planes)
            conv(f"{p}.conv3", planes * 4, planes, 1, out_hw)
            bn(f"{p}.bn3", planes * 4)
            if b == 0:
                conv(f"{p}.downsample.0", planes * 4, cin, 1, out_hw)
                bn(f"{p}.downsample.1", planes * 4)
            cin, hw = planes * 4, out_hw
    out.append(("fc.weight", "fc", [1000, 2048], 1000.0 * 2048))
    out.append(("fc.bias", "fc", [1000], 0.0))
    return out


def _is_norm(module: str) -> bool:
    last = module.split(".")[-1]
    return last.startswith("bn") or module.endswith("downsample.1")


def resnet50_profile(images_per_s: float, batch_size: int, optimizer_s: float, *, source: str, machine: str,
                     codecs: dict[str, CodecInfo], codec_shares_compute: bool, notes: list[str]) -> Profile:
    layers = resnet50_layers()
    params = [ParamInfo(name=n, module=m, shape=s, element_size=4, norm=_is_norm(m)) for n, m, s, _ in layers]
    step = batch_size / images_per_s - optimizer_s
    forward, backward = step / 3, 2 * step / 3
    weights = [(2.0 if n != "conv1.weight" else 1.0) * macs for n, _, _, macs in layers]
    total_w = sum(weights)
    order = list(range(len(layers)))[::-1]
    backward_s = [backward * weights[i] / total_w for i in order]
    # BatchNorm buffers: running mean and variance (fp32) per channel
    buffer_bytes = sum(2 * 4 * p.numel for p in params if p.norm and p.name.endswith(".weight"))
    return Profile(model="resnet50", batch_size=batch_size, forward_s=forward, optimizer_s=optimizer_s,
                   params=params, ready_order=order, backward_s=backward_s, backward_tail_s=0.0,
                   buffer_bytes=buffer_bytes, codecs=codecs, codec_shares_compute=codec_shares_compute,
                   source=source, machine=machine, date="hand-written from published figures", notes=notes)


def v100() -> Profile:
    return resnet50_profile(
        367.0, 112, 1.0e-3,
        source="NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README, 'Training performance: NVIDIA DGX-1 "
               "16GB (8x V100 16GB)': 367 img/s FP32 on 1 GPU (pytorch-21.03 NGC container); batch 112 per GPU is "
               "that repository's DGX-1V FP32 configuration (assumed, the table does not state it)",
        machine="NVIDIA V100 16GB, FP32 (hand-written)",
        codecs={"2bit": CodecInfo(
            encode_gbps=1.81, decode_gbps=1.58, payload_ratio=1 / 16,
            note="MXNet quantizes and dequantizes on the host CPU (pinned CPU buffers): lowband's exact "
                 "MXNet-mode 2-bit codec measured on one CPU core, 25M elements (docs/codecs.md, 'Throughput')")},
        codec_shares_compute=False,
        notes=["optimizer 1.0 ms: SGD with momentum reads and writes ~20 bytes per parameter (0.5 GB) at V100's "
               "~900 GB/s, rounded up",
               "codec_shares_compute false: the GPU computes while the host CPU runs the codec",
               "per-layer times: forward:backward = 1:2 of the step, shared by multiply-adds (lowband/perf/resnet50.py)"])


def knl() -> Profile:
    return resnet50_profile(
        46.9, 16, 2.5e-3,
        source="You et al., 'ImageNet Training in Minutes' (ICPP 2018, arXiv 1709.05011): 90-epoch ResNet-50 in "
               "20 minutes on 2048 KNL nodes = 90 x 1,281,167 images / 1200 s / 2048 = 46.9 img/s per node "
               "(a lower bound on one node's speed: it includes their communication); batch 16 per node = their "
               "32K global batch / 2048",
        machine="Intel Xeon Phi 7250 (Knights Landing) node of Cori, FP32 (hand-written)",
        codecs={}, codec_shares_compute=True,
        notes=["optimizer 2.5 ms: ~0.5 GB of optimizer traffic at ~200 GB/s effective MCDRAM bandwidth (assumed)",
               "network to use with it (NERSC, Cori configuration page): Cray Aries, ~8 GB/s MPI bandwidth per node "
               "(--bandwidth 64gbit), 0.25-3.7 us MPI latency (--latency 2us)",
               "per-layer times: forward:backward = 1:2 of the step, shared by multiply-adds (lowband/perf/resnet50.py)"])


def main(argv: Any = None) -> int:
    for name, prof in (("resnet50-v100", v100()), ("resnet50-knl", knl())):
        path = os.path.join(PROFILE_DIR, name + ".json")
        prof.save(path)
        print(f"{path}: {sum(p.numel for p in prof.params):,} parameters, step {1e3 * prof.compute_s:.1f} ms "
              f"at batch {prof.batch_size}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
