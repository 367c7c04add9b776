"""The chat template proof: how many bytes a template can print, as a polynomial over the
measures of what it is handed (`prove`), whatever role, flag or field the engine's request
normalisation moves that data to. Pure, no I/O; runs once per template at start-up.

`sizes` is the algebra (measures, polynomials, `Unproven`); `core`, `ops`, `filters` and
`loops` are the abstract interpreter's parts and are private to this package.
"""

from kvproxy.tokens.bound.proof import sizes
from kvproxy.tokens.bound.proof.prove import KW, TemplateProof, prove
from kvproxy.tokens.bound.proof.sizes import Unproven

__all__ = ["KW", "TemplateProof", "Unproven", "prove", "sizes"]
