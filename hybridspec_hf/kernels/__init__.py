"""GDN verify/commit kernels. A leaf package: torch (+ triton) only.

`gdn_torch` is the CPU implementation and the reference for every Triton kernel beside it.
"""
from .gdn_torch import (
    GDNVerifyResult,
    PendingGDNLayer,
    commit_conv_state,
    commit_gdn_states,
    conv_verify,
    gdn_commit,
    gdn_recurrence,
    gdn_verify,
    l2norm,
)

__all__ = [
    "GDNVerifyResult",
    "PendingGDNLayer",
    "commit_conv_state",
    "commit_gdn_states",
    "conv_verify",
    "gdn_commit",
    "gdn_recurrence",
    "gdn_verify",
    "l2norm",
]
