"""Two forwards of one model that differ only in rounding agree on every router call that is
not a near-tie.  A near-tie call may go the other way, and then everything downstream of it
(later layers of that token, every later token through attention) may differ as well.

:func:`agreeing_tokens` finds the first token with a differing call, checks that call is a
near-tie, and returns how many leading tokens are untouched: the tests compare those
strictly (all of them, in the usual run without any flip)."""

from __future__ import annotations

import numpy as np

from fdrr_dev.harness.fidelity import topk_margins


def agreeing_tokens(got_ids: np.ndarray, want_ids: np.ndarray, want_logits: np.ndarray,
                    near_tie: float) -> int:
    """``got_ids``/``want_ids`` ``[L, S, K]`` (order inside the top-k ignored), ``want_logits``
    ``[L, S, E]``.  Returns ``t0``: tokens ``[0, t0)`` have the same experts at every layer
    (``S`` when nothing differs).  At token ``t0`` the lowest differing layer must be a
    near-tie of ``want_logits`` (margin at most ``near_tie``); lower layers agree by
    construction, and causal attention keeps every earlier token untouched."""
    same = (np.sort(got_ids, -1) == np.sort(want_ids, -1)).all(-1)           # [L, S]
    differs = ~same.all(0)
    if not differs.any():
        return int(same.shape[1])
    t0 = int(np.argmax(differs))
    layer = int(np.argmax(~same[:, t0]))
    margin = float(topk_margins(want_logits[layer, t0], want_ids.shape[-1]))
    assert margin <= near_tie, (f"token {t0}, MoE layer {layer}: experts {sorted(got_ids[layer, t0])}"
                                f" != {sorted(want_ids[layer, t0])} at a margin of {margin:.3g}")
    return t0
