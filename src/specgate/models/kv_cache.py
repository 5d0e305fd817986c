"""A static KV cache indexed by (slot, absolute position), built for speculation (gpt-fast style).

Each slot is one sequence (one request). The K/V of the token at position p of a slot live at index p, so a
rejected draft needs no undo: the next token written at that position overwrites it, and attention only ever
reads keys at positions <= the query's own position. The tensors are allocated once, zero-filled (masked
entries must be finite: a masked NaN would still poison the attention matmul), and never reallocated.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Preallocated keys and values: per layer [num_slots, num_kv_heads, max_seq_len + 1, head_dim] (the last
    position is a write-only sink for padding tokens)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1: one slot holds one sequence")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len} must be >= 1: the longest sequence (prompt + new tokens) a slot holds")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        # one spare position at index max_seq_len takes the writes of padding tokens and is never read, so a
        # write needs no boolean indexing (no nonzero, no data-dependent shapes)
        shape = (num_slots, num_kv_heads, max_seq_len + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # [S, H_kv, L+1, D] each
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # [S, H_kv, L+1, D] each

    @property
    def nbytes(self) -> int:
        """Memory held by the cache, in bytes."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def check(self, positions: Tensor, slots: Tensor) -> None:
        """Raise ValueError for positions or slots this cache cannot hold. positions [B, T] (-1 = pad), slots [B]."""
        if positions.numel() and int(positions.max()) >= self.max_seq_len:
            raise ValueError(
                f"position {int(positions.max())} does not fit in the KV cache of max_seq_len={self.max_seq_len} "
                f"(positions 0..{self.max_seq_len - 1}): create the cache with a larger max_seq_len"
            )
        if positions.numel() and int(positions.min()) < -1:
            raise ValueError(f"position {int(positions.min())} is invalid: positions are >= 0, or -1 for padding")
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            bad = int(slots.min()) if int(slots.min()) < 0 else int(slots.max())
            raise ValueError(
                f"slot {bad} is out of range 0..{self.num_slots - 1}: create the cache with more num_slots"
            )

    def write(self, layer: int, slots: Tensor, positions: Tensor, keys: Tensor, values: Tensor) -> None:
        """Store keys/values [B, H_kv, T, D] at (slots[b], positions[b, t]) for every non-pad token."""
        rows = slots[:, None].expand_as(positions)  # [B, T]
        cols = torch.where(positions >= 0, positions, self.max_seq_len)  # [B, T]: padding goes to the spare position
        # advanced indices around a slice: the indexed view is [B, T, H_kv, D]
        self.keys[layer][rows, :, cols] = keys.transpose(1, 2).to(self.keys[layer].dtype)
        self.values[layer][rows, :, cols] = values.transpose(1, 2).to(self.values[layer].dtype)

    def read(
        self, layer: int, slots: Tensor, length: int, contiguous_from: int | None, start: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Keys and values [B, H_kv, length - start, D] of positions start..length-1 of each slot.

        contiguous_from: when the slots are first, first+1, ... pass first to read a view instead of a copy.
        start: the first position read (a sliding-window layer needs no older keys).
        """
        if contiguous_from is not None:
            end = contiguous_from + slots.numel()
            return (
                self.keys[layer][contiguous_from:end, :, start:length],
                self.values[layer][contiguous_from:end, :, start:length],
            )
        return self.keys[layer][slots, :, start:length], self.values[layer][slots, :, start:length]

    def reset_slot(self, slot: int) -> None:
        """Zero one slot. Never needed for correctness (positions are overwritten before they are read); useful
        for tests and to drop a finished request's data."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is out of range 0..{self.num_slots - 1}")
        for layer in range(self.num_layers):
            self.keys[layer][slot].zero_()
            self.values[layer][slot].zero_()

    def copy_slot(self, source: int, target: int, length: int | None = None) -> None:
        """Copy positions 0..length-1 (all by default) of slot source into slot target (e.g. to fork a prefix)."""
        for slot in (source, target):
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} is out of range 0..{self.num_slots - 1}")
        length = self.max_seq_len if length is None else length
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"length={length} is out of range 0..{self.max_seq_len}")
        for layer in range(self.num_layers):
            self.keys[layer][target, :, :length] = self.keys[layer][source, :, :length]
            self.values[layer][target, :, :length] = self.values[layer][source, :, :length]
