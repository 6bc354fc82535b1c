"""The ops' flat form of a call: ``cudnn_attention::forward``/``backward`` take no Python objects, so a call crosses them
as arguments by name (:data:`OP_TAIL_SCHEMA`): :func:`op_args` writes them, :func:`from_op_args` reads them back. The
mask's arguments are the mask's own (:data:`~cudnn_attention.masking.MaskSpec.OP_SCHEMA`); the call's options the ops
take as they are (:data:`OP_OPTIONS`) close the schema.
"""

from __future__ import annotations

from .call import AttentionCall, Lengths, packed_lengths
from .masking import MaskSpec

__all__ = ["OP_OPTIONS", "OP_TAIL_SCHEMA", "from_op_args", "op_args"]

# The ops' arguments after q/k/v (and, in the backward, out/lse/grad_lse), shared by both schemas: tensors positional
# with defaults (torch's autograd registration differentiates positional tensors only, and the sinks need a gradient),
# the rest keyword-only. The call's options the ops take as they are, by the same name (OP_OPTIONS), close the tail:
# a new one is one more entry there and one more field of AttentionCall.
OP_OPTIONS = {"scale": "float scale", "deterministic": "bool? deterministic=None"}
OP_TAIL_SCHEMA = (
    "Tensor? sinks=None, Tensor? seqlens_q=None, Tensor? seqlens_kv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, "
    f"*, int max_seqlen_q=0, int max_seqlen_kv=0, {MaskSpec.OP_SCHEMA}, " + ", ".join(OP_OPTIONS.values())
)


def op_args(call: AttentionCall, lengths: Lengths, sinks) -> dict:
    """The ops' arguments for ``call`` by name, after q/k/v (see ``OP_TAIL_SCHEMA``); dense maxima are the shapes' (0)."""
    return dict(
        sinks=sinks,
        seqlens_q=lengths.seqlens_q,
        seqlens_kv=lengths.seqlens_kv,
        cu_seqlens_q=lengths.cu_seqlens_q,
        cu_seqlens_kv=lengths.cu_seqlens_kv,
        max_seqlen_q=call.max_seqlen_q if call.packed else 0,
        max_seqlen_kv=call.max_seqlen_kv if call.packed else 0,
        **call.mask.op_args(),
        **{name: getattr(call, name) for name in OP_OPTIONS},
    )


def from_op_args(
    q,
    k,
    *,
    need_lse: bool,
    grad: bool,
    sinks=None,
    seqlens_q=None,
    seqlens_kv=None,
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    max_seqlen_q: int = 0,
    max_seqlen_kv: int = 0,
    **options,
) -> tuple[AttentionCall, Lengths]:
    """The call value and its lengths, rebuilt from the ops' arguments (:func:`op_args`; ``options``: the mask's
    (:data:`~cudnn_attention.masking.MaskSpec.OP_SCHEMA`) and the :data:`OP_OPTIONS`, which the dispatcher leaves out
    where they hold their defaults)."""
    mask = MaskSpec.from_op_args(options)
    options = {name: value for name, value in options.items() if name not in MaskSpec.OP_FIELDS}
    packed = cu_seqlens_q is not None
    call = AttentionCall(
        packed=packed,
        padded=seqlens_q is not None,
        documents=cu_seqlens_q.shape[0] - 1 if packed else 0,
        max_seqlen_q=max_seqlen_q if packed else q.shape[2],
        max_seqlen_kv=max_seqlen_kv if packed else k.shape[2],
        mask=mask,
        has_sinks=sinks is not None,
        need_lse=need_lse,
        needs_grad=grad,
        **options,
    )
    if packed:
        return call, packed_lengths(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0])
    return call, Lengths(seqlens_q=seqlens_q, seqlens_kv=seqlens_kv)
