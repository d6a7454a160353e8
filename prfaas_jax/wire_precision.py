"""Which encoding each kind of state tensor crosses the wire in: ``WirePrecision``.

The encodings (specified in docs/wire-format.md, "Wire precision"; the codec's
``engine/codec/precision.py`` writes and reads them):

- ``native``: the tensor's own dtype, exact;
- ``bf16``: float32 elements rounded to bfloat16 (a 16-bit tensor travels as it is);
- ``fp8_e4m3`` / ``int8``: one float32 scale per vector along the last axis, then that vector's
  elements as float8_e4m3fn / int8.

The kinds: ``state`` (KDA, GDN and Lightning recurrent states), ``conv`` (short-conv tails),
``latent`` and ``rope`` (MLA ``c_kv`` and ``k_rope``), ``kv`` (GQA and SWA K and V).
``encoded_nbytes`` is the size rule; ``state_bytes.state_nbytes`` applies it to a whole state.
Kept free of JAX and NumPy: the router prices transfers with it.
"""

from __future__ import annotations

import dataclasses

NATIVE = "native"
ENCODINGS = (NATIVE, "bf16", "fp8_e4m3", "int8")
SCALED = ("fp8_e4m3", "int8")
KINDS = ("state", "conv", "latent", "rope", "kv")
SCALE_BYTES = 4  # a float32 before each vector of a scaled encoding


def applies(encoding: str, dtype: str) -> str:
    """The encoding a tensor of config dtype ``dtype`` travels in when ``encoding`` is asked:
    bf16 narrows float32 tensors only."""
    return NATIVE if encoding == "bf16" and dtype != "float32" else encoding


def encoded_nbytes(count: int, last: int, itemsize: int, dtype: str, encoding: str) -> int:
    """Wire bytes of ``count`` elements of dtype ``dtype`` (``itemsize`` bytes each) whose last
    axis has ``last`` elements, under ``encoding``."""
    encoding = applies(encoding, dtype)
    if encoding == NATIVE:
        return count * itemsize
    if encoding == "bf16":
        return count * 2
    return count // last * (SCALE_BYTES + last) if last else 0


@dataclasses.dataclass(frozen=True)
class WirePrecision:
    """An encoding per kind of tensor (module docstring); all ``native`` by default."""

    state: str = NATIVE  # recurrent states: KDA, GDN, Lightning
    conv: str = NATIVE  # short-convolution tails
    latent: str = NATIVE  # MLA compressed KV
    rope: str = NATIVE  # MLA decoupled rope keys
    kv: str = NATIVE  # GQA and SWA keys and values

    def __post_init__(self) -> None:
        for kind in KINDS:
            if getattr(self, kind) not in ENCODINGS:
                raise ValueError(
                    f"wire precision {kind}={getattr(self, kind)!r}: expected one of "
                    f"{', '.join(ENCODINGS)}"
                )

    @classmethod
    def parse(cls, text: str) -> WirePrecision:
        """``"int8"`` (every kind) or ``"state=int8,kv=bf16"`` (the rest native); ValueError
        naming what is wrong."""
        text = text.strip()
        if "=" not in text:
            return cls(**dict.fromkeys(KINDS, text))
        chosen: dict[str, str] = {}
        for item in text.split(","):
            kind, _, encoding = (part.strip() for part in item.partition("="))
            if kind not in KINDS:
                raise ValueError(
                    f"wire precision {item.strip()!r}: the kinds are {', '.join(KINDS)}"
                )
            if kind in chosen:
                raise ValueError(f"wire precision names {kind} twice")
            chosen[kind] = encoding
        return cls(**chosen)

    @property
    def is_native(self) -> bool:
        return all(getattr(self, kind) == NATIVE for kind in KINDS)

    def encoding(self, kind: str, dtype: str) -> str:
        """The encoding a tensor of ``kind`` and config dtype ``dtype`` travels in."""
        return applies(getattr(self, kind), dtype)

    def __str__(self) -> str:
        """The shortest text `parse` reads back: one encoding, or the kinds not native."""
        encodings = {getattr(self, k) for k in KINDS}
        if len(encodings) == 1:
            return encodings.pop()
        return ",".join(f"{k}={getattr(self, k)}" for k in KINDS if getattr(self, k) != NATIVE)


WIRE_NATIVE = WirePrecision()
