"""``StepContext``: what every mixer needs to know about the tokens it is processing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from prfaas_jax.ops.dispatch import Impl


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Positions and validity of ``T`` new tokens appended to a state of ``lengths`` tokens.

    Rows may carry padding after their ``valid_len`` real tokens (prefill padded to a length
    bucket); padding must leave every state exactly as the valid tokens left it.
    """

    lengths: jax.Array  # [B] int32: tokens already in the state
    valid_len: jax.Array  # [B] int32: real tokens among the T new ones
    seq_len: int  # T (static)
    impl: Impl  # op implementation (static); decode still steps linear layers by recurrence
    decode: bool  # one-token decode step: recurrent forms and absorbed MLA (static)

    @property
    def positions(self) -> jax.Array:
        """[B, T] absolute positions of the new tokens."""
        return self.lengths[:, None] + jnp.arange(self.seq_len, dtype=jnp.int32)[None, :]

    @property
    def valid(self) -> jax.Array:
        """[B, T] True for real tokens, False for padding."""
        return jnp.arange(self.seq_len, dtype=jnp.int32)[None, :] < self.valid_len[:, None]

    @property
    def new_lengths(self) -> jax.Array:
        return self.lengths + self.valid_len

    def linear_impl(self) -> Impl:
        # One token through a chunked kernel would pad it to a whole chunk: use the recurrence.
        return Impl.REFERENCE if self.decode else self.impl
