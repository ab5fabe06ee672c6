"""Vectorised bit packing with plain torch ops (CPU and CUDA, no per-element Python loops).

Wire layout (one rule for every width)
--------------------------------------
Codes of ``width`` bits are written as an **MSB-first bit stream**: element ``i`` occupies stream
bits ``[i*width, (i+1)*width)``, most significant bit first. The stream is cut into bytes (first
stream bit = bit 7 of byte 0), zero-padded to a whole number of 32-bit words, and the byte
buffer is viewed as ``int32``. Hence

* ``width == 1`` is exactly ``numpy.packbits(bits, bitorder="big")``;
* ``width == 2`` is exactly MXNet's 2-bit layout (``gradient_compression-inl.h``): element ``j``
  of a 16-element block lives in byte ``j // 4`` under mask ``0xc0 >> 2*(j % 4)``, i.e. MXNet
  packs sixteen codes per 32-bit word byte by byte, and so do we.

The layout is defined on bytes; the ``int32`` view only gives the buffer a word type so that
word counts are ``ceil(n*width/32)``. The multiply tricks below view byte runs as integers and
therefore assume a little-endian host (every platform torch supports; checked at import).

Why multiplications instead of ``(codes << arange) .sum()``
----------------------------------------------------------
The obvious packing (codes as int32, shift by ``arange(0, 32, 2)``, reduce over a size-16 dim)
materialises an int32 per element (4 bytes/element of extra traffic) and runs a tiny-inner-dim
reduction that torch does not vectorise. Instead we keep one **byte per code**, view four (or
eight) neighbouring bytes as one int32 (int64) word and gather their low bits into one byte with
a single integer multiply by a "magic" constant whose partial products never overlap, so no
carries corrupt the result. That costs ~4 word-sized ops per 4 (8) elements, well below the
cost of one fp32 pass.
"""

from __future__ import annotations

import math
import sys

import torch

from .base import scratch

if sys.byteorder != "little":  # pragma: no cover - torch has no big-endian targets
    raise ImportError("lowband.codecs.bitpack assumes a little-endian host")

WORD_BITS = 32  #: bits per travelling word (int32)
WORD_DTYPE = torch.int32

# 2-bit: word w holds bytes c0 | c1<<8 | c2<<16 | c3<<24 with c_i in [0, 3]. Multiplying by
# MAGIC_2 moves c0 to bit 30, c1 to bit 28, c2 to bit 26, c3 to bit 24 (shifts 30, 20, 10, 0);
# every other partial product lands in bits 0..21 without overlap, so bits 24..31 are exactly
# c0<<6 | c1<<4 | c2<<2 | c3, the MSB-first byte.
_MAGIC_2 = (1 << 30) + (1 << 20) + (1 << 10) + 1
# Inverse: byte b times _SPREAD_2 puts copies of b at bits 0, 10, 20, 30 (no overlap); masking
# with 0xC0C0C0C0 keeps code i in the top two bits of byte i.
_SPREAD_2 = (1 << 30) + (1 << 20) + (1 << 10) + 1
_TOP2_MASK = 0xC0C0C0C0 - (1 << 32)  # as signed int32
_LOW2_MASK = 0x03030303
_LOW1_MASK_32 = 0x01010101
# 1-bit: int64 word holds 8 bytes b_k (k = 0..7, b_k in {0,1}); the product with _MAGIC_1 puts
# b_k at bit 63-k and nothing else in bits 56..63 (classic "bit gather" multiply).
_MAGIC_1 = 0x8040201008040201 - (1 << 64)  # as signed int64
_LOW1_MASK_64 = 0x0101010101010101
# Inverse: spread byte b to 8 bytes: b * 0x0101010101010101 replicates it, & picks bit (7-k)
# in byte k, then != 0.
_REPLICATE_8 = 0x0101010101010101
_MAGIC_4 = (1 << 12) + 1
_SEVEN_F = 0x7F7F7F7F7F7F7F7F
_PICK_BITS = 0x0102040810204080


def words_for(n: int, width: int) -> int:
    """Number of int32 words holding ``n`` codes of ``width`` bits: ``ceil(n*width/32)``."""
    if n < 0 or width < 1:
        raise ValueError(f"words_for: need n >= 0 and width >= 1, got n={n}, width={width}")
    return (n * width + WORD_BITS - 1) // WORD_BITS


