"""1-bit Adam and 0/1 Adam: Adam with a frozen variance, so that error feedback works.

Why not ``optax.chain(compressor, optax.adam(...))``? Error feedback keeps
``residual = accumulated - sent`` and relies on everything after the
compressor being *linear* in what was sent: then whatever is held back now
moves the parameters by the same amount later, and nothing is lost. Adam's
update ``m / (sqrt(v) + eps)`` is not linear: a coordinate that a sparsifier
holds back for many steps arrives as one large value, Adam normalises it to a
step of about ``lr`` (its ``v`` grows with the square of that value), and the
mass that the residual carried is rescaled away; a sign compressor's constant
magnitudes are normalised the same way. 1-bit Adam (Tang et al., 2021)
freezes ``v`` after a warm-up: from then on the update is
``m / (sqrt(v_frozen) + eps)``, linear in ``m``, and it is the momentum ``m``
that is compressed with error feedback. 0/1 Adam (Lu et al., 2022) updates
``v`` on an exponentially sparser schedule instead of a fixed warm-up, and
adds local steps that skip the synchronisation.

1-bit LAMB (Li et al., 2021) applies the same idea to LAMB: it freezes the
per-layer trust ratios with ``v`` and corrects them by a bounded factor
(:mod:`jaxcomp.transforms.onebit_lamb`, :func:`onebit_lamb`).

The code is in four modules, re-exported here:
:mod:`jaxcomp.transforms.adam_base` (the codecs, the two exchanges,
``"allgather"`` and DeepSpeed's ``"two_stage"``, and Adam's arithmetic, which
all share), :mod:`jaxcomp.transforms.onebit_adam` (:func:`onebit_adam`),
:mod:`jaxcomp.transforms.zero_one_adam` (:func:`zero_one_adam`) and
:mod:`jaxcomp.transforms.onebit_lamb` (:func:`onebit_lamb`).
"""

from jaxcomp.transforms.adam_base import ADAM_CODECS, ADAM_EXCHANGES
from jaxcomp.transforms.onebit_adam import OnebitAdamState, onebit_adam
from jaxcomp.transforms.onebit_lamb import OnebitLambState, onebit_lamb
from jaxcomp.transforms.zero_one_adam import ZeroOneAdamState, zero_one_adam

__all__ = [
    "ADAM_CODECS",
    "ADAM_EXCHANGES",
    "OnebitAdamState",
    "OnebitLambState",
    "ZeroOneAdamState",
    "onebit_adam",
    "onebit_lamb",
    "zero_one_adam",
]
