"""Streaming statistics with bounded memory. Each accumulator has ``update(x)`` and
``state()``/``from_state()`` (plain tensors and numbers, so captures save with weights_only)."""
from __future__ import annotations

import math
from typing import Any

import torch

Tensor = torch.Tensor


def _floating(x: Tensor) -> Tensor:
    """float32 or float64 as given; half precision (and integers) widened to float32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class Moments:
    """Count, min, max, mean and std, per channel (last dim) or overall; float64, mergeable."""

    def __init__(self, channels: int | None = None) -> None:
        shape = (channels,) if channels else ()
        self.n = 0
        self.min = torch.full(shape, math.inf, dtype=torch.float64)
        self.max = torch.full(shape, -math.inf, dtype=torch.float64)
        self.sum = torch.zeros(shape, dtype=torch.float64)
        self.sumsq = torch.zeros(shape, dtype=torch.float64)
        self.per_channel = channels is not None

    def update(self, x: Tensor) -> None:
        """Why not simply ``x.double()``: a float64 copy of every captured tensor was most of a
        capture's time. Min and max are exact in the tensor's own precision; the sums are
        accumulated in float64 without a copy, and the squares are taken about the batch mean
        (``Σx² = Σ(x−a)² + 2aΣx − n·a²``), so that squaring in float32 loses nothing that
        matters even for a channel whose mean is far larger than its spread."""
        x = _floating(x.detach())
        x = x.reshape(-1, x.shape[-1]) if self.per_channel else x.reshape(-1)
        n = x.shape[0]
        if n == 0:
            return
        lo, hi = torch.aminmax(x, dim=0)
        s = x.sum(0, dtype=torch.float64)
        a = (s / n).to(x.dtype)
        c = x - a
        a = a.double()
        self.n += n
        self.min = torch.minimum(self.min, lo.double())
        self.max = torch.maximum(self.max, hi.double())
        self.sum += s
        self.sumsq += (c * c).sum(0, dtype=torch.float64) + 2 * a * s - n * a * a

    @property
    def mean(self) -> Tensor:
        return self.sum / max(self.n, 1)

    @property
    def std(self) -> Tensor:
        var = self.sumsq / max(self.n, 1) - self.mean**2
        return var.clamp_min(0).sqrt()

    def state(self) -> dict[str, Any]:
        return {"n": self.n, "min": self.min, "max": self.max, "sum": self.sum, "sumsq": self.sumsq, "pc": self.per_channel}

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> "Moments":
        m = cls.__new__(cls)
        m.n, m.min, m.max, m.sum, m.sumsq, m.per_channel = s["n"], s["min"], s["max"], s["sum"], s["sumsq"], s["pc"]
        return m


class LinearHistogram:
    """Fixed bin count over a range that doubles when data falls outside it.

    Bins are anchored at 0 with width ``w``: bin k covers [k·w, (k+1)·w). Doubling merges bin
    pairs, so counts stay exact: the result equals ``numpy.histogram`` on all values at once
    with the final edges (tested).
    """

    def __init__(self, bins: int = 256) -> None:
        self.bins = bins
        self.width = 0.0
        self.k0 = 0
        self.counts = torch.zeros(bins, dtype=torch.float64)

    @property
    def edges(self) -> Tensor:
        return (self.k0 + torch.arange(self.bins + 1, dtype=torch.float64)) * self.width

    def update(self, x: Tensor) -> None:
        x = _floating(x.detach()).flatten()
        if x.numel() == 0:
            return
        lo, hi = (float(v) for v in torch.aminmax(x))
        if self.width == 0.0:
            span = max(hi - lo, abs(hi), abs(lo), 1e-12)
            self.width = 2.0 ** math.ceil(math.log2(span / (self.bins - 2)))
            self.k0 = math.floor(lo / self.width)
        while not (self.k0 * self.width <= lo and hi < (self.k0 + self.bins) * self.width):
            self._double()
        # the width is a power of two, so x · (1/width) is exact in the tensor's own precision;
        # only a negative value so small that the product underflows to -0 needs its bin (-1) back
        k = torch.floor(x * (1.0 / self.width))
        k = torch.where((k == 0) & (x < 0), -1.0, k)
        idx = k.long() - self.k0
        self.counts += torch.bincount(idx.clamp_(0, self.bins - 1), minlength=self.bins).double()

    def _double(self) -> None:
        """Merge bin pairs (2K, 2K+1) -> K and re-centre; counts stay exact."""
        c, lo = self.counts, self.k0
        if lo % 2:  # align pairs on even absolute bin indices
            c, lo = torch.cat([torch.zeros(1, dtype=torch.float64), c]), lo - 1
        if c.numel() % 2:
            c = torch.cat([c, torch.zeros(1, dtype=torch.float64)])
        pairs = c.reshape(-1, 2).sum(1)
        shift = (self.bins - pairs.numel()) // 2  # grow the range on both sides
        self.counts = torch.zeros(self.bins, dtype=torch.float64)
        self.counts[shift : shift + pairs.numel()] = pairs
        self.k0 = lo // 2 - shift
        self.width *= 2

    def state(self) -> dict[str, Any]:
        return {"bins": self.bins, "width": self.width, "k0": self.k0, "counts": self.counts}

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> "LinearHistogram":
        h = cls(s["bins"])
        h.width, h.k0, h.counts = s["width"], s["k0"], s["counts"]
        return h


#: log2 bins for probabilities: bin 0 holds exact zeros, bin i (1..LOG_BINS) holds
#: [2^-(LOG_BINS-i+1), 2^-(LOG_BINS-i)), the last bin [0.5, 1].
LOG_BINS = 32


def log2_bin_edges() -> Tensor:
    """Upper-open edges of the non-zero log2 bins: 2^-32 … 2^0 (33 values)."""
    return torch.exp2(-torch.arange(LOG_BINS, -1, -1, dtype=torch.float64))


def log2_bin_index(p: Tensor) -> Tensor:
    """Bin index per value: 0 for p <= 0 (and below 2^-32), then one bin per octave.

    The octave is the binary exponent itself (``frexp``: p = m·2^E, m in [0.5, 1), so
    p in [2^(E-1), 2^E)): exact, where a rounded log2 could put a value just under a power
    of two one octave up."""
    _, exp = torch.frexp(_floating(p))
    idx = (exp + LOG_BINS).clamp_(0, LOG_BINS).long()
    return torch.where(p > 0, idx, torch.zeros_like(idx))


def log2_histogram(p: Tensor, groups: Tensor, n_groups: int) -> Tensor:
    """[n_groups, LOG_BINS + 1] counts of probabilities ``p`` by integer ``groups`` (same shape)."""
    idx = groups.long().flatten() * (LOG_BINS + 1) + log2_bin_index(p).flatten()
    return torch.bincount(idx, minlength=n_groups * (LOG_BINS + 1)).double().reshape(n_groups, LOG_BINS + 1)


class ImageReservoir:
    """Reservoir sampling over images (Algorithm R): keeps ``capacity`` whole images.

    One shared instance decides for every site, so the kept tensors of different sites belong
    to the same images (softmax and v match for the attention-output error).
    """

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity = capacity
        self.seen = 0
        self.gen = torch.Generator().manual_seed(seed)

    def slots(self, batch: int) -> list[tuple[int, int]]:
        """(index in batch, slot) pairs to write for the next ``batch`` images."""
        out = []
        for i in range(batch):
            t = self.seen + i
            if t < self.capacity:
                out.append((i, t))
            else:
                j = int(torch.randint(0, t + 1, (1,), generator=self.gen))
                if j < self.capacity:
                    out.append((i, j))
        self.seen += batch
        return out