def code_buffer(n: int, width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed uint8 buffer, one byte per code, padded so the packed bytes fill whole words.

    Callers write codes into ``buf[:n]``; the padding stays zero, which is what the packers
    expect (padding codes decode to 0 and are sliced off).
    """
    per_word = WORD_BITS // width
    return torch.zeros(words_for(n, width) * per_word, dtype=torch.uint8, device=device)


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in [0, 3], one per byte, into int32 words (16 codes per word).

    ``codes.numel()`` must be a multiple of 16 (use :func:`code_buffer`); the result has
    ``codes.numel() // 16`` words. Values above 3 are a caller bug and corrupt neighbours.
    """
    if codes.dtype != torch.uint8 or codes.numel() % 16:
        raise ValueError("pack_2bit needs a uint8 tensor whose numel is a multiple of 16")
    quads = codes.reshape(-1).view(torch.int32)  # 4 codes per int32, byte i = code i
    packed = torch.mul(quads, _MAGIC_2)
    packed.bitwise_right_shift_(24)  # arithmetic shift; only the low byte is kept below
    return packed.to(torch.uint8).view(torch.int32)


def unpack_2bit(words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: uint8 codes in [0, 3], ``n`` of them."""
    spread = words.reshape(-1).view(torch.uint8).to(torch.int32)
    spread.mul_(_SPREAD_2).bitwise_and_(_TOP2_MASK).bitwise_right_shift_(6)
    spread.bitwise_and_(_LOW2_MASK)  # undo sign extension of the arithmetic shift
    return spread.view(torch.uint8)[:n]


def pack_1bit(bits: torch.Tensor) -> torch.Tensor:
    """Pack uint8/bool bits (one per byte, values 0/1) into int32 words, 32 per word.

    ``bits.numel()`` must be a multiple of 32 (use :func:`code_buffer`).
    """
    if bits.dtype not in (torch.uint8, torch.bool) or bits.numel() % 32:
        raise ValueError("pack_1bit needs a uint8/bool tensor whose numel is a multiple of 32")
    octets = bits.reshape(-1).view(torch.uint8).view(torch.int64)
    packed = torch.mul(octets, _MAGIC_1)
    packed.bitwise_right_shift_(56)
    return packed.to(torch.uint8).view(torch.int32)


def unpack_1bit(words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_1bit`: uint8 bits (0/1), ``n`` of them."""
    spread = words.reshape(-1).view(torch.uint8).to(torch.int64)
    spread.mul_(_REPLICATE_8).bitwise_and_(_PICK_BITS)
    # byte k now holds bit (7-k) of the source byte in place. Normalise every byte to 0/1
    # without a (slow, bool-producing) comparison: adding 0x7F sets bit 7 iff the byte is
    # non-zero, and cannot carry into the next byte because each byte is at most 0x80.
    # (shift before masking: the arithmetic shift sign-extends into the top byte)
    spread.add_(_SEVEN_F).bitwise_right_shift_(7).bitwise_and_(_LOW1_MASK_64)
    return spread.view(torch.uint8)[:n]


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack unsigned integer codes of any ``width`` (1..16 bits) into ``ceil(n*width/32)`` words.

    Same MSB-first stream layout as the 1- and 2-bit packers, so ``pack_bits(c, 2)`` equals
    ``pack_2bit`` on padded input. Widths 1, 2, 4 and 8 take byte-level fast paths; other widths
    go through bit planes (``n*width`` bytes of scratch), which is simple and exact but slower.
    """
    if not 1 <= width <= 16:
        raise ValueError(f"pack_bits supports widths 1..16, got {width}")
    flat = codes.reshape(-1)
    n = flat.numel()
    if width in (1, 2, 4, 8):
        buf = code_buffer(n, width, device=flat.device)
        buf[:n] = flat
        if width == 1:
            return pack_1bit(buf)
        if width == 2:
            return pack_2bit(buf)
        if width == 8:
            return buf.view(torch.int32)
        # width 4: int16 pair c0 | c1<<8; times (1<<12 | 1) puts c0 at bits 12..15 and c1 at
        # 8..11 (c0 also at 0..3, disjoint), so the high byte is c0<<4 | c1.
        pairs = buf.view(torch.int16) * _MAGIC_4
        return pairs.bitwise_right_shift_(8).to(torch.uint8).view(torch.int32)
    shifts = torch.arange(width - 1, -1, -1, device=flat.device, dtype=torch.int32)
    planes = (flat.to(torch.int32).unsqueeze(1) >> shifts).bitwise_and_(1)  # (n, width), MSB first
    stream = code_buffer(n * width, 1, device=flat.device)
    stream[: n * width] = planes.reshape(-1)
    return pack_1bit(stream)


def unpack_bits(words: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int32 codes, ``n`` of them."""
    if not 1 <= width <= 16:
        raise ValueError(f"unpack_bits supports widths 1..16, got {width}")
    if width == 1:
        return unpack_1bit(words, n).to(torch.int32)
    if width == 2:
        return unpack_2bit(words, n).to(torch.int32)
    packed = words.reshape(-1).view(torch.uint8)
    if width == 8:
        return packed[:n].to(torch.int32)
    if width == 4:
        wide = packed.to(torch.int16)
        pairs = (wide >> 4) | ((wide & 0x0F) << 8)  # little-endian bytes: c0 then c1
        return pairs.view(torch.uint8)[:n].to(torch.int32)
    planes = unpack_1bit(words, n * width).to(torch.int32).reshape(n, width)
    shifts = torch.arange(width - 1, -1, -1, device=planes.device, dtype=torch.int32)
    return (planes << shifts).sum(dim=1, dtype=torch.int32)


def bits_for_levels(levels: int) -> int:
    """Bits needed to store an integer in [0, levels]: ``ceil(log2(levels + 1))``."""
    return max(1, math.ceil(math.log2(levels + 1)))


def pack_ternary(signs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack int8 signs in {-1, 0, +1} (one per byte, numel a multiple of 16) as MXNet 2-bit codes.

    MXNet codes: ``+1 -> 0b11``, ``-1 -> 0b10``, ``0 -> 0b00``. In two's complement the byte of +1
    is 0x01 and of -1 is 0xFF, so with ``b0`` = bit 0 and ``b1`` = bit 1 of each byte the MXNet
    code is ``3*b0 - b1`` (never borrows because ``b1 <= b0``). Multiplication distributes, so
    the packed byte is ``(b0*3*MAGIC - b1*MAGIC) >> 24`` computed on four bytes at once.
    ``out`` (uint8, ``numel/4`` bytes) receives the packed bytes; temporaries come from the
    per-thread scratch so blocked callers allocate nothing.
    """
    if signs.dtype != torch.int8 or signs.numel() % 16:
        raise ValueError("pack_ternary needs an int8 tensor whose numel is a multiple of 16")
    quads = signs.reshape(-1).view(torch.int32)
    m = quads.numel()
    b0 = scratch.get("pack.b0", m, torch.int32, quads.device)
    b1 = scratch.get("pack.b1", m, torch.int32, quads.device)
    torch.bitwise_and(quads, _LOW1_MASK_32, out=b0).mul_(_wrap32(3 * _MAGIC_2))
    torch.bitwise_right_shift(quads, 1, out=b1).bitwise_and_(_LOW1_MASK_32).mul_(_MAGIC_2)
    b0.sub_(b1).bitwise_right_shift_(24)
    if out is None:
        return b0.to(torch.uint8).view(torch.int32)
    out.copy_(b0)  # int32 -> uint8 keeps the low byte
    return out


def unpack_ternary(words: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: int8 signs in {-1, 0, +1}, ``n`` of them.

    ``words`` may also be a uint8 view of the packed bytes. Like MXNet's dequantizer, only
    ``0b11`` decodes to +1 and only ``0b10`` to -1; the unused code ``0b01`` decodes to 0.
    ``out`` (int8, >= ``n`` elements rounded up to 4) receives the signs; otherwise fresh memory.
    """
    packed = words.reshape(-1).view(torch.uint8)
    m = packed.numel()
    spread = scratch.get("unpack.spread", m, torch.int32, packed.device)
    spread.copy_(packed)
    spread.mul_(_SPREAD_2).bitwise_and_(_TOP2_MASK)  # code i in bits 7..6 of byte i
    hi = torch.empty(m, dtype=torch.int32, device=packed.device) if out is None else (
        out[: 4 * m].view(torch.int32)
    )
    lo = scratch.get("unpack.lo", m, torch.int32, packed.device)
    torch.bitwise_right_shift(spread, 7, out=hi).bitwise_and_(_LOW1_MASK_32)  # "non-zero" bit
    torch.bitwise_right_shift(spread, 6, out=lo).bitwise_and_(_LOW1_MASK_32)  # "positive" bit
    lo.bitwise_and_(hi)
    # byte = nz*0xFF XOR pos*0xFE: 0b11 -> 0x01 (+1), 0b10 -> 0xFF (-1), else 0x00
    hi.mul_(0xFF).bitwise_xor_(lo.mul_(0xFE))
    return hi.view(torch.int8)[:n]


def _wrap32(value: int) -> int:
    """Reduce a Python int to the signed int32 with the same low 32 bits (torch scalar args)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
